"""
plan.py's command line: its own flags beside train.py's settings, the rows planned two at a time,
the table, the JSON and the pictures.
"""
import os
import sys
import textwrap
from typing import Callable, NamedTuple

import configurator
import training
from backends import BACKENDS, BackendError

from . import calibrate, search, timing
from .cuda import CUBLAS_WORKSPACES, CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES, gpu_bytes
from .draw import draw, draw_timelines
from .step import Child, busbw, in_child, largest_batch, plan, second_batch, time_rows


PLAN_FLAGS = {"nproc": "1,2,4,8", "rank": 0, "json": "", "png": "", "gpu": "", "gpu_mem_gib": "", "busbw_gbps": "",
              "timeline": "", "timeline_json": "", "lanes_json": "", "snapshot": "",
              "search": "", "recalibrate": "False"}  # plan.py's own settings, beside train.py's
PLAN_FLAG_HELP = {
    "nproc": "world sizes to plan, comma-separated",
    "rank": "the rank planned (rank 0's shards are the largest; past a world size, rank 0 there)",
    "json": "write the rows to this JSON file",
    "png": "draw the peak per rank against the world size to this PNG",
    "gpu": "a100, h100 or h200: whether each row fits, its headroom and the largest batch that does",
    "gpu_mem_gib": "the GPU's memory in GiB, in place of --gpu",
    "busbw_gbps": "the bus bandwidth the communication time is projected at (default: NCCL's on H100s by W)",
    "timeline": "draw each row's memory through the step to this PNG",
    "timeline_json": "write each row's memory through the step to this JSON file",
    "lanes_json": "write each timed row's predicted step as lanes to this JSON file (overlap.py --png draws it)",
    "snapshot": "write each row's CUDA model as a torch.cuda.memory._snapshot() pickle (memory_viz reads it)",
    "search": "the fastest settings that fit (--search alone: the default grid; or \"KEY=V1,V2 ...\")",
    "recalibrate": "with --device=cpu: measure this CPU's figures and op costs again, not from the cache",
}


ROWS_AT_ONCE = 2  # rows planned side by side: each plan runs on one core


def print_help():
    """plan.py's own flags, then train.py's settings as a plan takes them (bfloat16 unless given, or a CPU run)."""
    print("usage: plan.py [config files] [--key=value ...]; plan.py's own flags and their defaults:")
    for key, value in PLAN_FLAGS.items():
        print(f"  {f'--{key}={value!r}':<20} {PLAN_FLAG_HELP[key]}")
    print("train.py's settings, as plan.py plans them (--dist_backend given: that backend only, else all three;")
    print("with --device=cpu and no --dtype, float32, as train.py runs there):")
    for key, value in dict(training.defaults(), dtype="bfloat16").items():
        print(f"  --{key}={value!r}" if isinstance(value, str) else f"  --{key}={value}")


def split_argv(argv):
    """(plan.py's own settings, the arguments for train.py's configurator)."""
    if "-h" in argv or "--help" in argv:
        print_help()
        raise SystemExit(0)
    own, rest = dict(PLAN_FLAGS), []
    for arg in argv:
        key = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if key in PLAN_FLAGS:
            if arg == "--search":  # (alone: the default grid)
                arg = "--search=all"
            if arg == "--recalibrate":
                arg = "--recalibrate=True"
            if "=" not in arg:  # (--json plan.json would read plan.json as a config file)
                configurator.fail(f"{arg} takes its value after '=': {arg}=VALUE")
            own[key] = arg.partition("=")[2]
        else:
            rest.append(arg)
    try:
        own["nproc"] = [int(w) for w in own["nproc"].split(",")]
        own["rank"] = int(own["rank"])
    except ValueError:
        configurator.fail(f"--nproc takes world sizes such as 1,8,64 and --rank an int; got {own['nproc']!r}, "
                          f"{own['rank']!r}")
    for flag, example in (("gpu_mem_gib", "the GPU's memory in GiB, such as 80"),
                          ("busbw_gbps", "a bus bandwidth in GB/s, such as 360")):
        if own[flag]:
            try:
                if float(own[flag]) <= 0:
                    raise ValueError
            except ValueError:
                configurator.fail(f"--{flag}={own[flag]}: give {example}")
    if own["recalibrate"] not in ("True", "False"):
        configurator.fail(f"--recalibrate={own['recalibrate']}: give True or False")
    own["recalibrate"] = own["recalibrate"] == "True"
    if own["snapshot"] and not os.path.isdir(os.path.dirname(os.path.abspath(own["snapshot"]))):
        configurator.fail(f"--snapshot={own['snapshot']}: its folder does not exist")
    if own["rank"] < 0:
        configurator.fail(f"--rank={own['rank']} must be 0 or more (a rank past a world size plans rank 0 there)")
    if not all(1 <= w <= 1 << 20 for w in own["nproc"]):
        configurator.fail(f"--nproc={','.join(map(str, own['nproc']))}: each world size must be at least 1")
    return own, rest


