"""
The collectives, in one place, and the ledger that tests and bench.py read.

Every collective is issued asynchronously (`async_op=True`) and returns a work handle; the
caller decides when to wait. On CUDA the handle's wait() makes the current stream wait on
NCCL's stream (no host block), on gloo it blocks the host until the transfer is done, so on
both the communication runs while the caller computes, until the wait.

`ledger` counts collectives and bytes and, when `ledger.events` is a list, logs the order of
events (all-gather issued / waited, forward / backward of a unit, reduce-scatter issued /
waited, free). Logging costs one `if` per event when off.
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function


class Ledger:
    def __init__(self):
        self.reset()

    def reset(self, record_events=False):
        self.counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.events = [] if record_events else None

    def log(self, event, unit):
        if self.events is not None:
            self.events.append((event, unit))

    def count(self, kind, nbytes):
        self.counts[kind] += 1
        self.bytes[kind] += nbytes


ledger = Ledger()


def profiled(name):
    """A named range in profiler traces (free when no profiler is running)."""
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else nullcontext()


def begin_range(name):
    """Open a named profiler range that a later hook closes with end_range(): a unit's forward or
    backward spans two hooks, so it cannot be a `with` block. None when no profiler is running."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return None
    profiler_range = record_function(name)
    profiler_range.__enter__()
    return profiler_range


def end_range(profiler_range):
    if profiler_range is not None:
        profiler_range.__exit__(None, None, None)


_OLDER_NAMES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def library_collective(name):
    """torch.distributed's collective by its torch 2.13 name, or by its older one on earlier releases
    (the GPU machines' 2.11), which 2.13 keeps as a deprecated alias. Looked up at each call, so that
    observe.py's counting wrappers see it."""
    return getattr(dist, name, None) or getattr(dist, _OLDER_NAMES[name])

# tags keep the messages of an all-gather and a reduce-scatter in flight at once apart
GATHER_TAG, REDUCE_TAG = 1, 2


class _Exchange:
    """Point-to-point messages that together do one collective; wait() waits for all of them.
    With no messages (one rank: the work is a local copy) it is complete at once."""
    works = ()

    def wait(self):
        for work in self.works:
            work.wait()
        self.finish()

    def finish(self):
        pass


def all_gather(output, shard, group):
    """Gather every rank's equal-sized `shard` into `output` (rank-major). Returns a handle.

    With one rank there is nothing to gather: a copy, no collective (FSDP2 skips it too). On
    gloo with CPU tensors the ranks exchange shards point to point (see _ExchangeGather).
    """
    ledger.count("all_gather", output.numel() * output.element_size())
    if group.size() == 1:
        output.copy_(shard, non_blocking=True)  # (asynchronous from a pinned, offloaded shard)
        return _Exchange()
    if dist.get_backend(group) == "gloo" and output.is_cpu:
        return _ExchangeGather(output, shard, group)
    return library_collective("all_gather_single")(output, shard, group=group, async_op=True)


class _ExchangeGather(_Exchange):
    """All-gather on gloo: send our shard to every peer, receive theirs straight into `output`.

    gloo's all-gather allocates an output-sized buffer per call and copies out of it: a fresh
    unit-sized allocation every time, which on CPU lands on new heap pages (about 225 MB of
    them per step at 47M parameters; see IMPLEMENTATION.md). Here nothing is allocated and
    nothing is copied twice; each rank sends W-1 shards, as gloo's ring does. No arithmetic, so
    the bits are the same.
    """

    def __init__(self, output, shard, group):
        me, chunks = group.rank(), output.view(group.size(), -1)
        self.works = []
        for peer in range(group.size()):
            if peer != me:
                peer_rank = dist.get_global_rank(group, peer)
                self.works += [dist.isend(shard, peer_rank, group=group, tag=GATHER_TAG),
                               dist.irecv(chunks[peer], peer_rank, group=group, tag=GATHER_TAG)]
        chunks[me].copy_(shard)


def reduce_scatter(output, input, group):
    """Average `input` (rank-major chunks) over the group; this rank's chunk lands in `output`.

    With one rank there is nothing to reduce: a copy, as FSDP2 does. On gloo with two ranks (CPU
    tensors) the ranks swap halves point to point (see _PairReduction); otherwise the library's
    reduce-scatter.
    """
    ledger.count("reduce_scatter", input.numel() * input.element_size())
    if group.size() == 1:
        output.copy_(input)
        return _Exchange()
    if group.size() == 2 and dist.get_backend(group) == "gloo" and input.is_cpu:
        return _PairReduction(output, input, group)
    return library_collective("reduce_scatter_single")(output, input, op=dist.ReduceOp.AVG, group=group,
                                                       async_op=True)


class _PairReduction(_Exchange):
    """Reduce-scatter of two gloo ranks: send the peer its half, receive ours into `output`, add.

    gloo's reduce-scatter is a whole all-reduce plus copies: each rank receives every chunk
    reduced, twice the bytes it needs, into buffers of the input's size. Here each rank sends
    and receives half the input, straight into the output, and adds its own half at wait().
    With two ranks this is bitwise gloo's answer ((a + b) / 2 in either order); with more,
    gloo's summation order depends on its internal segmentation, so we keep its collective
    there for FSDP2's exact bits.
    """

    def __init__(self, output, input, group):
        mine, peer = group.rank(), 1 - group.rank()
        peer_rank = dist.get_global_rank(group, peer)
        halves = input.view(2, -1)
        self.output, self.own_half = output, halves[mine]
        self.works = [dist.isend(halves[peer], peer_rank, group=group, tag=REDUCE_TAG),
                      dist.irecv(output, peer_rank, group=group, tag=REDUCE_TAG)]

    def finish(self):
        self.output.add_(self.own_half).div_(2)
        self.own_half = None


def all_reduce_mean(tensor, group):
    """Average `tensor` in place across the group (HSDP: across replicas)."""
    ledger.count("all_reduce", tensor.numel() * tensor.element_size())
    return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=True)
