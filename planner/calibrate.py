"""
This CPU's figures for the time model, measured once and cached: the matmul rate and memory
bandwidth of one thread and of all cores, the host's time per op of a tiny training step, and
gloo's all-gather and reduce-scatter (latency and bus bandwidth) at 2 and 4 processes. The cache
is keyed by the CPU's model, its core count and torch's version (~/.cache/fsdp-gpt/).
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

SIZES = (2**16, 2**20, 2**23)  # collective bytes timed (each rank's output of a gather)
WORLDS = (2, 4)


def _seconds(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_and_bandwidth(threads):
    torch.set_num_threads(threads)
    rates = {}
    for dtype, n in ((torch.float32, 512), (torch.bfloat16, 256)):  # (bfloat16 is slow on CPUs without AMX)
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        rates[str(dtype)] = 2 * n**3 / _seconds(lambda: a @ b, repeats=3)
    src, dst = torch.ones(2**23), torch.empty(2**23)  # 32 MiB: past the caches
    bandwidth = 2 * src.numel() * 4 / _seconds(lambda: dst.copy_(src), repeats=3)  # (read and write, as Op.nbytes counts)
    return rates, bandwidth


def _op_seconds(rate, bandwidth):
    """The host's time per op of a tiny model's training step (4 x 64, batch 2 x 32, one thread),
    beyond what its ops' FLOPs and bytes cost: Python, dispatch, autograd."""
    from model import GPT, GPTConfig
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=65, dropout=0.0, bias=False))
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    x = torch.randint(65, (2, 32))

    def step():
        gpt(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = _seconds(step, repeats=5)
    ops = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ops.append(timing.compute_op(func, args, kwargs, out, ""))
            return out
    with Count():
        step()
    device_seconds = sum(max(op.flops / rate, op.nbytes / bandwidth) for op in ops)
    return max(seconds - device_seconds, 0.0) / len(ops)


def _collectives(rank, world, path, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    out = {}
    for name, kind in (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter")):
        collective, times = library_collective(name), []
        for nbytes in SIZES:
            big, small = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4 // world)
            args = (big, small) if kind == "all_gather" else (small, big)
            times.append(_seconds(lambda: collective(*args), repeats=5))
        out[kind] = times
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put(out)


def _gloo(world):
    """(latency, busbw) per collective kind at `world` processes: a line through the timed sizes."""
    path = f"/tmp/fsdp-gpt-calibrate-{os.getpid()}-{world}"
    if os.path.exists(path):
        os.remove(path)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    procs = [context.Process(target=_collectives, args=(r, world, path, results)) for r in range(world)]
    for p in procs:
        p.start()
    measured = results.get(timeout=120)
    for p in procs:
        p.join()
    fitted = {}
    for kind, times in measured.items():
        bus = [n * (world - 1) / world for n in SIZES]
        slope = (times[-1] - times[0]) / (bus[-1] - bus[0])  # seconds per bus byte
        fitted[kind] = (max(times[0] - slope * bus[0], 0.0), 1 / slope)
    return fitted


def _key():
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"


def cache_path():
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fsdp-gpt")
    return os.path.join(folder, "cpu-calibration.json")


def measure():
    one_rates, one_bandwidth = _matmul_and_bandwidth(1)
    all_rates, all_bandwidth = _matmul_and_bandwidth(os.cpu_count())
    figures = {"key": _key(), "cores": os.cpu_count(), "one_thread": [one_rates, one_bandwidth],
               "all_cores": [all_rates, all_bandwidth], "op_seconds": _op_seconds(one_rates["torch.float32"], one_bandwidth),
               "gloo": {str(w): _gloo(w) for w in WORLDS}, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    torch.set_num_threads(os.cpu_count())
    return figures


def figures(recalibrate=False):
    """This CPU's figures: from the cache, or measured now (some 20 seconds) and cached."""
    path = cache_path()
    if not recalibrate and os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        if cached.get("key") == _key():
            return cached
    measured = measure()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(measured, f, indent=1)
    os.replace(path + ".tmp", path)
    return measured


def cpu(world, measured):
    """This CPU as the time model's device for one of `world` ranks. Alone, a rank computes on every
    core; several ranks take a thread each (torchrun's OMP_NUM_THREADS=1), and past the core count
    they share the cores, so each runs at cores / W of one thread's rates. From W = cores on, gloo's
    threads have no core of their own: a collective takes the core its rank computes on."""
    cores = measured["cores"]
    rates, bandwidth = measured["all_cores" if world == 1 else "one_thread"]
    share = min(1.0, cores / world)
    flops = {getattr(torch, name.split(".")[1]): rate * share for name, rate in rates.items()}
    gloo = measured["gloo"].get(str(world)) or measured["gloo"][str(max(int(w) for w in measured["gloo"]))]
    latency = {kind: fit[0] for kind, fit in gloo.items()}
    busbw = {kind: fit[1] for kind, fit in gloo.items()}
    # gloo runs a reduce-scatter as an all-reduce of its whole input: the same time, for half the bus bytes
    latency["all_reduce"], busbw["all_reduce"] = latency["reduce_scatter"], 2 * busbw["reduce_scatter"]
    return timing.Device(f"cpu ({measured['key']})", flops, bandwidth * share, measured["op_seconds"] / share, False,
                         latency, busbw, f"measured on this CPU at {measured['measured_at']} ({cache_path()})",
                         comm_on_compute_core=world >= cores)
