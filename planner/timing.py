"""
The step's time, from the ops the plan saw. Each op gets a duration: its FLOPs over the device's
matmul rate or its bytes over the memory bandwidth, whichever is longer, plus the host's cost of
issuing it. Each collective gets its latency plus its bus bytes over the bus bandwidth. The step is
then replayed in order on three clocks: the host, the compute stream and the communication
stream. An op that reads what a collective writes waits for that collective: the schedule's real
dependencies, FSDP's waits included. On a GPU the host runs ahead of the device; on a CPU the host
computes, so its clock is the compute clock. A CPU rank with one core or less does gloo's work on
the core it computes on: there each collective stops compute for its whole length.

Left out: kernels' overlap with one another, caches, the CPU's turbo and its other processes,
NCCL's channels competing with compute for the GPU's memory, and DDP's buckets overlapping
backward (its all-reduces are issued at the step's last backward op).
"""
import glob
import json
import os
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from .opcosts import signature


class Op(NamedTuple):
    """One op of the timed step: compute (flops, bytes moved) or a collective (kind, bytes, group
    size); the storages it reads and writes; sync: the host waits for the device (.item())."""
    kind: str  # "compute" or the collective's kind
    flops: int
    nbytes: int
    dtype: torch.dtype
    group: int
    reads: frozenset
    writes: frozenset
    sync: bool
    where: str
    signature: str = None  # the op and its arguments' shapes (opcosts.py): what the CPU's op costs are keyed by


def _tensors(tree):
    from .counting import plain_tensors
    return [x for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) for x in plain_tensors(t)]


def _keys(tensors):
    return frozenset(t.untyped_storage()._cdata for t in tensors if not t.is_meta)


# CPU's attention kernels, which torch's FLOP counter does not name: the same FLOPs as the GPU's
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, **kwargs: sdpa_flop_count(q.shape, k.shape, v.shape),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, **kwargs: sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape),
}


def compute_op(func, args, kwargs, out, where):
    """The Op of one aten call: its FLOPs by torch's FLOP counter (matmuls, attention), its bytes as
    what it reads and writes (a view moves none; an in-place op writes what it reads)."""
    inputs, outputs, sig = _tensors((args, kwargs)), _tensors(out), signature(func, args, kwargs)
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        flops = formula(*args, **(kwargs or {}), out_val=out)
    elif func.overloadpacket in CPU_ATTENTION:
        flops = CPU_ATTENTION[func.overloadpacket](*args, **(kwargs or {}))
    else:
        flops = 0
    if sig == "free":  # (a view, or a read of metadata)
        nbytes = 0
    else:
        nbytes = sum(t.numel() * t.element_size() for t in inputs + outputs)
    dtype = outputs[0].dtype if outputs else torch.float32
    return Op("compute", flops, nbytes, dtype, 1, _keys(inputs), _keys(outputs),
              func is torch.ops.aten._local_scalar_dense.default, where, sig)


def collective_op(kind, nbytes, group, args, out, where):
    """The Op of one collective: what it reads, and what it writes (its outputs; c10d's in-place
    ones write their first argument)."""
    written = _tensors(out) + _tensors(args[:1])
    return Op(kind, 0, nbytes, torch.float32, group, _keys(_tensors(args)), _keys(written), False, where)


def bus_bytes(op):
    """What each rank's link carries for the collective (nccl-tests' busbw is these over the time)."""
    share = (op.group - 1) / op.group
    return op.nbytes * {"all_gather": share, "reduce_scatter": share, "all_reduce": 2 * share}.get(op.kind, 1)