def plan_row(settings, backend_name, world, rank, own, limit, drawn, gloo, snapshot=None):
    """plan.py's row for one backend and W, whole: the plan (planned in a child) and what it answers,
    the communication time at the bus bandwidth and, given the GPU's memory, the headroom, whether
    it fits and the largest batch that does. -> (row, its timeline or None); a timed row keeps its
    ops for time_rows.
    snapshot: the path its memory snapshot is written to (snapshot.py), here, in the row's process."""
    asked = limit is not None  # (the GPU's memory given: the largest batch too, from a second plan beside)
    second = Child(plan, dict(settings, batch_size=second_batch(settings["batch_size"])), backend_name, world, rank,
                   gloo=gloo, keep_trace=True) if asked else None
    row = in_child(plan, settings, backend_name, world, rank, drawn, gloo, keep_trace=asked,
                   device=time_device(own, world, gloo), snapshot=bool(snapshot))
    if snapshot:
        from .snapshot import write
        write(row.pop("snapshot"), snapshot)
    timeline = None
    if drawn:
        timeline = {k: row[k] for k in ("backend", "nproc", "rank", "peak_allocated_bytes", "peak_at")} | row.pop("timeline")
    row["busbw_gbps"] = busbw(world, own["busbw_gbps"])
    row["comm_seconds_per_step"] = row["comm_bus_bytes_per_step"] / (row["busbw_gbps"] * 1e9)
    row["fits"] = row["headroom_bytes"] = row["max_batch_size"] = None  # (no GPU memory given)
    if limit is not None:  # (the context and NCCL's buffers come out of the same memory)
        room = limit - row["outside_allocator_bytes"]
        row["headroom_bytes"] = room - row["reserved_bytes"]
        row["fits"] = row["headroom_bytes"] >= 0
        row["max_batch_size"] = largest_batch(settings, backend_name, world, rank, row, second.result(), room, gloo)
    row.pop("trace", None)
    return row, timeline


def time_device(own, world, gloo):
    """The device the step is timed on: --gpu's (published peaks), this CPU for a CPU run (measured
    once, calibrate.py), else None."""
    if own["gpu"]:
        return timing.gpu(own["gpu"].lower(), busbw(world, own["busbw_gbps"]) * 1e9)
    if gloo:
        return calibrate.cpu(world, own["cpu_figures"])
    return None


