"""
This CPU's figures for the time model, measured and cached in ~/.cache/fsdp-gpt/, keyed by the
CPU's model, its core count and torch's version:

- the matmul rate and copy bandwidth of one thread and of all cores (the checks' figures, and the
  fallback for an op that cannot be timed);
- gloo's all-gather, reduce-scatter and all-reduce at 2 and 4 processes, each rank computing
  beside them as in a step, at sizes from 64 KiB to 32 MiB (a collective's time is not a line in
  its bytes: past the caches each byte costs more);
- the host's time per op of a tiny model's training step, beyond what its ops cost (opcosts.py).

Load cannot poison them silently. Each figure is the best of several measurements, taken in the
thread's CPU time where one thread computes. The figures are checked against one another and
against plausible ranges, and the other processes' CPU use and the hypervisor's steal are
recorded. A calibration that fails its checks is measured again, up to ATTEMPTS times in all;
one that still fails is "contended": it is not cached, and a clean cached one is used instead
where there is one. plan.py names the figures' date, and says when they are contended.
"""
import json
import multiprocessing
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from fsdp_impl.comm import library_collective

from . import timing
from .opcosts import OpCosts, best_seconds, signature

SIZES = (2**16, 2**20, 2**23, 2**25)  # collective bytes timed (each rank's output of a gather), 64 KiB to 32 MiB
WORLDS = (2, 4)
ATTEMPTS = 3  # measurements of a calibration that fails its checks, in all
LAYER_CALLS = 8  # layer matmuls timed at each of seven moments of a calibration (typical_over_best)
DRIFT_ROUNDS, DRIFT_CHUNK = 24, 4  # rounds of the drift measurement, and layer matmuls (some 40 ms) in each
REPEATS = 5  # each figure is the best of this many
# what a clean calibration satisfies (checks())
MATMUL_SCALING = 0.6  # all cores reach at least this share of the cores' count times one thread's rate
OTHERS_CORES = 0.3  # other processes took at most this many cores on average while it measured
MOST_DRIFT = 0.5  # the ranks' drift (drift()) at most this share of their compute
MOST_TYPICAL_OVER_BEST = 1.5  # a layer matmul's typical time at most this many times its best
STEAL_SHARE = 0.1  # the hypervisor took at most this share of the machine's time
PLAUSIBLE = {  # figure: (least, most)
    "matmul_flops": (1e9, 1e14), "bandwidth": (1e9, 1e12), "op_seconds": (0.2e-6, 100e-6),
    "latency": (1e-6, 20e-3), "busbw": (20e6, 1e11),
}


class Load(dict):
    """Other processes' CPU while a measurement ran: "others_cores" (their busy time over the
    interval, in cores) and "steal" (the hypervisor's share of the machine's time)."""

    @property
    def contended(self):
        return self["others_cores"] > OTHERS_CORES or self["steal"] > STEAL_SHARE


def _machine_ticks():
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return user + nice + system + irq + softirq, idle + iowait, steal


def _own_ticks():
    """{pid: CPU ticks so far} of this process and its live descendants: the plan's own work. (Not
    its process group: a shell script's other jobs share that.)"""
    parent, ticks = {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # (gone)
        parent[int(pid)] = int(fields[1])  # (ppid; then utime and stime at 11 and 12)
        ticks[int(pid)] = int(fields[11]) + int(fields[12])
    me, own = os.getpid(), {}
    for pid in ticks:
        ancestor = pid
        while ancestor not in (me, 0, 1) and ancestor in parent:
            ancestor = parent[ancestor]
        if ancestor == me:
            own[pid] = ticks[pid]
    return own


class LoadMeter:
    """How busy other processes kept the machine from its start to read(): /proc/stat's busy
    ticks less those of this process and its descendants, and the steal, over the interval. They are
    sampled every SAMPLE_SECONDS on a thread of its own, so one that ends meanwhile keeps what
    it used (a reaped child's time would otherwise land on its parent, lifetime and all)."""
    SAMPLE_SECONDS = 0.25

    def __init__(self):
        import threading
        self.started = time.monotonic()
        self.machine = _machine_ticks()
        self.first = _own_ticks()
        self.last = dict(self.first)
        self.stop = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self):
        while not self.stop.wait(self.SAMPLE_SECONDS):
            self.last.update(_own_ticks())

    def own(self):
        """This process's and its descendants' ticks since the start (one born since: all of its own)."""
        return sum(ticks - self.first.get(pid, 0) for pid, ticks in self.last.items())

    def read(self):
        self.stop.set()
        self.sampler.join()
        self.last.update(_own_ticks())
        (busy, idle, steal), own = _machine_ticks(), self.own()
        busy0, idle0, steal0 = self.machine
        seconds = max(time.monotonic() - self.started, 1e-3)
        others = max(busy - busy0 - own, 0) / os.sysconf("SC_CLK_TCK") / seconds
        all_ticks = (busy - busy0) + (idle - idle0) + (steal - steal0)
        return Load(others_cores=round(others, 3), steal=round((steal - steal0) / max(all_ticks, 1), 3),
                    seconds=round(seconds, 2))


