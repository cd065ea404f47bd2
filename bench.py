"""
Side-by-side cost of the backends on the same model and data, from one command.

    python bench.py --backends=ddp,fsdp,custom_fsdp --nproc=2 [--repeats=3] [--steps=12]
                    [config/FILE.py] [train.py --key=value ...]
    python bench.py --backends=custom_fsdp,custom_fsdp:prefetch=False ...   one backend, two settings
    python bench.py --sweep [--backends=...]     per-rank memory and step time at world sizes 1, 2, 4
    python bench.py --comm --nproc=2 [--comm_mb=1,4,16,64,256]   collective time and bus bandwidth by size
    python bench.py --host [--backends=...] [--steps=100] [--key=value ...]   host time per FSDP unit

Each backend runs train.py under torchrun; runs are interleaved (A B C A B C ...) so drift on a
noisy machine hits every backend alike. Figures are medians over steps (the first two, which
include warm-up, are dropped) and then over repeats; one extra profiled run per backend gives
the exposed (not overlapped) communication time via fsdp_impl.overlap, and where it went (on CPU
the range the training thread was in, such as the wait for one unit's reduce-scatter). Ratios
are against the first backend; below the table, each repeat's step time is also divided by the
first backend's run beside it, with the median and range of those ratios: the spread says how
far to trust one.
Per backend it also prints the training thread's CPU time per step in reading the batch, forward
and backward, clipping and the optimizer step (train.py's host_ms): on a GPU, the host's own work but backward's
(autograd runs it on a thread of its own for the device); and rank 0's
process CPU time per step, every thread's (train.py's cpu_ms): on a CPU machine whose cores are
all busy, the step time follows it; on a GPU it does too, as the host spins while it waits for the
device (ninth GPU round). The table is also written as JSON (--json; by default
bench_out/bench.json, or sweep.json / comm.json for --sweep / --comm). A backend may carry its
own train.py settings after colons (`fsdp:reshard_after_forward=False`); they apply to that row
only, on top of the command's. A config file replaces bench's default model (4 x 256, batch
8 x 128) with its own, on train.py's defaults (still one micro-batch per rank). Relative paths
(--work_dir, --json, train.py's --data_dir) start from the folder bench.py runs in.

--host asks what the backends' own code costs the host per step, where one run per process is too
noisy to say: every backend's model is built in this one process (world size 1), and their
training steps alternate one by one, so the machine's drift hits each alike. The default model's
compute is negligible (12 blocks 32 wide, batch 1 x 16: HOST_MODEL), so a step is host time, and
the difference against the first backend, divided by a backend's units, is what each unit costs
(on a GPU each step waits for the device, and the host time includes backward's thread). With
--compile=True DDP compiles the model whole and the FSDP backends block by block, so against DDP
that difference also holds per-block compile's own cost; a first row `ddp:compile_per_block=True`,
the plain model compiled block by block as they are, leaves it out.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import backends
import configurator
from compare import WARMUP_STEPS
from fsdp_impl import overlap
from model import GPT, GPTConfig
from observe import PROFILE_STEPS

HERE = os.path.dirname(os.path.abspath(__file__))
# the default model, unless a config file names one: a 4-layer 256-wide GPT, batch 8 x 128, one
# micro-batch per rank (the CPU target). Always: no evaluation and no checkpoints (one per
# run would be 0.5 GB at 47M parameters, 16 GB at 1.3B)
MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=256", "--batch_size=8", "--block_size=128", "--dropout=0.0",
         "--compile=False"]
TIMED_ONLY = ["--eval_iters=0", "--log_interval=1000000", "--keep_checkpoints=0"]
HOST_PHASES = ("batch", "forward_backward", "clip", "optimizer")  # the phases train.py times (host_ms)


def split_row(row):
    """'custom_fsdp:prefetch=False' -> ('custom_fsdp', ['--prefetch=False']): a backend and its own settings."""
    backend, *settings = row.split(":")
    if backend not in backends.BACKENDS:  # (checked before anything runs, not when the row's turn comes)
        raise ValueError(f"--backends: unknown backend '{backend}' in '{row}' "
                         f"(choose one of {', '.join(backends.BACKENDS)})")
    for s in settings:
        if "=" not in s:
            raise ValueError(f"--backends: '{s}' in '{row}' is not key=value")
    return backend, [f"--{s}" for s in settings]


def train_args(row, nproc, out_dir, steps, extra, profile=False):
    """train.py's arguments for a --backends entry."""
    backend, settings = split_row(row)
    extra = extra + settings  # (the row's own settings come last, so they win)
    config_files = [a for a in extra if not a.startswith("--")]  # (--key=value beats a file: the defaults would)
    return ([] if config_files else MODEL) + TIMED_ONLY + [f"--gradient_accumulation_steps={nproc}"] + extra + [
        f"--dist_backend={backend}", f"--out_dir={out_dir}", f"--max_iters={steps}",
        f"--eval_interval={10 ** 9}", f"--profile={profile}"]


