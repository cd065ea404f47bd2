"""
What each op of a planned step costs on this CPU, by its shape: the op timed on real tensors of
its shapes, strides and dtypes, with its other arguments as the step passed them. A matmul's rate
depends on its shape and layout, attention and GELU are not what their bytes say, and a strided
copy is slower than a contiguous one: timing the op itself needs no formula for any of them.

Each distinct op (its signature) is timed once and cached beside the calibration. Its time is the
best of several calls over a few passes through all the signatures, in the timing thread's CPU
time, less the cost of calling any op from Python (the host's per-op time is charged apart). The
best is what repeats from one plan to the next; a step runs at its typical speed, which
calibrate.py measures against the best once for all ops (OpCosts.scale). While it times, the other cores each run a
matmul loop, as the other ranks of a run compute beside this one; another process sharing this
core takes wall time, not this thread's CPU time, so it cannot inflate a figure.
"""
import fcntl
import json
import multiprocessing
import os
import time

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# ops that only make a new view of a storage or read metadata: no kernel runs
FREE = {"aten::view", "aten::_unsafe_view", "aten::alias", "aten::detach", "aten::t", "aten::transpose",
        "aten::permute", "aten::expand", "aten::as_strided", "aten::split", "aten::split_with_sizes",
        "aten::unbind", "aten::slice", "aten::select", "aten::squeeze", "aten::unsqueeze", "aten::reshape",
        "aten::_reshape_alias", "aten::chunk", "aten::narrow", "aten::lift_fresh", "aten::sym_size",
        "aten::sym_stride", "aten::sym_numel", "aten::is_same_size", "aten::_has_same_storage_numel"}
CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.memory_format, torch.layout)
ROUNDS, CALLS = 3, 7  # passes over the signatures, and calls of an op in one pass at most


class Unsupported(Exception):
    """An argument an op's signature cannot describe (a tensor subclass, a process group, ...)."""


def _describe(x):
    if isinstance(x, torch.Tensor):
        if is_traceable_wrapper_subclass(x) or x.is_meta or x.layout != torch.strided:
            raise Unsupported(type(x).__name__)
        return ["T", list(x.shape), list(x.stride()), x.storage_offset(), str(x.dtype).split(".")[1]]
    if isinstance(x, (list, tuple)):
        return ["L", [_describe(v) for v in x]]
    if isinstance(x, dict):
        return ["D", {k: _describe(v) for k, v in x.items()}]
    if isinstance(x, torch.device):
        return ["V", str(x)]
    if isinstance(x, CONSTANTS):
        return ["C", str(x).split(".")[1] if isinstance(x, (torch.dtype, torch.memory_format, torch.layout)) else x,
                type(x).__name__ if isinstance(x, (torch.dtype, torch.memory_format, torch.layout)) else None]
    raise Unsupported(type(x).__name__)


def signature(func, args, kwargs):
    """The op's name and arguments as a string (the cache's key), or None where an argument is
    none a real op could be rebuilt from; views and metadata reads are "free"."""
    name = func._schema.name
    if name in FREE or func.is_view:
        return "free"
    try:
        return json.dumps([name, func._overloadname, _describe(list(args)), _describe(dict(kwargs or {}))],
                          separators=(",", ":"))
    except Unsupported:
        return None


def _build(d, made):
    kind = d[0]
    if kind == "T":
        shape, stride, offset, dtype = d[1], d[2], d[3], getattr(torch, d[4])
        key = json.dumps(d)
        if key not in made:  # (the same tensor twice in one call stays one tensor)
            size = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else 0
            base = torch.empty(max(size, 0), dtype=dtype)
            if dtype.is_floating_point:
                base.uniform_(0.5, 1.0)  # (positive and away from zero: square roots and logs stay finite)
            else:
                base.zero_()  # (a valid index for every embedding, gather and loss)
            made[key] = base.as_strided(shape, stride, offset)
        return made[key]
    if kind == "L":
        return [_build(v, made) for v in d[1]]
    if kind == "D":
        return {k: _build(v, made) for k, v in d[1].items()}
    if kind == "V":
        return torch.device(d[1])
    value, type_name = d[1], d[2]
    return getattr(torch, value) if type_name else value


def rebuilt(sig):
    """(the op, its args, its kwargs) on real tensors, from a signature."""
    name, overload, args, kwargs = json.loads(sig)
    namespace, op = name.split("::")
    func = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    made = {}
    return func, _build(args, made), _build(kwargs, made)


