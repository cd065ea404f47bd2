"""
The collectives, in one place, and the ledger the tests read.

Every collective is asynchronous; the caller waits on its handle when it must. On CUDA the wait
makes the stream wait on NCCL's; on gloo it blocks the host. The same calls run on gloo and NCCL,
so the CPU tests exercise what GPU users run.

`ledger` counts collectives and bytes and, when `ledger.events` is a list, logs each unit's
events in order (gathers issued and waited, forward, backward, reductions, frees).
"""
import functools
from contextlib import nullcontext
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function


KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def collective_bytes(tensors):
    """A collective's size: its largest tensor, the larger of its input and output, what a rank sends
    or receives (nccl-tests' size). The one byte rule of every counter: ledger, observe.py, plan.py."""
    return max(t.numel() * t.element_size() for t in tensors)


class Ledger:
    """Collectives issued and their bytes (collective_bytes) by kind; with record_events, the order
    of each unit's events."""

    def __init__(self, record_events=False):
        self.counts, self.bytes = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
        self.events = [] if record_events else None

    reset = __init__

    def count(self, kind, *tensors):
        self.counts[kind] += 1
        self.bytes[kind] += collective_bytes(tensors)

    def log(self, event, unit):
        if self.events is not None:
            self.events.append((event, unit))


ledger = Ledger()

NOTHING = nullcontext()  # (one, shared: creating one per use costs a call on every unit's hot path)


def on_stream(stream):
    """Run what follows on `stream` (a CUDA stream), or where it would have run (None).
    (torch.cuda.stream(None) is a no-op too, but costlier, on every unit's host-bound hot path.)"""
    return torch.cuda.stream(stream) if stream is not None else NOTHING


def profiled(name):
    """A named range in profiler traces (free when no profiler is running)."""
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else NOTHING


def begin_range(name):
    """Open a named profiler range (profiled) that a later hook closes with its __exit__: a unit's
    forward or backward spans two hooks, so it cannot be a `with` block."""
    profiler_range = profiled(name)
    profiler_range.__enter__()
    return profiler_range


_OLDER_NAMES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def library_collective(name):
    """torch.distributed's collective by its torch 2.13 name, or by its older one on earlier releases,
    which 2.13 keeps as a deprecated alias. Looked up at each call, so observe.py's counters see it."""
    return getattr(dist, name, None) or getattr(dist, _OLDER_NAMES[name])


class Done:
    """The handle of a collective that had nothing to wait for (one rank: a local copy)."""

    def wait(self):
        return True


def all_gather(output, shard, group):
    """Every rank's `shard` into `output` ([W * shard numel], rank-major). Returns a handle.
    With one rank there is nothing to gather: a copy (FSDP2 skips the collective too)."""
    ledger.count("all_gather", output)
    if group.size() == 1:
        output.copy_(shard, non_blocking=True)  # (asynchronous from a pinned, offloaded shard)
        return Done()
    return library_collective("all_gather_single")(output, shard, group=group, async_op=True)


def reduce_scatter(output, input, group, op=dist.ReduceOp.AVG):
    """Reduce `input` (rank-major chunks) over the group, averaging by default, into this rank's chunk
    `output`. With one rank nothing is reduced: the caller passes the input as the output."""
    ledger.count("reduce_scatter", input)
    if group.size() == 1:
        if output is not input:
            output.copy_(input)
        return Done()
    return library_collective("reduce_scatter_single")(output, input, op=op, group=group, async_op=True)


def all_reduce(tensor, group, op=dist.ReduceOp.AVG):
    """Reduce `tensor` in place across the group (HSDP: across replicas), averaging by default."""
    ledger.count("all_reduce", tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


class ReductionOps(NamedTuple):
    divide_before: Optional[float]  # the reduce-scatter's input, first
    reduce_scatter: dist.ReduceOp
    all_reduce: dist.ReduceOp  # HSDP's, across replicas
    divide_after: Optional[float]  # the reduced result, last


@functools.lru_cache(maxsize=None)  # (asked per unit and step: the answer depends on settings alone)
def reduction_ops(shard_size, replicas, dtype, factor=None, sums_only=False):
    """How gradients are averaged, as FSDP2's: in float32 and bfloat16 the collectives divide (AVG, or
    PREMUL_SUM by 1/factor), unless sums_only asks for SUM and a division after. Other dtypes risk
    overflow: SUM, with the division split before and after."""
    ranks = shard_size * replicas
    if dtype in (torch.float32, torch.bfloat16) and not sums_only:
        if factor is None:
            op = dist.ReduceOp.SUM if ranks == 1 else dist.ReduceOp.AVG
            return ReductionOps(None, op, op, None)
        op = dist.ReduceOp.AVG if factor == shard_size else dist.ReduceOp.PREMUL_SUM(1 / factor)
        return ReductionOps(None, op, dist.ReduceOp.SUM, None)
    factor = float(ranks) if factor is None else factor
    if dtype in (torch.float32, torch.bfloat16):
        return ReductionOps(None, dist.ReduceOp.SUM, dist.ReduceOp.SUM, factor)
    before = 1
    while factor % before == 0 and factor / before > before:
        before *= 2
    return ReductionOps(before, dist.ReduceOp.SUM, dist.ReduceOp.SUM, factor / before)