def run_train(row, nproc, out_dir, steps, extra, profile=False):
    """One train.py run of a --backends entry; returns its metrics.jsonl rows."""
    args = train_args(row, nproc, out_dir, steps, extra, profile)
    shutil.rmtree(out_dir, ignore_errors=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_MODE": "disabled"}
    proc = subprocess.run(launcher + [os.path.join(HERE, "train.py")] + args, env=env, capture_output=True, text=True)
    if proc.returncode:
        refusal = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        if refusal:  # train.py refused its settings (an unknown key, say): its one line says why
            passed_on = " (bench.py passes the flags it does not take to train.py)" if "unknown config key" in \
                refusal[0] else ""
            raise SystemExit(f"error: {row} at {nproc} processes: {refusal[0][len('error: '):]}{passed_on}")
        raise SystemExit(f"error: {row} at {nproc} processes failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_dir(args, row, tag):
    """work_dir/<row>-<tag>, with the row's colons and '=' made safe for a path."""
    return os.path.join(args.work_dir, re.sub(r"[^\w.-]", "_", row) + f"-{tag}")


def at_step_ms(figures, step_ms):
    """step_ms with the tokens/s and MFU of that step time (each is a constant over it): a median
    of an even count averages two values, so medians of the three taken apart need not agree."""
    scale = figures["step_ms"] / step_ms
    return {"step_ms": step_ms, "tokens_per_sec": figures["tokens_per_sec"] * scale,
            "mfu": None if figures["mfu"] is None else figures["mfu"] * scale}


def summarize_run(rows, backend):
    steps = [r for r in rows if "loss" in r][WARMUP_STEPS:]
    memory = {r["stage"]: r for r in rows if r.get("event") == "memory"}
    comm = next(r for r in rows if r.get("event") == "comm_per_step")
    end = memory["after last step"]
    first = {"step_ms": steps[0]["dt_ms"], "tokens_per_sec": steps[0]["tokens_per_sec"], "mfu": steps[0]["mfu"]}
    return {
        **at_step_ms(first, statistics.median(r["dt_ms"] for r in steps)),
        # the largest rank's peak over all training steps (CUDA max allocated, else RSS, which
        # can grow after the first step as the heap fragments), before the final checkpoint save
        "peak_mem_mb": end.get("max_allocated_mb", end["rss_mb"]),
        "reserved_mb": end.get("reserved_mb"),
        "state_mb": end["params_mb"] + end["grads_mb"] + end["optim_mb"],  # the model's state per rank
        "all_gather_mb": comm["all_gather_bytes"] / 2**20,
        "reduce_scatter_mb": comm["reduce_scatter_bytes"] / 2**20,  # the reduce-scatter's input
        # ddp's gradient all-reduce runs in its C++ reducer, out of the counter's sight: every
        # gradient once per step, so its size is added to the loss's all-reduce the counter saw
        "all_reduce_mb": comm["all_reduce_bytes"] / 2**20 + (end["grads_mb"] if backend == "ddp" else 0.0),
        "loss": [r["loss"] for r in rows if "loss" in r][-1],
        # the training thread's CPU time per phase (train.py's host_ms): on a GPU, the host's own work
        "host_ms": {p: statistics.median(r["host_ms"].get(p, 0.0) for r in steps) for p in HOST_PHASES},
        "page_faults": statistics.median(r["page_faults"] for r in steps),  # rank 0's process, per step
        "cpu_ms": statistics.median(r["cpu_ms"] for r in steps),  # the same process, all its threads
    }


def median_of(runs):
    def median(values):
        if values[0] is None:
            return None
        if isinstance(values[0], dict):
            return {k: statistics.median(v[k] for v in values) for k in values[0]}
        return statistics.median(values)
    return {k: median([r[k] for r in runs]) for k in runs[0]} | at_step_ms(runs[0], median([r["step_ms"] for r in runs]))


def fmt(value, base):
    if value is None:
        return "-"
    # (no ratio against a figure that prints as 0.0, such as a few scalar all-reduces)
    ratio = f" ({value / base:.2f}x)" if base and round(base, 1) else ""
    return f"{value:,.1f}{ratio}"


def print_table(table):
    """One row per backend, each figure with its ratio to the first row's."""
    first = next(iter(table.values()))
    cols = [("step_ms", "step ms"), ("tokens_per_sec", "tokens/s"), ("peak_mem_mb", "peak mem MB"),
            ("state_mb", "params+grads+optim MB"), ("all_gather_mb", "AG MB/step"), ("reduce_scatter_mb", "RS MB/step"),
            ("all_reduce_mb", "AR MB/step"), ("exposed_comm_ms", "exposed comm ms")]
    if first["reserved_mb"] is not None:  # CUDA: the caching allocator's reserve beside the peak
        cols.insert(3, ("reserved_mb", "reserved MB"))
    width = max(12, *map(len, table))
    print(" | ".join(["backend".ljust(width)] + [c[1].rjust(20) for c in cols] + ["hidden".rjust(7), "mfu".rjust(6)]))
    for b, row in table.items():
        hidden = "-" if row["hidden_fraction"] is None else f"{row['hidden_fraction']:.0%}"
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
        print(" | ".join([b.ljust(width)] + [fmt(row[k], first[k]).rjust(20) for k, _ in cols] + [hidden.rjust(7), mfu.rjust(6)]))
    for b, row in table.items():
        print(f"{b}: training-thread CPU ms per step: " + ", ".join(
            f"{p} {fmt(row['host_ms'][p], first['host_ms'][p])}" for p in HOST_PHASES)
            + f"; rank 0's process (all threads) CPU ms per step {fmt(row['cpu_ms'], first['cpu_ms'])}, "
              f"page faults per step {row['page_faults']:,.0f}")
    for b, row in table.items():
        if row["exposed_by_place"]:
            print(f"{b}: exposed communication ms per step, by where it went: "
                  + ", ".join(f"{place} {ms:.1f}" for place, ms in row["exposed_by_place"].items()))
    print("AG and RS MB/step: the size of each all-gather's output and each reduce-scatter's input (nccl-tests' "
          "size of a collective), summed; each rank sends (W-1)/W of it.")
    if any(split_row(b)[0] == "ddp" for b in table):
        print("ddp's AR MB/step: its gradients, which its C++ reducer all-reduces once per step out of the "
              "counter's sight (taken from their size), and the loss's all-reduce.")


def paired_step_ratios(results):
    """Each row's step time over the first row's in the same repeat: runs side by side in the
    interleaved order share the machine's drift, so their ratio is steadier than one of medians."""
    first, *others = results
    return {b: [run["step_ms"] / base["step_ms"] for run, base in zip(results[b], results[first])] for b in others}


def print_paired(paired, first):
    for b, ratios in paired.items():
        print(f"step time per repeat vs {first}'s run beside it: {b} " + " ".join(f"{r:.2f}x" for r in ratios)
              + f" (median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}x-{max(ratios):.2f}x)")


def bench_backends(args, extra):
    results = {b: [] for b in args.backends}
    for rep in range(args.repeats):
        for b in args.backends:  # interleaved
            out = run_dir(args, b, f"r{rep}")
            results[b].append(summarize_run(run_train(b, args.nproc, out, args.steps, extra), split_row(b)[0]))
            print(f"  repeat {rep} {b}: {results[b][-1]['step_ms']:.1f} ms/step", flush=True)
    table = {b: median_of(runs) | {"exposed_comm_ms": None, "comm_ms": None, "hidden_fraction": None,
                                   "exposed_by_place": None} for b, runs in results.items()}
    for b in args.backends if args.exposed else ():  # one profiled run each: exposed communication
        out = run_dir(args, b, "profile")
        run_train(b, args.nproc, out, max(args.steps, PROFILE_STEPS[1] + 2), extra, profile=True)  # (window + 2)
        trace = overlap.load(os.path.join(out, "traces", split_row(b)[0], "rank0.json"))
        s = overlap.summarize(overlap.analyse(trace))
        table[b] |= {"exposed_comm_ms": s.get("exposed_ms"), "comm_ms": s.get("comm_ms"),
                     "hidden_fraction": s.get("hidden_fraction"),
                     "exposed_by_place": overlap.exposed_by_place(trace, overlap.TOP_PLACES)}
    print(f"\n{args.nproc} processes, {args.repeats} repeats, {args.steps} steps; ratios vs {args.backends[0]}")
    print_table(table)
    paired = paired_step_ratios(results)
    print_paired(paired, args.backends[0])
    return {"nproc": args.nproc, "repeats": args.repeats, "steps": args.steps, "extra": extra, "backends": table,
            "step_ratio_per_repeat": paired}


def sweep(args, extra):
    out = {}
    print("world size sweep: per-rank memory (parameters, gradients and optimizer state, MB) and step time (ms)")
    for b in args.backends:
        for w in (1, 2, 4):
            run = summarize_run(run_train(b, w, run_dir(args, b, f"w{w}"), args.steps,
                                          ["--gradient_accumulation_steps=4"] + extra), split_row(b)[0])
            out[f"{b}-w{w}"] = run
            base = out[f"{b}-w1"]
            print(f"  {b:12} W={w}: params+grads+optim {fmt(run['state_mb'], base['state_mb'])} MB, "
                  f"peak {run['peak_mem_mb']:.0f} MB, step {fmt(run['step_ms'], base['step_ms'])} ms", flush=True)
    return {"sweep": out}


# --host: its model and the settings it takes (train.py's names, and vocab_size, which train.py takes
# from the data), each a --key=value, or a row's own after colons
HOST_MODEL = dict(n_layer=12, n_head=2, n_embd=32, block_size=16, batch_size=1, bias=False, vocab_size=65)
HOST_SETTINGS = dict(device="cpu", dtype="float32", compile=False, wrap_policy="block", min_wrap_params=1_000_000,
                     reshard_after_forward=True, prefetch=True, shared_memory=True, cpu_offload=False,
                     replicate_degree=1, compile_per_block=False, **HOST_MODEL)


def host_settings(flags):
    """HOST_SETTINGS with --key=value `flags` applied; a wrong key, type or value fails in one line, as in train.py."""
    cfg = configurator.apply(dict(HOST_SETTINGS), flags)
    configurator.check_device(cfg["device"])
    for key in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "vocab_size"):
        if cfg[key] < 1:
            configurator.fail(f"{key}={cfg[key]} must be at least 1")
    if cfg["n_embd"] % cfg["n_head"]:
        configurator.fail(f"n_embd={cfg['n_embd']} is not divisible by n_head={cfg['n_head']}")
    return cfg


def build_for_host(row, extra):
    """A --host row's backend, model and optimizer, in this process, and its unit count (0 for ddp)."""
    import torch

    name, settings = split_row(row)
    cfg = host_settings(extra + settings)
    try:
        back = backends.make_backend(name, cfg)
    except backends.BackendError as e:
        configurator.fail(f"{row}: {e}")
    conf = GPTConfig(**{k: cfg[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")})
    with torch.device("meta"):
        model = GPT(conf)
    model = back.wrap(model, lambda m: m.init_weights(0))
    optimizer = back.unwrap(model).configure_optimizers(0.1, 1e-3, (0.9, 0.95), back.optimizer_class)
    units = 0 if name == "ddp" else len(back.unit_groups(list(model.transformer.h))) + 1  # (+ the root)
    return back, model, optimizer, units


def bench_host(args, extra):
    import torch
    import torch.distributed as dist

    cfg = host_settings(extra)
    backends.init_distributed("custom_fsdp", "nccl", cfg["device"], 600)  # (a group of one, for the sharded backends)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # (as bench's train.py runs)
    rows = {row: build_for_host(row, extra) for row in args.backends}
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(cfg["vocab_size"], (cfg["batch_size"], cfg["block_size"]), generator=gen)
            .to(cfg["device"]) for _ in range(2))
    sync = torch.cuda.synchronize if cfg["device"].startswith("cuda") else (lambda: None)
    times = {row: [] for row in rows}
    for _ in range(args.steps):
        for row, (back, model, optimizer, _) in rows.items():  # interleaved, step by step
            sync()
            start = time.perf_counter()
            with back.autocast():
                _, loss = model(x, y)
            back.backward(loss)
            sync()
            backward_done = time.perf_counter()
            back.clip_grad_norm(optimizer, 1.0)
            back.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            sync()
            times[row].append((backward_done - start, time.perf_counter() - backward_done))
    first = args.backends[0]
    table = {}
    for row, (*_, units) in rows.items():
        timed = times[row][WARMUP_STEPS:]
        table[row] = {"units": units, "forward_backward_ms": 1e3 * statistics.median(t[0] for t in timed),
                      "optimizer_ms": 1e3 * statistics.median(t[1] for t in timed)}
    for row, figures in table.items():
        extra_ms = figures["forward_backward_ms"] - table[first]["forward_backward_ms"]
        figures["forward_backward_ms_per_unit_vs_first"] = extra_ms / figures["units"] if figures["units"] and \
            row != first else None
    print(f"host time per step, one process, {args.steps} interleaved steps (medians past the first {WARMUP_STEPS}); "
          f"model {', '.join(f'{k}={cfg[k]}' for k in HOST_MODEL)}; ratios vs {first}")
    width = max(12, *map(len, table))
    print(" | ".join(["backend".ljust(width), "units", "forward+backward ms".rjust(20), "optimizer ms".rjust(20),
                      f"per unit vs {first}, ms".rjust(24)]))
    for row, f in table.items():
        per_unit = f["forward_backward_ms_per_unit_vs_first"]
        print(" | ".join([row.ljust(width), str(f["units"]).rjust(5),
                          fmt(f["forward_backward_ms"], table[first]["forward_backward_ms"]).rjust(20),
                          fmt(f["optimizer_ms"], table[first]["optimizer_ms"]).rjust(20),
                          ("-" if per_unit is None else f"{per_unit:.3f}").rjust(24)]))
    dist.destroy_process_group()
    return {"steps": args.steps, "extra": extra, "backends": table}


def comm_worker(sizes_mb):
    """Under torchrun: time all-gather and reduce-scatter (the library's and fsdp_impl's) and
    all-reduce (DDP's) by message size (MB of the full buffer) on this process group, and rank 0's
    process CPU time (every thread) per call. On CPU fsdp_impl's exchanges run twice: as it runs
    them here (shared memory between processes of one machine) and with gloo's messages (`_msgs`,
    its shared_memory=False, the way between machines)."""
    import torch
    import torch.distributed as dist
    from fsdp_impl import comm

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    w, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    groups = {"": dist.group.WORLD}
    if not cuda:  # the same ranks again, connected with shared memory off (read at a group's first exchange)
        groups["_msgs"] = dist.new_group()
        comm.shared_memory = False
        comm.all_gather([torch.zeros(w, 1)], [torch.zeros(1)], groups["_msgs"]).wait()
        comm.shared_memory = True
    rows = []
    for mb in sizes_mb:
        numel = mb * 2**20 // 4
        full = torch.zeros(numel - numel % w, device=device)
        shard = torch.zeros(full.numel() // w, device=device)
        # (name, run it, bytes moved per rank as a fraction of the full buffer: bus bandwidth)
        ops = [("all_gather", lambda: comm.library_collective("all_gather_single")(full, shard), (w - 1) / w)]
        ops += [(f"ag_fsdp_impl{tag}", lambda g=g: comm.all_gather([full.view(w, -1)], [shard], g).wait(), (w - 1) / w)
                for tag, g in groups.items()]
        ops += [("reduce_scatter", lambda: comm.library_collective("reduce_scatter_single")(
            shard, full, op=dist.ReduceOp.AVG), (w - 1) / w)]
        ops += [(f"rs_fsdp_impl{tag}", lambda g=g: comm.reduce_scatter(shard, full, g).wait(), (w - 1) / w)
                for tag, g in groups.items()]
        ops += [("all_reduce", lambda: dist.all_reduce(full), 2 * (w - 1) / w)]
        for name, op, moved in ops:
            op()  # warm-up
            times, cpu = [], []
            for _ in range(5):
                if cuda:
                    torch.cuda.synchronize()
                t, c = time.perf_counter(), time.process_time()
                op()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            dt = statistics.median(times)
            rows.append({"op": name, "mb": mb, "ms": dt * 1e3, "busbw_gbps": full.numel() * 4 * moved / dt / 1e9,
                         "cpu_ms": statistics.median(cpu) * 1e3})
    if rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def bench_comm(args):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={args.nproc}", __file__, "--comm-worker", args.comm_mb],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"error: comm benchmark failed:\n{proc.stderr[-3000:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"collectives on {args.nproc} processes (_msgs: fsdp_impl with gloo's messages, not shared memory; "
          "CPU: rank 0's process, every thread)")
    for r in rows:
        print(f"  {r['op']:20} {r['mb']:4d} MB: {r['ms']:9.2f} ms, bus bandwidth {r['busbw_gbps']:6.2f} GB/s, "
              f"CPU {r['cpu_ms']:8.2f} ms")
    return {"comm": rows}


def main():
    if "--comm-worker" in sys.argv:
        return comm_worker([int(mb) for mb in sys.argv[sys.argv.index("--comm-worker") + 1].split(",")])
    # (no abbreviations: a key it does not know goes to train.py whole, as typed)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--backends", default="ddp,fsdp,custom_fsdp")
    p.add_argument("--nproc", type=int, default=None, help="processes per run (2; --sweep runs 1, 2 and 4)")
    p.add_argument("--repeats", type=int, default=None, help="runs per backend, interleaved (3)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (12; --host: 100)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--comm", action="store_true")
    p.add_argument("--host", action="store_true", help="host time per FSDP unit, in one process (see above)")
    p.add_argument("--comm_mb", default=None, help="--comm: full buffer sizes in MB, comma-separated (1,4,16,64,256)")
    p.add_argument("--work_dir", default="bench_out")
    p.add_argument("--json", default=None)
    # one world-size-1 GPU has no communication to expose, and a profiled compile run takes a minute
    p.add_argument("--exposed", type=lambda v: ("false", "true").index(v.lower()) == 1, default=None,
                   help="one extra profiled run per backend for the exposed communication (True/False)")
    args, extra = p.parse_known_args()
    args.backends = args.backends.split(",")
    if len(set(args.backends)) < len(args.backends):
        p.error(f"--backends lists a row twice: {','.join(args.backends)}")
    try:
        for row in args.backends:
            split_row(row)
    except ValueError as e:
        p.error(str(e))
    if args.comm_mb is not None and not args.comm:
        p.error("--comm_mb sets the message sizes of --comm, which this run does not ask for")
    if args.comm_mb is None:
        args.comm_mb = "1,4,16,64,256"
    if not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", args.comm_mb):
        p.error(f"--comm_mb={args.comm_mb}: sizes in whole MB, comma-separated (1,4,16)")
    if sum((args.sweep, args.comm, args.host)) > 1:
        p.error("--sweep, --comm and --host are separate modes: ask for one")
    if args.sweep and args.nproc is not None:
        p.error(f"--nproc={args.nproc}: --sweep runs world sizes 1, 2 and 4")
    if args.host and (args.nproc is not None or args.repeats is not None or args.exposed is not None):
        p.error("--host runs every backend in one process, its steps interleaved: no --nproc, --repeats or --exposed")
    for row in args.backends if args.host else ():  # (one input for every row: the model's shape and device are common)
        shared = [s for s in split_row(row)[1] if s[2:].partition("=")[0] in {*HOST_MODEL, "device"}]
        if shared:
            p.error(f"--host: {row} sets {shared[0][2:]} for itself; the model, batch and device are every row's "
                    "(set them for all, without the colon)")
    args.exposed = True if args.exposed is None else args.exposed
    args.steps = (100 if args.host else 12) if args.steps is None else args.steps
    args.repeats = 3 if args.repeats is None else args.repeats
    args.nproc = 2 if args.nproc is None else args.nproc
    for name in ("nproc", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: at least 1")
    if args.steps < WARMUP_STEPS + 1 and not args.comm:
        p.error(f"--steps={args.steps}: at least {WARMUP_STEPS + 1} (the first {WARMUP_STEPS}, warm-up, are not timed)")
    result = bench_comm(args) if args.comm else sweep(args, extra) if args.sweep else \
        bench_host(args, extra) if args.host else bench_backends(args, extra)
    # each mode its own default file, so that one never overwrites another's results
    default = "comm.json" if args.comm else "sweep.json" if args.sweep else "host.json" if args.host else "bench.json"
    path = args.json or os.path.join(args.work_dir, default)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
