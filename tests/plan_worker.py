"""
plan.py's training steps for real, measured by the allocator's own events, for tests/test_plan.py.

    python tests/plan_worker.py CASES.json OUT.json

CASES.json lists [backend, world size, rank, [--key=value ...]]. For each case this process runs
planner.run() twice: once with fake tensors (the plan), once with real ones under torch.profiler with
profile_memory=True. Both run as one rank of W in this process, in a process group whose
collectives complete at once on this thread: PyTorch's fake one, or for DDP's real run (its reducer
wants a result) a silent one of our own. So every free happens where the program drops its tensor;
the collectives' own buffers (gloo's, NCCL's) are not the program's. The measured peak is the
running sum of the allocation and free events' bytes, in time order. The measured communication is
the last step's: the bytes FSDP2 and fsdp_impl hand torch.distributed's Python API, or those DDP's
reducer hands the silent group.
"""
import gc
import json
import sys
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import observe  # noqa: E402
import planner  # noqa: E402
import training  # noqa: E402


def done(result):
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


TALLY = {}  # collective kind -> bytes the silent group moved in this training step (as tensors sent or received)


def tally(kind, *tensors):
    nbytes = max(t.numel() * t.element_size() for t in tree_flatten(tensors)[0])
    TALLY[kind] = TALLY.get(kind, 0) + nbytes


class SilentGroup(dist.ProcessGroup):
    """Collectives that complete at once, on this thread, as if every rank held this rank's
    tensors: nothing allocated, nothing freed elsewhere. (PyTorch's fake group leaves DDP's
    reducer without the result it expects.) Each one's bytes go into TALLY."""

    def allreduce(self, tensors, opts=None):
        tally("all_reduce", tensors)
        return done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        tally("all_reduce", tensors)
        return done(tensors)

    def broadcast(self, tensors, opts=None):
        tally("broadcast", tensors)
        return done(tensors)

    def allgather(self, outputs, inputs, opts=None):
        tally("all_gather", outputs, inputs)
        for outs, tensor in zip(outputs, inputs):
            for out in outs:
                out.copy_(tensor)
        return done(outputs)

    def _allgather_base(self, output, tensor, opts=None):
        tally("all_gather", output, tensor)
        for out in output.chunk(self.size()):
            out.copy_(tensor.view_as(out))
        return done([output])

    def reduce_scatter(self, outputs, inputs, opts=None):
        tally("reduce_scatter", outputs, inputs)
        return done(outputs)

    def _reduce_scatter_base(self, output, tensor, opts=None):
        tally("reduce_scatter", output, tensor)
        return done([output])

    def barrier(self, opts=None):
        return done([])

    def getBackendName(self):
        return "silent"


dist.Backend.register_backend("silent", lambda store, rank, size, timeout: SilentGroup(rank, size), devices=["cpu"])


def measured_peak(prof):
    """The CPU allocator's own running total, reported with each allocation and free while the
    profiler ran (kept under its lock, so in the true order): its largest rise over where it stood
    when profiling began (it keeps counting across profiling sessions). A float8 matmul on the CPU
    (aten::_scaled_mm) is emulated: float32 copies of its operands are made and freed inside the one
    op, where a GPU's kernel makes its output alone. Such an op counts as its output, at its start."""
    outside, matmuls, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.name == "aten::_scaled_mm":
            matmuls.append(memory_events([event]))
        elif event.name == "[memory]":
            outside.append(event)
        else:
            stack.extend(event.children)
    events = outside + [e for inside in matmuls for e in inside]
    first = min(events, key=lambda e: e.start_time_ns)
    start = first.extra_fields.total_allocated - first.extra_fields.alloc_size
    peaks = [e.extra_fields.total_allocated for e in outside]
    for inside in filter(None, matmuls):
        before = min(inside, key=lambda e: e.start_time_ns)
        peaks.append(before.extra_fields.total_allocated - before.extra_fields.alloc_size
                     + sum(e.extra_fields.alloc_size for e in inside))
    return max(peaks) - start


def memory_events(events):
    """The allocation and free events under `events`."""
    found, stack = [], list(events)
    while stack:
        event = stack.pop()
        if event.name == "[memory]":
            found.append(event)
        stack.extend(event.children)
    return found


def case(backend, world, rank, argv):
    settings = training.settings(argv)
    settings["vocab_size"] = training.vocab_size(settings)
    planned, planned_state, _ = planner.run(settings, backend, world, rank)
    gc.collect()  # (an earlier case's tensors freed inside this one's window would lower its count)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    observed = PythonAPICollectives()  # (after the plan, which it would count too)
    counted, state, _ = planner.run(settings, backend, world, rank, fake=False, measured=lambda: prof,
                                 group=partial(planner.fake_process_group, backend="silent") if backend == "ddp" else None)
    peak = measured_peak(prof)
    if backend != "ddp":
        TALLY.update({kind: n for kind, n in observed.last_step().items() if n})
    return {"planned_peak": planned.peak, "planned_state": planned_state, "planned_where": planned.peak_where,
            "counted_real_peak": counted.peak, "measured_peak": peak, "measured_state": state,
            "planned_comm": planned.comm, "measured_comm": dict(TALLY), "planned_communicators": len(planned.groups)}


class PythonAPICollectives(observe.CommCounter):
    """The bytes FSDP2 and fsdp_impl hand torch.distributed's Python API (observe.py's counter, as
    train.py reports them), and those of the functional all-reduces DTensor issues (the grad norm's)."""

    def __init__(self):
        super().__init__()
        funcol.all_reduce = self._counting(funcol.all_reduce, "all_reduce")
        OBSERVED.append(self)

    def last_step(self):
        counts = self.take()
        return {kind: counts[f"{kind}_bytes"] for kind in set(self.KINDS.values())}


OBSERVED = []


def step_tallied(*args, train_step=training.train_step, **kwargs):
    """The training step, with the tallies restarted: what is left in them after a run is the last step's."""
    TALLY.clear()
    for observed in OBSERVED:
        observed.take()
    return train_step(*args, **kwargs)


training.train_step = step_tallied


def main():
    cases, out_path = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.set_num_threads(1)
    results = {}
    for backend, world, rank, argv in cases:
        key = " ".join([backend, f"W={world}", f"rank={rank}", *argv])
        try:
            results[key] = planner.in_child(case, backend, world, rank, argv)
        except Exception:
            results[key] = {"error": traceback.format_exc()}
    out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