def _matmul_and_bandwidth(threads):
    """{dtype: FLOP/s} of a square matmul and the bytes/s of a 32 MiB copy (read and written, as
    Op.nbytes counts them), each the best of REPEATS calls."""
    torch.set_num_threads(threads)
    rates = {}
    for dtype, n in ((torch.float32, 512), (torch.bfloat16, 256)):  # (bfloat16 is slow on CPUs without AMX)
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        rates[str(dtype)] = 2 * n**3 / best_seconds(lambda: a @ b, threads, least=REPEATS, most=REPEATS)
    src, dst = torch.ones(2**23), torch.empty(2**23)  # 32 MiB each: past the caches
    bandwidth = 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), threads, least=REPEATS, most=REPEATS)
    return rates, bandwidth


def tiny_step():
    """A tiny GPT's training step on one thread (4 x 64, batch 2 x 32): where the host's time per
    op is most of the step. -> (the step as a function, the model)."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=65, dropout=0.0, bias=False))
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    x = torch.randint(65, (2, 32))

    def step():
        gpt(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def host_op_seconds(costs):
    """The host's time per op of the tiny step, beyond its ops' own costs (`costs`, an OpCosts of one
    thread, which times the step's ops it lacks): Python, autograd and the dispatcher. The step is
    timed in the thread's CPU time, the best of REPEATS."""
    from .opcosts import NeighboursBusy
    torch.set_num_threads(1)
    step = tiny_step()
    with NeighboursBusy(os.cpu_count() - 1):  # (as the op costs are timed)
        seconds = best_seconds(step, 1, least=REPEATS, most=REPEATS)
    sigs = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            sigs.append(signature(func, args, kwargs))
            return func(*args, **(kwargs or {}))
    with Record():
        step()
    costs.measure(sigs, os.cpu_count())
    known = [costs.cost(s) for s in sigs]
    return max(seconds - sum(c for c in known if c is not None), 0.0) / len(sigs)


def _collectives(rank, world, path, results):
    """Rank `rank`'s part of the gloo calibration: each kind and size timed alone, then beside a
    thread that computes, as a rank's training thread does while gloo's threads move its bytes.
    Each size's time is the median of REPEATS calls (3 of the largest); the share of the compute thread's work lost
    while the large ones ran is the core a collective takes from compute."""
    import threading
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    stop, done = threading.Event(), [0]

    def compute():  # (a matmul leaves the interpreter's lock: the collectives' calls go on beside it)
        a, b = torch.rand(512, 768), torch.rand(768, 3072)  # (a layer's size: it streams through the caches)
        while not stop.is_set():
            a @ b
            done[0] += 1

    def rate(fn):  # the compute thread's matmuls per second while fn runs
        before, start = done[0], time.perf_counter()
        fn()
        return (done[0] - before) / (time.perf_counter() - start)
    out, lost = {}, []
    for beside in (False, True):
        if beside:
            computing = threading.Thread(target=compute, daemon=True)
            computing.start()
        for name, kind in (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter"),
                           ("all_reduce", "all_reduce")):
            collective, times = library_collective(name) if kind != "all_reduce" else dist.all_reduce, []
            for nbytes in SIZES:
                big, small = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4 // world)
                args = (big, small) if kind == "all_gather" else (small, big) if kind == "reduce_scatter" else (big,)
                collective(*args)
                runs = []
                for _ in range(REPEATS if nbytes < SIZES[-1] else 3):  # (3 of the longest: the same on every rank)
                    dist.barrier()  # (each call starts together on every rank: the slowest rank's start is not timed)
                    start = time.perf_counter()
                    collective(*args)
                    runs.append(time.perf_counter() - start)
                times.append(statistics.median(runs))
                if beside and nbytes >= 2**23:  # (a short call is over before the compute thread is seen to slow)
                    dist.barrier()
                    alone = rate(lambda: time.sleep(times[-1] * 3))
                    dist.barrier()
                    during = rate(lambda: [collective(*args) for _ in range(3)])
                    lost.append(min(max(1 - during / max(alone, 1e-9), 0.0), 1.0))
            out[(kind, beside)] = times
    stop.set()
    computing.join()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put((out, lost))


def _on_ranks(target, world, name):
    """target(rank, world, store path, results) on `world` forked processes over a file store; returns
    what rank 0 put in results."""
    path = f"/tmp/fsdp-gpt-{name}-{os.getpid()}-{world}"
    if os.path.exists(path):
        os.remove(path)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    procs = [context.Process(target=target, args=(r, world, path, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = results.get(timeout=300)
    for p in procs:
        p.join()
    return out


def _gloo(world):
    """At `world` processes: ({kind: [[bus bytes, seconds], ...]} beside compute, the same alone, the
    share of a core gloo takes from compute beside it: the median over the kinds and large sizes)."""
    measured, lost = _on_ranks(_collectives, world, "calibrate")
    share = (world - 1) / world
    tables = ({}, {})
    for (kind, beside), times in measured.items():  # (fewer bytes never take longer: a slow small call met a busy core)
        times = [min(times[i:]) for i in range(len(times))]
        tables[0 if beside else 1][kind] = [[n * share * (2 if kind == "all_reduce" else 1), t]
                                            for n, t in zip(SIZES, times)]
    return tables[0], tables[1], round(statistics.median(lost), 3)


def latency_and_busbw(points):
    """A collective's measured points as the two figures nccl-tests would give: the smallest size's
    time (its latency, near enough) and the bus bandwidth of the largest."""
    return points[0][1], points[-1][0] / max(points[-1][1] - points[0][1], 1e-9)


FORMAT = 3  # the cached figures' and op costs' layout and meaning: another is not this one's


def _key():
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, calibration format {FORMAT}"


def cache_path(name="cpu-calibration.json"):
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fsdp-gpt")
    return os.path.join(folder, name)


def op_costs(threads):
    """This CPU's op costs at `threads` threads (opcosts.py), cached beside the calibration."""
    return OpCosts(cache_path("cpu-op-costs.json"), _key(), threads)


def checks(f):
    """What is wrong with the figures `f`, in words (nothing: a clean calibration)."""
    problems = []
    cores = f["cores"]

    def plausible(name, value, what):
        least, most = PLAUSIBLE[name]
        if not least <= value <= most:
            problems.append(f"{what} {value:.3g} is outside {least:.3g}-{most:.3g}")
    one, every = f["one_thread"][0]["torch.float32"], f["all_cores"][0]["torch.float32"]
    for name, value in (("one thread", one), ("all cores", every)):
        plausible("matmul_flops", value, f"the matmul rate of {name}, FLOP/s,")
    for name, value in (("one thread", f["one_thread"][1]), ("all cores", f["all_cores"][1])):
        plausible("bandwidth", value, f"the copy bandwidth of {name}, bytes/s,")
    if cores > 1 and every < MATMUL_SCALING * cores * one:
        problems.append(f"all {cores} cores multiply at {every / 1e9:.1f} GFLOP/s, under {MATMUL_SCALING:.0%} of "
                        f"{cores} times one thread's {one / 1e9:.1f}: a core was busy")
    plausible("op_seconds", f["op_seconds"], "the host's seconds per op")
    for table, how in (("gloo", "beside compute"), ("gloo_alone", "alone")):
        for world, kinds in f[table].items():
            for kind, points in kinds.items():
                latency, busbw = latency_and_busbw(points)
                plausible("latency", latency, f"gloo's {kind} latency at {world} processes {how}, seconds,")
                plausible("busbw", busbw, f"gloo's {kind} bus bandwidth at {world} processes {how}, bytes/s,")
    for world, share in f["gloo_takes"].items():
        if not 0 <= share <= 1:
            problems.append(f"gloo takes {share} of a core from compute at {world} processes, outside 0-1")
    for world, share in f["drift"].items():
        if not 0 <= share <= MOST_DRIFT:
            problems.append(f"{world} ranks drift apart by {share:.0%} of their compute, over {MOST_DRIFT:.0%}")
    if not 1 <= f["typical_over_best"] <= MOST_TYPICAL_OVER_BEST:
        problems.append(f"a layer matmul's typical time is {f['typical_over_best']:.2f} times its best, "
                        f"over {MOST_TYPICAL_OVER_BEST}")
    load = Load(f["load"])
    if load.contended:
        problems.append(f"other processes took {load['others_cores']:.2f} cores and the hypervisor "
                        f"{load['steal']:.0%} of the time while it measured")
    return problems


def _best(a, b):
    """Each figure of two calibrations at its best: the higher rate, the lower latency."""
    def rates(x, y):
        return [{k: max(x[0][k], y[0][k]) for k in x[0]}, max(x[1], y[1])]
    return {"one_thread": rates(a["one_thread"], b["one_thread"]), "all_cores": rates(a["all_cores"], b["all_cores"]),
            **{table: {w: {kind: [[n, min(t, t_b)] for (n, t), (_, t_b) in zip(points, b[table][w][kind])]
                           for kind, points in kinds.items()} for w, kinds in a[table].items()}
               for table in ("gloo", "gloo_alone")},
            "gloo_takes": {w: min(share, b["gloo_takes"][w]) for w, share in a["gloo_takes"].items()},
            "drift": {w: min(d, b["drift"][w]) for w, d in a["drift"].items()},
            "typical_over_best": min(a["typical_over_best"], b["typical_over_best"])}


def _layer_calls(calls=LAYER_CALLS):
    """The thread's CPU time of each of `calls` layer-sized matmuls, the other cores busy (opcosts.py)."""
    from .opcosts import NeighboursBusy, _cpu_seconds
    torch.set_num_threads(1)
    a, b = torch.rand(256, 768), torch.rand(768, 3072)
    with NeighboursBusy(os.cpu_count() - 1):
        a @ b
        return [_cpu_seconds(lambda: a @ b, 1) for _ in range(calls)]


def typical_over_best(calls):
    """A step's ops run at their typical speed, the op costs are their best: the median of the layer
    matmul's calls over their best, its calls taken at moments spread through the calibration."""
    return statistics.median(calls) / min(calls)


def _drift_rank(rank, world, path, results, rounds=DRIFT_ROUNDS):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    a, b = torch.rand(256, 768), torch.rand(768, 3072)
    a @ b
    dist.barrier()
    start, chunks = time.perf_counter(), []
    for _ in range(rounds):
        chunk = time.thread_time()
        for _ in range(DRIFT_CHUNK):
            a @ b
        chunks.append(time.thread_time() - chunk)
        dist.barrier()
    wall = (time.perf_counter() - start) / rounds
    dist.destroy_process_group()
    if rank == 0:
        results.put((wall, statistics.median(chunks)))


def drift(world):
    """How far `world` ranks drift apart: each computes the same chunk of layer matmuls, then waits at
    a barrier for the others, DRIFT_ROUNDS times. What a round takes beyond a rank's own chunk (its
    share of a core past the core count) is time the ranks spend waiting for the slowest: a share of
    the compute between two collectives that the step adds."""
    wall, chunk = _on_ranks(_drift_rank, world, "drift")
    share = min(1.0, os.cpu_count() / world)
    return round(max(wall * share / chunk - 1, 0.0), 3)


def measure_once():
    meter = LoadMeter()
    layer = _layer_calls()  # (at moments spread through the calibration: typical_over_best)
    one_rates, one_bandwidth = _matmul_and_bandwidth(1)
    all_rates, all_bandwidth = _matmul_and_bandwidth(os.cpu_count())
    layer += _layer_calls()
    torch.set_num_threads(1)
    op_seconds = host_op_seconds(op_costs(1))
    layer += _layer_calls()
    gloo = {}
    for w in WORLDS:
        gloo[str(w)] = _gloo(w)
        layer += _layer_calls()
    drifts = {}
    for w in WORLDS:
        drifts[str(w)] = drift(w)
        layer += _layer_calls()
    figures = {"one_thread": [one_rates, one_bandwidth], "all_cores": [all_rates, all_bandwidth],
               "gloo": {w: beside for w, (beside, _, _) in gloo.items()},
               "gloo_alone": {w: alone for w, (_, alone, _) in gloo.items()},
               "gloo_takes": {w: takes for w, (_, _, takes) in gloo.items()},
               "drift": drifts, "typical_over_best": round(typical_over_best(layer), 3)}
    torch.set_num_threads(os.cpu_count())
    return figures, op_seconds, meter.read()


def measure():
    """The figures, checked: measured again while a check fails, each figure kept at its best over
    the attempts, up to ATTEMPTS in all; "contended" with the problems named where they still fail."""
    figures, op_seconds, load = None, None, None
    for attempt in range(ATTEMPTS):
        new, new_op_seconds, new_load = measure_once()
        figures = new if figures is None else _best(figures, new)
        op_seconds = new_op_seconds if op_seconds is None else min(op_seconds, new_op_seconds)
        load = new_load if load is None or new_load["others_cores"] < load["others_cores"] else load
        result = {"key": _key(), "cores": os.cpu_count(), **figures, "op_seconds": op_seconds, "load": load,
                  "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "attempts": attempt + 1}
        result["problems"] = checks(result)
        if not result["problems"]:
            break
    result["contended"] = bool(result["problems"])
    return result


def _cached():
    try:
        with open(cache_path()) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        return None
    return cached if cached.get("key") == _key() and not checks(cached) else None


def figures(recalibrate=False):
    """This CPU's figures: a clean cached calibration, or measured now (some 20 seconds) and cached
    if clean. A contended measurement is not cached; where a clean one was, it is used instead and
    says so ("kept": why the new one was not)."""
    cached = _cached()
    if cached is not None and not recalibrate:
        return cached
    if recalibrate and os.path.exists(cache_path("cpu-op-costs.json")):
        os.remove(cache_path("cpu-op-costs.json"))  # (the op costs are measured again too)
    measured = measure()
    if measured["contended"]:
        if cached is not None:
            return cached | {"kept": f"a new calibration was contended ({'; '.join(measured['problems'])})"}
        return measured
    path = cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(measured, f, indent=1)
    os.replace(path + ".tmp", path)
    return measured


def describe(measured):
    """The figures' provenance, as plan.py prints it: where and when, and whether they are clean."""
    text = f"measured on this CPU at {measured['measured_at']} ({cache_path()})"
    if measured.get("contended"):
        text += "; CONTENDED, not cached: " + "; ".join(measured["problems"])
    if measured.get("kept"):
        text += f"; kept, as {measured['kept']}"
    return text


def cpu(world, measured, threads=None):
    """This CPU as the time model's device for one of `world` ranks of `threads` threads each (by
    default: all cores alone, one thread each with several ranks, as torchrun sets OMP_NUM_THREADS).
    Each op costs its best time as opcosts.py timed it at that thread count, times its typical time
    over its best, and the ranks' drift where there are several. Past the core count the ranks share
    the cores, so each op takes cores / W of them. From W = cores on, gloo's threads have no core of
    their own: a collective shares the core its rank computes on (timing.replay_on_shared_cores)."""
    cores = measured["cores"]
    threads = threads or (cores if world == 1 else 1)
    rates, bandwidth = measured["all_cores" if threads > 1 else "one_thread"]
    share = min(1.0, cores / (world * threads)) if world > 1 else 1.0
    at = str(world) if str(world) in measured["gloo"] else str(max(int(w) for w in measured["gloo"]))
    slower = measured["typical_over_best"] * (1 + (measured["drift"][at] if world > 1 else 0.0)) / share
    flops = {getattr(torch, name.split(".")[1]): rate / slower for name, rate in rates.items()}
    gloo = measured["gloo"][at]
    fits = {kind: latency_and_busbw(points) for kind, points in gloo.items()}
    costs = op_costs(threads)
    costs.scale = slower
    return timing.Device(f"cpu ({measured['key']})", flops, bandwidth / slower, measured["op_seconds"] / share, False,
                         {k: f[0] for k, f in fits.items()}, {k: f[1] for k, f in fits.items()}, describe(measured),
                         comm_on_compute_core=world * threads >= cores, op_costs=costs, cores=cores,
                         comm_points={kind: [tuple(p) for p in points] for kind, points in gloo.items()},
                         comm_idle_points={kind: [tuple(p) for p in points]
                                           for kind, points in measured["gloo_alone"][at].items()},
                         comm_takes=measured["gloo_takes"][at])