def _cpu_seconds(fn, threads):
    """One call's time: the thread's CPU time where one thread computes, else the wall clock."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    start = clock()
    fn()
    return clock() - start


def best_seconds(fn, threads, budget=0.02, most=20, least=3):
    """The best of several calls (after one to warm up): as many as fit `budget` seconds, 3 to 20."""
    first = _cpu_seconds(fn, threads)
    runs = min(most, max(least, int(budget / max(first, 1e-6))))
    return min(_cpu_seconds(fn, threads) for _ in range(runs))


def call_overhead(threads):
    """What calling an op from Python costs beyond its kernel: a view op's best time."""
    x = torch.ones(4)
    return best_seconds(lambda: torch.ops.aten.alias.default(x), threads, most=200, least=200)


def time_ops(sigs, threads, overhead, rounds=ROUNDS, budget=0.02):
    """{signature: its best time less the call's}, None where it cannot run on tensors rebuilt
    from its signature. The signatures are timed in `rounds` passes over all of them, each call
    after one to warm up: a slow spell of the machine meets every op's calls alike, and the best of
    them is what the op costs when the machine is itself."""
    calls, failed = {s: [] for s in sigs}, set()
    for _ in range(rounds):
        for sig in sigs:
            if sig in failed:
                continue
            try:
                func, args, kwargs = rebuilt(sig)

                def call():
                    func(*args, **kwargs)
                _cpu_seconds(call, threads)
                first = _cpu_seconds(call, threads)
            except Exception:  # (an op that needs values of its own, or one this torch lacks: its FLOPs and bytes)
                failed.add(sig)
                continue
            more = min(CALLS - 1, int(budget / max(first, 1e-6)))
            calls[sig] += [first] + [_cpu_seconds(call, threads) for _ in range(more)]
    return {s: None if s in failed else max(min(c) - overhead, 0.0) for s, c in calls.items()}


def _busy(stop):
    torch.set_num_threads(1)
    a, b = torch.rand(512, 768), torch.rand(768, 3072)  # (a layer's size: it streams through the caches, as a rank's step does)
    while not stop.is_set():
        a @ b


class NeighboursBusy:
    """The other cores each run a one-thread matmul loop while this one times, as a run's other ranks compute."""

    def __init__(self, count):
        self.count, self.procs = count, []

    def __enter__(self):
        context = multiprocessing.get_context("fork")
        self.stop = context.Event()
        self.procs = [context.Process(target=_busy, args=(self.stop,), daemon=True) for _ in range(self.count)]
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


class OpCosts:
    """This CPU's cost of each op signature at `threads` threads, cached in `path` under `key`.
    cost(sig): seconds, or None where not timed (the caller falls back on FLOPs and bytes)."""

    def __init__(self, path, key, threads):
        self.path, self.key, self.threads = path, key, threads
        self.costs = self._read().get(str(threads), {})
        self.contended = False  # some figures were timed while other processes loaded the machine
        self.scale = 1.0  # a best time -> the op's time in a step (calibrate.cpu: typical speed, drift, core share)

    def _read(self):
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data["costs"] if data.get("key") == self.key else {}
        except (OSError, ValueError, KeyError):
            return {}

    def cost(self, sig):
        if sig == "free":
            return 0.0
        seconds = self.costs.get(sig)
        return None if seconds is None else seconds * self.scale

    def measure(self, sigs, cores, load_meter=None):
        """Time the signatures not yet known (under a lock: one process times at a time) and cache
        them, unless other processes loaded the machine meanwhile (then they serve this plan only)."""
        wanted = {s for s in sigs if s not in (None, "free") and s not in self.costs}
        if not wanted:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = self._read()
            self.costs = cached.get(str(self.threads), {}) | self.costs
            wanted = sorted(s for s in wanted if s not in self.costs)
            if not wanted:
                return
            from .calibrate import LoadMeter
            threads_before = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            meter = LoadMeter()
            try:
                with NeighboursBusy(max(cores - self.threads, 0) if self.threads == 1 else 0):
                    overhead = call_overhead(self.threads)
                    new = time_ops(wanted, self.threads, overhead)
            finally:
                torch.set_num_threads(threads_before)
            load = meter.read()
            self.costs |= new
            if load.contended:
                self.contended = True
                return
            cached[str(self.threads)] = cached.get(str(self.threads), {}) | new
            with open(self.path + ".tmp", "w") as f:
                json.dump({"key": self.key, "costs": cached}, f)
            os.replace(self.path + ".tmp", self.path)