def main(argv):
    own, rest = split_argv(argv)
    limit = gpu_bytes(own)
    given_backend = any(a.startswith("--dist_backend=") for a in rest)
    def given(key):  # on the command line or in a config file
        return any(a.startswith(f"--{key}=") if a.startswith("--") else key in configurator.run_file(a) for a in rest)
    settings = training.settings(rest)
    gloo = given("device") and settings["device"] == "cpu"  # (a CPU run: its collectives go through gloo)
    if not given("dtype"):  # (what train.py takes: bfloat16 on the GPUs plans are for, float32 on a CPU)
        settings["dtype"] = "float32" if gloo else "bfloat16"
    if own["snapshot"] and own["search"]:
        configurator.fail("--snapshot writes the rows planned, --search ranks a grid: give one of them")
    if own["lanes_json"] and not (own["gpu"] or gloo):
        configurator.fail("--lanes_json is the time model's step: give --gpu, or --device=cpu for this CPU's")
    if own["recalibrate"] and not (gloo and not own["gpu"]):
        configurator.fail("--recalibrate measures this CPU for a CPU run's plan: give --device=cpu (and no --gpu)")
    own["cpu_figures"] = calibrate.figures(own["recalibrate"]) if gloo and not own["gpu"] else None  # (once, before the children)
    if own["cpu_figures"] is not None and (own["cpu_figures"].get("contended") or own["cpu_figures"].get("kept")):
        print(f"warning: this CPU's figures are {calibrate.describe(own['cpu_figures'])}", file=sys.stderr)
    settings["vocab_size"] = training.vocab_size(settings)
    compiled, settings["compile"] = settings["compile"], False  # (torch.compile's kernels: not planned)
    backends = [settings["dist_backend"]] if given_backend else list(BACKENDS)
    if settings["cpu_offload"] and not given_backend:  # (DDP does not offload: plan(ddp) refuses it)
        backends = [b for b in backends if b != "ddp"]
    if own["search"]:
        return search_main(own, rest, settings, backends if given_backend else ["custom_fsdp"], limit, gloo)
    rows, timelines, predicted = [], [], []
    drawn = bool(own["timeline"] or own["timeline_json"])
    jobs = [(backend_name, world, own["rank"] if own["rank"] < world else 0)
            for backend_name in backends for world in own["nproc"]]
    snapshots = snapshot_paths(own["snapshot"], jobs) if own["snapshot"] else [None] * len(jobs)
    running = []  # rows planned two at a time, each in a process of its own (two cores), kept in order
    for index, (backend_name, world, rank) in enumerate(jobs):
        print(f"planning {backend_name} at W={world}, rank {rank}", file=sys.stderr, flush=True)
        running.append(Child(plan_row, settings, backend_name, world, rank, own, limit, drawn, gloo, snapshots[index]))
        while running and (len(running) == ROWS_AT_ONCE or index == len(jobs) - 1):
            try:
                row, timeline = running.pop(0).result()
            except BackendError as e:
                configurator.fail(str(e))
            rows.append(row)
            if drawn:
                timelines.append(timeline)
    if rows and "timed_ops" in rows[0]:  # (every row's op costs measured in one pass, then each replayed)
        time_rows(rows, [time_device(own, row["nproc"], gloo) for row in rows], [settings] * len(rows))
        predicted = [{k: row[k] for k in ("backend", "nproc", "rank", "device", "device_source")}
                     | row.pop("predicted_lanes") for row in rows]
    print(table(rows, settings, limit, gloo))
    if compiled:
        print("compile=True is planned as eager: the compiled kernels' own buffers are not counted.")
    for (backend_name, world, rank), path in zip(jobs, snapshots):
        if path:
            print(f"memory snapshot of {backend_name} at W={world}, rank {rank}: {path}")
    if own["snapshot"]:
        print("(drawn by python -m torch.cuda._memory_viz trace_plot PATH -o PATH.html, or pytorch.org/memory_viz)")
    if own["json"]:
        import json
        with open(own["json"], "w") as f:
            json.dump(rows, f, indent=1)
    if own["png"]:
        draw(rows, settings, own["png"])
    if own["timeline_json"]:
        import json
        with open(own["timeline_json"], "w") as f:
            json.dump(timelines, f)
    if own["lanes_json"]:
        import json
        with open(own["lanes_json"], "w") as f:
            json.dump({"predicted_lanes": predicted}, f)
    if own["timeline"]:
        draw_timelines(timelines, settings, own["timeline"])


def snapshot_paths(path, jobs):
    """Where each row's snapshot goes: `path` for one row; for several, the backend (and the world
    size, where several are planned) put before its extension: memory-fsdp.pickle, memory-fsdp-W2.pickle."""
    if len(jobs) == 1:
        return [path]
    stem, extension = os.path.splitext(path)
    several = len({b for b, _, _ in jobs}) > 1, len({w for _, w, _ in jobs}) > 1
    return [stem + (f"-{backend_name}" if several[0] else "") + (f"-W{world}" if several[1] else "") + extension
            for backend_name, world, _ in jobs]


def search_main(own, rest, settings, backends, limit, gloo):
    """plan.py --search: one backend at one world size, its grid planned and ranked (search.py)."""
    if len(own["nproc"]) != 1 or len(backends) != 1:
        configurator.fail("--search plans one world size and one backend: give --nproc=W (and --dist_backend)")
    world, backend_name = own["nproc"][0], backends[0]
    device = time_device(own, world, gloo)
    if device is None:
        configurator.fail("--search ranks by time: name the GPU (--gpu=h100), or plan a CPU run (--device=cpu)")
    grid = search.parse_grid(own["search"])
    print(f"searching {backend_name} at W={world}: {', '.join(f'{k} in {v}' for k, v in grid.items())}",
          file=sys.stderr, flush=True)
    rows = search.search(settings, backend_name, world, own["rank"] if own["rank"] < world else 0,
                         grid, limit, device, gloo, ROWS_AT_ONCE)
    print(search.report(rows, rest, backend_name, world, settings))
    if own["json"]:
        import json
        with open(own["json"], "w") as f:
            json.dump(rows, f, indent=1)


def gib(n):
    """Bytes in GiB, as the table shows them."""
    return f"{n / 2**30:,.2f}"


class Column(NamedTuple):
    """A column of plan.py's table: its name, the format spec of the name and of each cell, and a
    row's cell; `answers` columns show only when a GPU's memory is given."""
    name: str
    spec: str
    cell: Callable
    answers: bool = False
    timed: bool = None  # True: shown when the step is timed (--gpu, or a CPU run); False: when not