def interpolate(points, x):
    """y at x on the broken line through `points` [(x, y), ...] (sorted by x); the first point's y
    below them (a latency), the last segment's slope above them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1]  # (one point alone)


class Device(NamedTuple):
    """What a device does per second, and what it costs the host to issue an op."""
    name: str
    matmul_flops: dict  # dtype -> FLOP/s of large matmuls
    bandwidth: float  # bytes/s of memory traffic
    op_seconds: float  # the host's time per op: Python, dispatch, autograd, launch
    host_runs_ahead: bool  # a GPU: the host only issues; a CPU: the host computes
    comm_latency: dict  # (kind, W) -> seconds, or kind -> seconds
    comm_busbw: dict  # (kind, W) -> bytes/s, or kind -> bytes/s
    source: str
    comm_on_compute_core: bool = False  # a CPU rank with a core or less: gloo's work takes the core it computes on
    op_costs: object = None  # a CPU's measured op costs (opcosts.OpCosts), by signature
    cores: int = 1  # a CPU's cores (the op costs are timed with the others busy)
    comm_points: dict = None  # a CPU's measured collectives beside compute: kind -> [(bus bytes, seconds), ...]
    comm_idle_points: dict = None  # the same, with the cores otherwise idle
    comm_takes: float = 1.0  # with comm_on_compute_core: the share of compute's core a collective takes

    def flops_per_second(self, dtype):
        return self.matmul_flops.get(dtype, self.matmul_flops[torch.float32])

    def comm_speed_beside_compute(self, op):
        """The share of its own speed a collective keeps beside compute: its idle time over its time there."""
        return min(self.collective_seconds(op, idle=True) / max(self.collective_seconds(op), 1e-12), 1.0)

    def compute_seconds(self, op):
        """The op's measured cost where the device has one, else its FLOPs over the matmul rate or
        its bytes over the memory bandwidth, whichever is longer."""
        measured = self.op_costs.cost(op.signature) if self.op_costs is not None else None
        if measured is not None:
            return measured
        return max(op.flops / self.flops_per_second(op.dtype), op.nbytes / self.bandwidth)

    def prepare(self, ops):
        """Measure the costs of `ops` the device lacks (a CPU's: opcosts.py), before a replay."""
        if self.op_costs is not None:
            self.op_costs.measure([op.signature for op in ops if op.kind == "compute"], self.cores)

    def collective_seconds(self, op, idle=False):
        """The collective's time: beside compute (or alone, idle=True) where measured at several
        sizes, on the broken line through them; else its latency plus its bus bytes over busbw."""
        points = self.comm_idle_points if idle and self.comm_idle_points else self.comm_points
        if points:
            return interpolate(points.get(op.kind) or points["all_reduce"], bus_bytes(op))
        key = (op.kind, op.group) if (op.kind, op.group) in self.comm_busbw else op.kind
        latency = self.comm_latency.get(key, self.comm_latency.get("all_reduce", 0.0))
        busbw = self.comm_busbw.get(key, self.comm_busbw.get("all_reduce"))
        return latency + bus_bytes(op) / busbw


class StepTime(NamedTuple):
    seconds: float  # the step, host issue to the last kernel's end
    compute_seconds: float  # the compute stream's busy time
    comm_seconds: float  # the communication stream's busy time
    exposed_comm_seconds: float  # compute waiting on collectives
    flops: int  # the step's FLOPs, as counted


def replay_on_shared_cores(ops, device, bars=None):
    """replay() where gloo's threads share the cores the ranks compute on (comm_on_compute_core):
    one clock for the host and compute, and a queue of collectives on gloo's threads. Beside each
    other they share the core: compute runs at 1 - comm_takes of its speed, a collective at its idle
    time over its time beside compute (the calibration's two figures). Alone, each runs at full
    speed: compute waiting for a collective's output leaves gloo the core. The waits and the
    slowdown are the exposed communication."""
    import collections
    t = busy = comm_busy = exposed = 0.0
    flops = 0
    queue = collections.deque()  # [op, its idle seconds left, its start] on gloo's threads, in issue order
    writing = {}  # storage key -> the queued collective writing it
    compute_speed = 1.0 - device.comm_takes

    def done(entry):
        nonlocal comm_busy
        queue.popleft()
        op, _, start = entry
        comm_busy += t - start
        for key in op.writes:
            if writing.get(key) is entry:
                del writing[key]
        if bars is not None:
            bars.append((op.kind, start, t, op.where))

    def compute(work):  # `work` seconds of compute at full speed, beside the queue
        nonlocal t
        while work > 0:
            if not queue:
                t += work
                return
            entry = queue[0]
            if entry[2] is None:
                entry[2] = t
            beside = device.comm_speed_beside_compute(entry[0])
            until_compute = work / compute_speed if compute_speed > 0 else float("inf")
            until_comm = entry[1] / beside
            if until_compute < until_comm:
                t += until_compute
                entry[1] -= until_compute * beside
                return
            t += until_comm
            work -= until_comm * compute_speed
            done(entry)

    def wait(entry):  # compute idle until `entry` is done: gloo alone, at full speed
        nonlocal t, exposed
        start = t
        while entry in queue:
            head = queue[0]
            if head[2] is None:
                head[2] = t
            t += head[1]
            done(head)
        exposed += t - start
        if bars is not None and t > start:
            bars.append(("exposed", start, t, ""))

    for op in ops:
        compute(device.op_seconds)  # (the host issues each op: the rank's own core)
        if op.kind != "compute":
            entry = [op, device.collective_seconds(op, idle=True), None]
            queue.append(entry)
            for key in op.writes:
                writing[key] = entry
            continue
        for key in op.reads:
            if key in writing:
                wait(writing[key])
        seconds = device.compute_seconds(op)
        start = t
        compute(seconds)
        exposed += t - start - seconds  # (slowed by a collective beside it)
        busy += seconds
        flops += op.flops
        if bars is not None:
            bars.append(("compute", start, t, op.where))
    while queue:  # (issued and never waited for: the step still ends after them)
        wait(queue[0])
    return StepTime(t, busy, comm_busy, exposed, flops)


def replay(ops, device, bars=None):
    """The step's time: `ops` in order on the host, compute and communication clocks. Given a list
    `bars`, each op's interval is appended to it as (lane, start, end, where): lane "compute", the
    collective's kind, or "exposed" where compute waits on a collective. A CPU whose gloo threads
    share the ranks' cores replays as replay_on_shared_cores says."""
    if device.comm_on_compute_core:
        return replay_on_shared_cores(ops, device, bars)
    host = compute = comm = busy = comm_busy = exposed = 0.0
    written_at = {}  # storage key -> when the collective writing it ends
    flops = 0
    for op in ops:
        host += device.op_seconds
        if op.kind != "compute":
            start = max(comm, compute if device.host_runs_ahead else host)  # (its input is the compute's)
            comm = start + device.collective_seconds(op)
            comm_busy += comm - start
            for key in op.writes:
                written_at[key] = comm
            if bars is not None:
                bars.append((op.kind, start, comm, op.where))
            continue
        start = max(compute, host) if device.host_runs_ahead else host
        ready = max((written_at.pop(key) for key in op.reads if key in written_at), default=0.0)
        if ready > start:
            exposed += ready - start
            if bars is not None:
                bars.append(("exposed", start, ready, op.where))
            start = ready
        seconds = device.compute_seconds(op)
        compute = start + seconds
        busy += seconds
        flops += op.flops
        if bars is not None:
            bars.append(("compute", start, compute, op.where))
        if not device.host_runs_ahead or op.sync:
            host = max(host, compute)
    return StepTime(max(host, compute, comm), busy, comm_busy, exposed, flops)


# overlap.py's lanes (on gloo a reduce-scatter runs as an all-reduce: one lane for both)
LANE_OF = {"compute": "compute", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter / all-reduce",
           "all_reduce": "reduce-scatter / all-reduce"}


def lanes(bars, seconds, device):
    """The replayed step as overlap.py draws a profiled one, in ms from its start: each lane's
    intervals (compute's merged across the host's gap between two ops), the exposed ones, and where
    each phase begins ("forward 0", "backward 0", "optimizer", ...: the plan's marks)."""
    out = {lane: [] for lane in dict.fromkeys(LANE_OF.values())}
    exposed, phases, gap = [], [], device.op_seconds * 1e3 * 1.01
    for lane, start, end, where in bars:
        a, b = start * 1e3, end * 1e3
        phase = where.split(" @ ")[0].split(" ", 2)[-1]  # ("step 2 forward 0 @ h.3": "forward 0")
        if lane != "exposed" and phase != "between steps" and (not phases or phases[-1][1] != phase):
            phases.append([a, phase])
        if lane == "exposed":
            exposed.append([a, b])
        elif lane == "compute" and out["compute"] and a - out["compute"][-1][1] <= gap:
            out["compute"][-1][1] = max(out["compute"][-1][1], b)
        elif lane in LANE_OF:
            out[LANE_OF[lane]].append([a, b, ""])
    return {"step_ms": seconds * 1e3, "lanes": out, "exposed": exposed, "phases": phases}


# Published peaks (dense, per GPU) and the fraction of them that large kernels reach. The fractions
# are scripts/plan_check.py's, measured on a lent GPU, where results/ holds them; else assumed:
# matmuls at 60% of the tensor-core peak (cuBLAS on large GEMMs), memory-bound kernels at 80% of
# HBM's bandwidth, 10 µs of host time per op (eager PyTorch's dispatch and launch). NCCL at 20 µs.
GPU_PEAKS = {  # name: (bf16 FLOP/s, tf32 FLOP/s, HBM bytes/s, source)
    "a100": (312e12, 156e12, 2.039e12, "NVIDIA A100 80GB SXM datasheet"),
    "h100": (989e12, 494e12, 3.35e12, "NVIDIA H100 SXM datasheet"),
    "h200": (989e12, 494e12, 4.8e12, "NVIDIA H200 SXM datasheet"),
}
MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, GPU_OP_SECONDS, NCCL_LATENCY = 0.6, 0.8, 10e-6, 20e-6
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


GPU_PLAUSIBLE = {"matmul_efficiency": (0.05, 1.0), "memory_efficiency": (0.05, 1.0), "op_seconds": (0.5e-6, 100e-6)}


def gpu_checks(figures):
    """What is wrong with a GPU's measured figures, in words: an efficiency above the datasheet's peak
    or far below it, a host time per op outside what eager PyTorch takes (a GPU shared or throttled)."""
    return [f"{name} {figures[name]:.3g} is outside {least:.3g}-{most:.3g}"
            for name, (least, most) in GPU_PLAUSIBLE.items() if not least <= figures[name] <= most]


def measured_on_gpu(name):
    """The newest "time_model" figures that scripts/plan_check.py measured on GPU `name`, in
    results/*.json -> (figures, the file's path), or None."""
    found = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        figures = data.get("time_model") if isinstance(data, dict) else None
        if isinstance(figures, dict) and figures.get("gpu") == name:
            found.append((str(data.get("date", "")), path, figures))
    if not found:
        return None
    _, path, figures = max(found)
    return figures, path


def gpu(name, busbw_bytes):
    """A GPU as the time model's device: its datasheet's peaks at the efficiencies plan_check.py
    measured, where they pass gpu_checks; else at the assumed ones, naming the figures refused."""
    bf16, tf32, hbm, source = GPU_PEAKS[name]
    measured = measured_on_gpu(name)
    problems = gpu_checks(measured[0]) if measured is not None else []
    if measured is None or problems:
        matmul, memory, op_seconds, how = MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, GPU_OP_SECONDS, "assumed"
        if problems:
            how += f"; {os.path.relpath(measured[1], os.path.dirname(RESULTS))} failed its checks: {'; '.join(problems)}"
    else:
        figures, path = measured
        matmul, memory, op_seconds = figures["matmul_efficiency"], figures["memory_efficiency"], figures["op_seconds"]
        how = f"as scripts/plan_check.py measured them, {os.path.relpath(path, os.path.dirname(RESULTS))}"
    flops = {torch.bfloat16: bf16 * matmul, torch.float16: bf16 * matmul, torch.float32: tf32 * matmul}
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
    return Device(name, flops, hbm * memory, op_seconds, True,
                  dict.fromkeys(kinds, NCCL_LATENCY), dict.fromkeys(kinds, busbw_bytes),
                  f"{source}; matmuls at {matmul:.0%}, memory at {memory:.0%}, {op_seconds * 1e6:.0f} µs per op "
                  f"({how})")


def peak_flops(device, dtype):
    """The GPU's published peak for `dtype` (MFU's denominator); None on a CPU."""
    if device.name not in GPU_PEAKS:
        return None
    bf16, tf32 = GPU_PEAKS[device.name][:2]
    return tf32 if dtype == "float32" else bf16