TABLE_COLUMNS = (
    Column("backend", "<12", lambda r: r["backend"]),
    Column("W", ">5", lambda r: r["nproc"]),
    Column("rank", ">4", lambda r: r["rank"]),
    Column("peak GiB", ">9", lambda r: gib(r["peak_allocated_bytes"])),
    Column("reserve", ">9", lambda r: gib(r["reserved_bytes"])),
    Column("state GiB", ">9", lambda r: gib(r["state_bytes"])),
    Column("comm GiB", ">9", lambda r: gib(sum(r["comm_bytes_per_step"].values())), timed=False),
    Column("comm ms", ">8", lambda r: f"{r['comm_seconds_per_step'] * 1e3:,.1f}", timed=False),
    Column("step ms", ">8", lambda r: f"{r['step_seconds'] * 1e3:,.1f}", timed=True),
    Column("exposed", ">8", lambda r: f"{r['exposed_comm_seconds'] * 1e3:,.1f}", timed=True),
    Column("tokens/s", ">10", lambda r: f"{r['tokens_per_second']:,.0f}", timed=True),
    Column("headroom", ">8", lambda r: gib(r["headroom_bytes"]), answers=True),
    Column("max batch", ">9", lambda r: r["max_batch_size"], answers=True),
    Column("peak at", "", lambda r: r["peak_at"]),  # (free text, last)
)


def table_line(columns, cells):
    """The cells under their columns, one space apart; the last, free text, two spaces after."""
    *aligned, last = (f"{cell:{column.spec}}" for column, cell in zip(columns, cells))
    return " ".join(aligned) + "  " + last


def table(rows, settings, limit, gloo=False):
    answers = limit is not None
    timed = bool(rows) and "step_seconds" in rows[0]
    columns = [c for c in TABLE_COLUMNS if (answers or not c.answers) and c.timed in (None, timed)]
    lines = [table_line(columns, [c.name for c in columns])]
    lines += [table_line(columns, [c.cell(r) for c in columns]) for r in rows]
    lines.append(f"\nbatch_size={settings['batch_size']}, block_size={settings['block_size']}, dtype={settings['dtype']}; "
                 "a rank's micro-steps: gradient_accumulation_steps / W")
    lines.append("(one where W does not divide it: memory depends on the micro-batch; the job needs a multiple of W).")
    if answers:
        smallest = {}
        for r in rows:
            if r["fits"]:
                smallest.setdefault(r["backend"], r["nproc"])
        lines.append(f"in {limit / 2**30:,.1f} GiB: " + "; ".join(
            f"{b} fits from W={w}" for b, w in smallest.items()) if smallest else "none of these fits")
    if timed:
        lines += textwrap.wrap(f"step ms: the time model (planner/timing.py) on {rows[0]['device']}: "
                               f"{rows[0]['device_source']}.", 110)
        lines.append("exposed: of it, the compute waiting on collectives. tokens/s: the global batch over the step.")
    lines.append("peak: allocated, as the CPU allocator counts it (kernels' own scratch aside).")
    if gloo:
        lines.append("device=cpu: gloo's buffers count at their worst: a gather's from the call to its wait,")
        lines.append("a reduce-scatter's copy of its input until the handle is dropped.")
    lines.append(f"reserve: CUDA's caching allocator replayed over it, one stream, with {CUBLAS_WORKSPACES} cuBLAS "
                 f"workspaces of {CUBLAS_WORKSPACE_BYTES // 2**20} MiB.")
    if answers:
        lines.append(f"headroom GiB: the GPU's memory less the reserve, {CUDA_CONTEXT_BYTES // 2**20} MiB of CUDA "
                     f"context and {NCCL_COMMUNICATOR_BYTES // 2**20} MiB per NCCL communicator.")
        lines.append("Below 0 it does not fit.")
    if settings["cpu_offload"]:
        lines.append("cpu_offload: peak and reserve are the GPU's; the state column lives in (pinned) host memory.")
        lines.append("Not modelled there: a unit's shard copied to the GPU for its gather, and its reduced grads")
        lines.append("until they are copied out (together at most two of the largest unit's shards).")
    if not timed:
        lines.append("comm ms: a projection, the step's bus bytes over a bus bandwidth of " + ", ".join(
            f"{b:g}" for b in sorted({r["busbw_gbps"] for r in rows})) + " GB/s (H100s: NVLink to W=8,")
        lines.append("InfiniBand above; --busbw_gbps sets it); latency aside, before any overlap with compute.")
    return "\n".join(lines)
