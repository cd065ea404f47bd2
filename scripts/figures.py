"""
Every figure and table of docs/LEARN.md, made from this project's own plans and runs.

    python scripts/figures.py                 # everything, into docs/figures/, results/ and docs/LEARN.md
    python scripts/figures.py --small         # each kind once, on tiny models (the tests run this)
    python scripts/figures.py --render        # only the tables, from results/learn/*.json
    python scripts/figures.py --only=time_model   # some parts alone (the others' figures stay)

Figures: a rank's memory over two planned steps (plan.py --timeline), and profiled steps as lanes
(overlap.py --png), custom_fsdp above FSDP2, one per schedule. Tables, each from a JSON file in
results/learn/: memory per rank by W and its roles (plan.py), the step's communication against its
formula (plan.py), each backend's losses against one process (train.py), collectives alone
(scripts/collectives.py), step time and exposed communication
(bench.py), weak scaling (plan.py and bench.py). The time model: plan.py's predicted step drawn
under a profiled one, and the validation grid's results (scripts/time_grid.py, results/cpu-grid-*.json)
as predicted against measured. Each figure's commands go to commands.md beside it.
Traces need data: --data_dir (data/shakespeare_char by default, which its prepare.py writes).
"""
import argparse
import contextlib
import json
import os
import runpy
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "scripts"))
import observe  # noqa: E402
import overlap  # noqa: E402
import planner  # noqa: E402
import training  # noqa: E402

GB = 1e9  # the page's units are decimal: 1 GB = 10^9 bytes, 1 MB = 10^6
STATE_ROLES = ("parameters", "gradients", "optimizer_state")
BLOCK_BEGIN, BLOCK_END = "<!-- figures.py: {} -->", "<!-- /figures.py -->"
# the full form's models: GPT-2 124M with micro-batches of 2 x 1024, 1.3B and 7B with 1 sequence;
# each rank takes one micro-step (gradient_accumulation_steps = W)
MODELS = {"124M": ["config/train_gpt2.py", "--batch_size=2"],
          "1.3B": ["config/train_gpt2.py", "config/model_1b.py", "--batch_size=1"],
          "7B": ["config/train_gpt2.py", "config/model_7b.py", "--batch_size=1"]}
SNAPSHOT_W = 2  # the memory snapshots LEARN.md links: 124M at this W, each backend
TINY_MODEL = ["--n_layer=3", "--n_head=4", "--n_embd=64", "--batch_size=4", "--block_size=32", "--wrap_policy=block"]
# the traces' model: big enough on 2 CPU cores for compute to hide communication under
TRACE_MODEL = ["--n_layer=8", "--n_head=12", "--n_embd=768", "--batch_size=4", "--block_size=64"]
TINY_TRACE_MODEL = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--batch_size=4", "--block_size=32"]
# the schedules the traces show: name, title, caption, train.py settings (gradient_accumulation_steps
# is the global count, over 2 ranks: 2 is one micro-step per rank, 4 two)
SCHEDULES = [
    ("zero3", "ZeRO-3 with prefetch (the default)",
     "Our FSDP issues each gather early and waits for it only when its unit computes, so the next unit's gather "
     "can run under this unit's compute; red shading marks what did not. FSDP2 waits for each gather as it "
     "issues it, on gloo (see below).",
     ["--gradient_accumulation_steps=2"]),
    ("zero2", "ZeRO-2 in FSDP's sense: reshard_after_forward=False",
     "Units stay gathered from forward to backward, so backward gathers nothing: two collectives per unit, not three.",
     ["--gradient_accumulation_steps=2", "--reshard_after_forward=False"]),
    ("kept-gathered", "two micro-steps, reshard_after_forward=False and reshard_after_backward=False",
     "Nothing is gathered after the first forward: the units stay gathered across micro-steps. "
     "Gradients are reduced once, in the last backward.",
     ["--gradient_accumulation_steps=4", "--reshard_after_forward=False", "--reshard_after_backward=False"]),
    ("no-sync", "two micro-steps, no gradient sync but in the last",
     "The first backward reduces nothing: each unit's gradients accumulate unsharded. "
     "The reduce-scatters come in the last backward only. Each forward and backward still gathers.",
     ["--gradient_accumulation_steps=4"]),
    ("no-prefetch", "ZeRO-3 without prefetch (prefetch=False)",
     "For contrast: under custom_fsdp each unit waits for its own gather. Under fsdp only forward prefetch is "
     "off: FSDP2 has no public switch for its backward prefetch, so its backward still gathers the next unit early.",
     ["--gradient_accumulation_steps=2", "--prefetch=False"]),
]
TRACE_NAMES = {"custom_fsdp": "our FSDP (custom_fsdp), rank 0", "fsdp": "FSDP2 (fsdp), rank 0"}


def run_rank(argv, log, env):
    """`python ARGV` as one rank in this forked process, with torchrun's worker environment `env`
    and its output in `log`; returns its exit code."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update({k: str(v) for k, v in env.items()})
        torch.set_num_threads(1)  # (torchrun's OMP_NUM_THREADS=1; the OpenMP runtime read it before the fork)
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


class Figures:
    """Where the outputs go, and the log of the commands that made each figure."""

    def __init__(self, figures_dir, results_dir, small, data_dir):
        self.figures_dir, self.results_dir, self.small, self.data_dir = figures_dir, results_dir, small, data_dir
        self.commands = {}  # figure or table -> its commands
        self.work = tempfile.mkdtemp(prefix="figures-")
        os.makedirs(figures_dir, exist_ok=True)
        os.makedirs(results_dir, exist_ok=True)

    def run(self, what, argv, torchrun=0):
        """Run `python ARGV` (under torchrun with that many processes), log it for `what`, and fail
        in one line with its last error line if it fails. plan.py's main and torchrun's ranks run
        forked from this process, which has imported torch: each starts at once, not in seconds."""
        shown = self.shown((f"torchrun --standalone --nproc_per_node={torchrun} " if torchrun else "python ")
                           + shlex.join(argv))
        for name in what:
            self.commands.setdefault(name, []).append(shown)
        if argv[0] == "plan.py" and not torchrun:
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
                try:
                    planner.main(argv[1:])
                except SystemExit as e:
                    raise SystemExit(f"error: {shown} failed: {e}")
            return
        if torchrun:
            failed = self.ranks(argv, torchrun)
            errors = open(failed).read() if failed else ""
        else:
            res = subprocess.run([sys.executable] + argv, cwd=HERE, capture_output=True, text=True)
            errors = res.stderr if res.returncode else ""
            failed = res.returncode
        if failed:
            lines = [line for line in errors.splitlines() if line.strip()] or ["(no output)"]
            raise SystemExit(f"error: {shown} failed: {next((x for x in lines if x.startswith('error')), lines[-1])}")

    def ranks(self, argv, world):
        """`torchrun --standalone --nproc_per_node=WORLD ARGV`: each rank forked with torchrun's
        environment, its output in a log; the first to fail stops the others, as torchrun does.
        Returns the failed rank's log, or None."""
        with socket.socket() as s:  # (a free port, as torchrun --standalone finds one)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sys.stdout.flush()
        sys.stderr.flush()
        logs = {}
        for rank in range(world):
            log = os.path.join(self.work, f"rank{rank}.log")
            pid = os.fork()
            if pid == 0:
                os._exit(run_rank(argv, log, dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS=1)))
            logs[pid] = log
        failed = None
        while logs:
            pid, status = os.wait()
            log = logs.pop(pid)
            if os.waitstatus_to_exitcode(status) and failed is None:
                failed = log
                for other in logs:
                    os.kill(other, signal.SIGTERM)
        return failed

    def shown(self, command):
        """A command as the docs show it: from the repository's root, scratch files under $WORK."""
        return command.replace(self.work, "$WORK").replace(HERE + os.sep, "")

    def figure(self, name):
        return os.path.join(self.figures_dir, name + ".png")

    def result(self, name):
        return os.path.join(self.results_dir, f"{name}.json")

    def save(self, name, rows, commands, **more):
        import bench
        about = bench.provenance() | {"command": " && ".join(commands), "device": bench.device_name(False)}
        with open(self.result(name), "w") as f:
            json.dump(about | {"learn": name, "rows": rows} | more, f, indent=1)

    def write_commands(self):
        """commands.md: each figure's commands; a figure this run did not make keeps its section."""
        path = os.path.join(self.figures_dir, "commands.md")
        kept = {}
        if os.path.exists(path):
            for section in open(path).read().split("\n## ")[1:]:
                name, _, body = section.partition("\n")
                kept[name] = [line for line in body.splitlines() if line and line != "```"]
        lines = ["# The commands behind each figure", "",
                 "Made by `python scripts/figures.py`, which runs them from the repository's root.",
                 "First the data the traces and benches read: `python data/shakespeare_char/prepare.py` writes "
                 "`data/shakespeare_char/`.",
                 "`$WORK` is a scratch folder figures.py makes and deletes; to run a command by hand, make one: "
                 "`WORK=$(mktemp -d)`.",
                 "A `--data_dir` elsewhere (the time model's `/tmp/x/data`) held the same prepared files.",
                 "A memory figure draws its commands' `--timeline_json` files, a panel per backend planned.",
                 "Where one command plans every backend, its `--timeline=PNG` draws the same figure.", ""]
        for name, commands in (kept | self.commands).items():
            lines += [f"## {name}", "", "```", *commands, "```", ""]
        with open(path, "w") as f:
            f.write("\n".join(lines))


# ---- memory: plan.py ------------------------------------------------------------------------------
def memory(fig):
    """The timelines, and the rows of memory per rank by W: one plan.py command per model and W (each
    rank takes one micro-step: gradient_accumulation_steps = W). Where a W is drawn, every backend
    drawn there is planned too ("all": the three)."""
    if fig.small:
        models = {"tiny": (TINY_MODEL + [f"--data_dir={fig.data_dir}"], [2], {2: "all"})}
    else:
        models = {"124M": (MODELS["124M"], [1, 2, 4, 8, 64], {1: "all", 2: "all", 8: "all"}),
                  "1.3B": (MODELS["1.3B"], [1, 2, 4, 8, 64], {}),
                  "7B": (MODELS["7B"], [1, 2, 4, 8, 64], {64: "fsdp"})}
    rows, plans, timeline_json = [], os.path.join(fig.work, "plan.json"), os.path.join(fig.work, "timeline.json")
    snapshots = []
    for model, (settings, worlds, drawn) in models.items():
        shape = training.settings(settings)
        shape["vocab_size"] = training.vocab_size(shape)
        parameters = sum(p.numel() for p in planner.meta_model(shape).parameters())
        for w in worlds:
            name = f"memory-{model}-w{w}"
            timelines = []
            backends = [None] if drawn.get(w) == "all" else ["fsdp", "custom_fsdp"] if w in drawn else ["custom_fsdp"]
            if backends != [None]:
                backends = ["ddp"] + backends  # (each W's baseline: DDP at the same W, its buckets included)
            for backend in backends:
                argv = ["plan.py", *settings, f"--nproc={w}", f"--gradient_accumulation_steps={w}", f"--json={plans}"]
                argv += [f"--dist_backend={backend}"] * (backend is not None)
                argv += [f"--timeline_json={timeline_json}"] * (w in drawn)
                snapshot = drawn.get(w) == "all" and w == SNAPSHOT_W
                if snapshot:  # (plan.py names one file per backend: STEM-ddp.pickle, ...)
                    os.makedirs(os.path.join(fig.figures_dir, "memory_viz"), exist_ok=True)
                    argv.append(f"--snapshot={os.path.join(fig.figures_dir, 'memory_viz', f'{model}-w{w}.pickle')}")
                fig.run(["memory-by-w"] + [name] * (w in drawn), argv)
                rows += [dict(r, model=model, parameters=parameters) for r in json.load(open(plans))]
                if snapshot:
                    snapshots += [{"backend": r["backend"], "file": f"memory_viz/{model}-w{w}-{r['backend']}.pickle",
                                   "bytes": os.path.getsize(os.path.join(fig.figures_dir, "memory_viz",
                                                                         f"{model}-w{w}-{r['backend']}.pickle"))}
                                  for r in json.load(open(plans))]
                if w in drawn:
                    timelines += json.load(open(timeline_json))
            if timelines:
                planner.draw_timelines(timelines, dict(shape, dtype="bfloat16"), fig.figure(name), decimal=True,
                                       title=f"GPT {model} at W={w}: rank 0's allocated memory over two planned steps")
    fig.save("memory-by-w", rows, fig.commands["memory-by-w"], snapshots=snapshots)


def render_memory_by_w(result):
    """Per model: DDP at the fewest ranks as the baseline, then custom_fsdp's at each W against DDP at that W, with the state
    it shards, what the peak is made of, and the state at a fixed moment, the end of backward."""
    def gb(n):
        return f"{n / GB:.2f}"
    lines = ["| model | backend | W | state | peak | peak vs DDP at this W | peak at | at the peak: state | gathered | activations "
             "| communication | end of backward: parameters | gradients | optimizer state |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["model"] == model]
        ddp = {r["nproc"]: r for r in rows if r["backend"] == "ddp"}
        base = ddp[min(ddp)] if ddp else None  # (the write-up's baseline: DDP at the fewest ranks)
        for r in ([base] if base else []) + [r for r in rows if r["backend"] == "custom_fsdp"]:
            peak, end = r["peak_made_of"], r.get("backward_end_made_of") or {}
            state = sum(peak[k] for k in STATE_ROLES)
            same_w = ddp.get(r["nproc"])
            less = None if r is base or same_w is None else same_w["peak_allocated_bytes"] / r["peak_allocated_bytes"]
            ratio = "1" if less is None else f"{less:.{2 if less < 1.1 else 1}f}x less"
            lines.append(f"| {model} | {r['backend']} | {r['nproc']} | {gb(r['state_bytes'])} | "
                         f"{gb(r['peak_allocated_bytes'])} | {ratio} | {r['peak_at'].removeprefix('step 2 ')} | {gb(state)} | "
                         f"{gb(peak['gathered_parameters'])} | {gb(peak['activations'])} | "
                         f"{gb(peak['communication'] + peak['other'])} | " + " | ".join(gb(end.get(k, 0)) for k in STATE_ROLES) + " |")
    lines += ["", "GB per rank, rank 0, bfloat16 compute, each rank one micro-step of the model's batch: "
              "2 x 1024 tokens for 124M, 1 x 1024 for 1.3B, 1 x 2048 for 7B.",
              "state: parameters, gradients and Adam's moments, 16 bytes a parameter, which FSDP divides by W; "
              "DDP holds all of it.",
              "At the peak, the moment the most bytes are live, the state counts only the gradients alive then; "
              "communication holds the collectives' buffers, DDP's buckets among them. At the end of backward every gradient is reduced to its "
              "shard: the state columns show the division by W."]
    units = {model: blocks_per_unit(TINY_MODEL if model == "tiny" else MODELS[model])
             for model in dict.fromkeys(r["model"] for r in result["rows"])}
    lines.append("Units: " + ", ".join(f"{m} {n} block{'s' if n > 1 else ''} each" for m, n in units.items())
                 + f" (`wrap_policy=size` adds blocks to a unit until it holds {training.defaults()['min_wrap_params'] / 1e6:g}M "
                 "parameters); "
                 "the root unit holds the embeddings and the last norm.")
    return lines


def blocks_per_unit(settings):
    """How many transformer blocks train.py's wrap policy puts in one unit of this model (backends.py's rule)."""
    shape = training.settings(settings)
    shape["vocab_size"] = training.vocab_size(shape)
    if shape["wrap_policy"] != "size":
        return 1 if shape["wrap_policy"] == "block" else shape["n_layer"]
    block = sum(p.numel() for p in planner.meta_model(shape).transformer.h[0].parameters())
    return min(shape["n_layer"], -(-shape["min_wrap_params"] // block))


def render_snapshots(result):
    """The memory snapshots plan.py wrote, a link per backend, with the peak each shows against the table's."""
    lines = []
    for s in result.get("snapshots", []):
        (row,) = [r for r in result["rows"] if r["backend"] == s["backend"] and s["file"].endswith(
            f"{r['model']}-w{r['nproc']}-{r['backend']}.pickle")]
        lines.append(f"- [{s['backend']}](figures/{s['file']}), {s['bytes'] / 1e3:.0f} KB: its peak "
                     f"{row['cuda_allocated_bytes'] / GB:.2f} GB, the plan's allocated {row['peak_allocated_bytes'] / GB:.2f} GB "
                     f"plus {(row['cuda_allocated_bytes'] - row['peak_allocated_bytes']) / 1e6:.0f} MB")
    return lines


def render_comm_formula(result):
    """The plan's exact bytes per step beside ZeRO's formula, for P parameters: FSDP gathers them
    in bfloat16 in forward and again in backward and reduce-scatters float32 gradients; DDP
    all-reduces float32 gradients. Bus bytes are what each rank's link carries."""
    lines = ["| backend | W | all-gather GB | formula | reduce-scatter GB | formula | all-reduce GB | formula "
             "| bus GB | formula |", "|---|---:|" + "---:|" * 8]
    beside_fsdp2 = {(r["model"], r["nproc"]) for r in result["rows"] if r["backend"] == "fsdp"}
    for r in result["rows"]:
        if r["model"] not in ("124M", "tiny") or r["nproc"] == 1:
            continue
        if r["backend"] == "ddp" and (r["model"], r["nproc"]) not in beside_fsdp2:
            continue  # (DDP's bytes are the same at every W: shown where FSDP2's are)
        p, w, c = r["parameters"], r["nproc"], r["comm_bytes_per_step"]
        formula = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4 * p} if r["backend"] == "ddp" else {
            "all_gather": 2 * 2 * p, "reduce_scatter": 4 * p, "all_reduce": 0}
        bus = (w - 1) / w * (formula["all_gather"] + formula["reduce_scatter"] + 2 * formula["all_reduce"])
        lines.append(f"| {r['backend']} | {w} | " + " | ".join(
            f"{c.get(k, 0) / 1e9:.3f} | {formula[k] / 1e9:.3f}" for k in formula)
            + f" | {r['comm_bus_bytes_per_step'] / 1e9:.3f} | {bus / 1e9:.3f} |")
    lines += ["", "GB per rank and step, as the plan counts them, beside the formula; bfloat16 gathers, float32 reductions.",
              "FSDP gathers less than its formula: train.py keeps the root and the last unit gathered from forward "
              "to backward, since their backward comes first (`backends.py`).",
              "The loss's all-reduce is the few bytes in the FSDP rows' all-reduce column."]
    example = next((r for r in result["rows"] if r["model"] == "124M" and r["nproc"] == 8
                    and r["backend"] == "custom_fsdp"), None)
    if example:
        p, w, c = example["parameters"], example["nproc"], example["comm_bytes_per_step"]
        lines += ["", f"Worked example, GPT-2 124M at W={w}: P = {p / 1e6:.1f}M parameters.",
                  f"- All-gather: forward and backward each gather 2 bytes a parameter, 2 x 2 x P = {4 * p / 1e9:.3f} GB.",
                  f"- Reduce-scatter: float32 gradients, 4 x P = {4 * p / 1e9:.3f} GB.",
                  f"- Bus bytes: ({w}-1)/{w} x ({4 * p / 1e9:.3f} + {4 * p / 1e9:.3f}) = "
                  f"{(w - 1) / w * 8 * p / 1e9:.3f} GB, the table's formula.",
                  f"- The plan gathers {c['all_gather'] / 1e9:.3f} GB, so its bus bytes are "
                  f"{example['comm_bus_bytes_per_step'] / 1e9:.3f} GB."]
    return lines


# ---- traces: train.py --profile, overlap.py --png ---------------------------------------------------
TRACE_RUNS = 3  # profiled runs per schedule and backend: the figure draws the median run's median step


def traces(fig):
    """Per schedule, each backend's median profiled step (of observe.py's window) drawn as lanes, its
    overlap figures into results/learn/traces.json, and that step trimmed for Perfetto beside the
    figures. Then the same schedules as plan.py predicts them on two H100s, in one figure."""
    schedules = SCHEDULES[:1] if fig.small else SCHEDULES
    model = TINY_TRACE_MODEL if fig.small else TRACE_MODEL
    rows, predicted = [], []
    for name, title, _, settings in schedules:
        paths, drawn = [], []
        for backend in ("custom_fsdp",) if fig.small else ("custom_fsdp", "fsdp"):
            runs = []  # per run: (its median profiled step, the trace's path)
            for run in range(1 if fig.small else TRACE_RUNS):
                out = os.path.join(fig.work, f"trace-{name}-{backend}-{run}")
                fig.run([f"trace-{name}"] * (run == 0), ["train.py", "--device=cpu", f"--data_dir={fig.data_dir}",
                                                        f"--out_dir={out}", f"--dist_backend={backend}", *model,
                                                        "--wrap_policy=block", f"--max_iters={observe.PROFILE_STEPS[1]}",
                                                        "--eval_iters=0", "--eval_interval=1000", "--keep_checkpoints=0",
                                                        "--profile=True", *settings], torchrun=2)
                path = os.path.join(out, "traces", backend, "rank0.json")
                steps = sorted(overlap.analyse(overlap.load(path)), key=lambda r: r["step_ms"])
                runs.append((steps[len(steps) // 2], path, [r["step_ms"] for r in steps]))
            runs.sort(key=lambda r: r[0]["step_ms"])
            median, path, steps_ms = runs[len(runs) // 2]  # (the median run's median step)
            paths.append(path)
            drawn.append(int(median["step"].removeprefix("ProfilerStep#")))
            rows.append(dict(median, schedule=name, backend=backend, profiled_steps_ms=steps_ms,
                             runs_step_ms=[r[0]["step_ms"] for r in runs]))
            perfetto(overlap.load(path), os.path.join(fig.figures_dir, "perfetto", f"{name}-{backend}.json.gz"),
                     median["step"])
        png = fig.figure(f"trace-{name}")
        overlap.draw(paths, png, step=drawn, names=[TRACE_NAMES[os.path.basename(os.path.dirname(p))] for p in paths],
                     title=f"{title}: each backend's median profiled step, W=2 on 2 CPU cores (gloo), 57M parameters, float32")
        fig.commands[f"trace-{name}"].append(fig.shown(f"python overlap.py {shlex.join(paths)} --png={png}"))
        lanes = os.path.join(fig.work, f"h100-{name}.json")
        fig.run(["trace-h100"], ["plan.py", "--gpu=h100", "--nproc=2", "--dist_backend=custom_fsdp", *model,
                                 "--wrap_policy=block", "--dtype=float32", *settings, f"--lanes_json={lanes}"])
        predicted.append((lanes, title))
    png = fig.figure("trace-h100")
    overlap.draw([p for p, _ in predicted], png, names=[f"{t}: custom_fsdp W=2, predicted" for _, t in predicted],
                 title="The same schedules on two H100s, as plan.py predicts them (float32; datasheet figures)")
    fig.commands["trace-h100"].append(fig.shown(f"python overlap.py {shlex.join(p for p, _ in predicted)} --png={png}"))
    fig.save("traces", rows, [c for name, *_ in schedules for c in fig.commands[f"trace-{name}"]]
             + fig.commands["trace-h100"])


def perfetto(trace, path, step):
    """Profiled step `step` (its ProfilerStep name) for ui.perfetto.dev, small: the events within it,
    the operators' argument lists and autograd's forward-backward arrows dropped, times rounded to
    0.1 us, gzipped (Perfetto opens .json.gz)."""
    import gzip
    (span,) = [e for e in trace["traceEvents"] if e.get("name") == step and e.get("ph") == "X"]
    lo, hi = span["ts"], span["ts"] + span["dur"]
    events = []
    for e in trace["traceEvents"]:
        if e.get("ph") in ("s", "f") or (e.get("ph") == "X" and not (lo <= e["ts"] and e["ts"] + e.get("dur", 0) <= hi)):
            continue
        e = dict(e)
        if e.get("cat") == "cpu_op":
            e.pop("args", None)
        for key in ("ts", "dur"):
            if key in e:
                e[key] = round(e[key], 1)
        events.append(e)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(dict(trace, traceEvents=events), f, separators=(",", ":"))


def render_traces(result):
    """Each schedule's figure and caption; then the overlap of every drawn step, from traces.json."""
    lines = []
    for name, title, caption, _ in SCHEDULES:
        lines += [f"![{title}](figures/trace-{name}.png)\\", f"**{title}.** {caption}", ""]
    if result:
        lines += ["| schedule | backend | step ms | communication ms | exposed ms | hidden | Perfetto |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for r in result["rows"]:
            hidden = "-" if r["hidden_fraction"] is None else f"{r['hidden_fraction']:.0%}"
            lines.append(f"| {r['schedule']} | {r['backend']} | {r['step_ms']:.0f} | {r['comm_ms']:.0f} | "
                         f"{r['exposed_ms']:.0f} | {hidden} | [{r['schedule']}-{r['backend']}.json.gz]"
                         f"(figures/perfetto/{r['schedule']}-{r['backend']}.json.gz) |")
        steps = {len(r.get("profiled_steps_ms", [None])) for r in result["rows"]}.pop()
        runs = {len(r.get("runs_step_ms", [None])) for r in result["rows"]}.pop()
        lines += ["", f"Each row is the step drawn: of {runs} profiled runs, the one whose median step is the median, and "
                      f"that median of its {steps} profiled steps. The profiler slows each step, so these times are not "
                      "bench.py's. communication: the time any collective ran; hidden: the part under the training "
                      "thread's compute."]
        spread = [r for r in result["rows"] if len(r.get("runs_step_ms", [])) > 1]
        if spread:
            widest = max(spread, key=lambda r: max(r["runs_step_ms"]) - min(r["runs_step_ms"]))
            lines[-1] += (f" The runs disagree: {widest['schedule']} under {widest['backend']} took "
                          f"{min(widest['runs_step_ms']):,.0f} to {max(widest['runs_step_ms']):,.0f} ms a step.")
        comm = {(r["schedule"], r["backend"]): r["comm_ms"] for r in result["rows"]}
        pairs = [s for s, b in comm if b == "fsdp" and (s, "custom_fsdp") in comm]
        longer = sum(comm[(s, "custom_fsdp")] > comm[(s, "fsdp")] for s in pairs)
        if pairs:
            lines.append(f"Our collectives ran longer than FSDP2's in {longer} of {len(pairs)} schedules: they share the "
                         "two cores with compute, while FSDP2's run as its thread waits. So one profiled step can favour "
                         "either backend: compare them by the unprofiled, repeated step-time table below.")
    lines += ["", "![The same schedules on two H100s, predicted](figures/trace-h100.png)\\",
              "**The same schedules on two H100s, as plan.py predicts them.** Not measured: datasheet figures, float32 as above. "
              "On a GPU each collective runs on a stream of its own, so the all-gathers and reduce-scatters run under "
              "compute where gloo on 2 cores waits."]
    return lines


# ---- collectives, step time, weak scaling ---------------------------------------------------------
COLLECTIVE_CALLS = 20  # timed calls per op, size and W


def collectives(fig):
    rows, commands = [], []
    for w in (2,) if fig.small else (2, 4):
        path = os.path.join(fig.work, f"collectives-{w}.json")
        sizes = "0.01" if fig.small else "1,10,100"
        fig.run(["collectives"], ["scripts/collectives.py", f"--json={path}", f"--sizes_mb={sizes}",
                                  f"--iters={3 if fig.small else COLLECTIVE_CALLS}"], torchrun=w)
        commands.append(fig.commands["collectives"][-1])
        rows += [dict(r, iters=3 if fig.small else COLLECTIVE_CALLS) for r in json.load(open(path))["collectives"]]
    fig.save("collectives", rows, commands)


def render_collectives(result):
    lines = ["| op | MB | W | ms | algbw GB/s | busbw GB/s | ran as |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        shared = " (4 processes on 2 cores)" if r["world_size"] > 2 else ""
        lines.append(f"| {r['op']} | {r['size_bytes'] / 1e6:g} | {r['world_size']}{shared} | {r['seconds'] * 1e3:.2f} | "
                     f"{r['algbw_gbps']:.2f} | {r['busbw_gbps']:.2f} | {r['ran_as']} |")
    time = {(r["op"], r["size_bytes"], r["world_size"]): r["seconds"] for r in result["rows"]}
    dearer = sorted({(size, w) for op, size, w in time if op == "reduce_scatter"
                     and time[(op, size, w)] > time.get(("all_reduce", size, w), float("inf"))})
    cheaper = sorted({(size, w) for op, size, w in time if op == "reduce_scatter"} - set(dearer))
    calls = result["rows"][0].get("iters", "?")
    lines += ["", f"{result['device']}, {result['torch']}; float32; each row the median of {calls} timed calls, "
              "each between barriers, after one untimed.",
              "gloo runs a reduce-scatter as an all-reduce of the whole input, then keeps its shard (\"ran as\").",
              "So it moves an all-reduce's bytes, and here it took longer than the all-reduce at "
              + ", ".join(f"{size / 1e6:g} MB W={w}" for size, w in dearer) + "."
              + ("" if not cheaper else " It did not at " + ", ".join(f"{size / 1e6:g} MB W={w}" for size, w in cheaper)
                 + ": the two run the same transfer, and at those sizes the calls' spread decides."),
              "At W=4 four processes share two cores, so their times include waiting for a core."]
    return lines


# the step-time table's run: IMPLEMENTATION.md renders the same file (results/, not results/learn/)
STEP_TIME = "cpu-w2-8x768-batch4x64-block"


def step_time(fig):
    rows = "ddp,fsdp,custom_fsdp" + ("" if fig.small else ",fsdp:prefetch=False,custom_fsdp:prefetch=False")
    path = fig.result("step-time") if fig.small else os.path.join("results", f"{STEP_TIME}.json")
    model = TINY_TRACE_MODEL if fig.small else TRACE_MODEL
    fig.run(["step-time"], ["bench.py", f"--backends={rows}", "--nproc=2", f"--repeats={1 if fig.small else 3}",
                            "--steps=8", "--gradient_accumulation_steps=2", "--exposed=True", "--device=cpu",
                            f"--data_dir={fig.data_dir}", "--wrap_policy=block", *model, f"--json={path}"])


def render_step_time(result):
    """Each row's median step, its ratio to the first row's, its peak, its communication and the
    share of the step it left exposed; then what prefetch buys each backend."""
    lines = ["| row | step ms | x ddp | peak MB (RSS) | comm MB/step | profiled step ms | comm ms | exposed ms | "
             "exposed, % of step | hidden |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = result["backends"]
    base = next(iter(rows.values()))["step_ms"]
    for name, r in rows.items():
        profiled = r.get("profiled_step_ms")

        def ms(key):
            return "-" if r.get(key) is None else f"{r[key]:.0f}"
        share = f"{r['exposed_comm_ms'] / profiled:.0%}" if profiled and r.get("exposed_comm_ms") is not None else "-"
        hidden = "-" if r.get("hidden_fraction") is None else f"{r['hidden_fraction']:.0%}"
        lines.append(f"| {name} | {r['step_ms']:.0f} | {r['step_ms'] / base:.2f} | {r['peak_mem_mb'] * 2**20 / 1e6:,.0f} | "
                     f"{r['comm_mb'] * 2**20 / 1e6:.1f} | {ms('profiled_step_ms')} | {ms('comm_ms')} | "
                     f"{ms('exposed_comm_ms')} | {share} | {hidden} |")
    speedups = [f"{b}: {rows[f'{b}:prefetch=False']['step_ms'] / rows[b]['step_ms']:.2f}x" for b in ("fsdp", "custom_fsdp")
                if b in rows and f"{b}:prefetch=False" in rows]
    lines += ["", f"{result['device']}, {result['torch']}, commit {result['commit']}, median of {result['repeats']} "
              f"repeats of {result['steps']} steps: `{result['command']}`.",
              "57M parameters, float32 on CPU, so gathers move 4 bytes a parameter, not bfloat16's 2.",
              "Peak: the largest rank's resident memory (IMPLEMENTATION.md prints this run in MiB). The profiled columns come from one more run per row, "
              "its steps 2 to 4 profiled:",
              "the profiler slows the step, and one run on this shared machine is noisy, so compare their shares, "
              "not their ms, with the step.",
              "DDP's all-reduce runs in its C++ reducer, out of the counters' sight: its bytes are its gradients' size."]
    if speedups:
        lines.append("Prefetch's speedup, the step without it over the step with it: " + ", ".join(speedups) + ".")
        lines.append("fsdp:prefetch=False turns forward prefetch off only: FSDP2 keeps its backward prefetch.")
    return lines


def weak_scaling(fig):
    """Parameters per rank held constant: the model takes 2 W layers of width 256 (tiny: W layers of 64)."""
    rows, commands = [], []
    width = ["--n_embd=64", "--n_head=2"] if fig.small else ["--n_embd=256", "--n_head=4"]
    micro = ["--batch_size=4", "--block_size=64", f"--data_dir={fig.data_dir}"]
    per_w = 1 if fig.small else 2
    for w in (1, 2) if fig.small else (1, 2, 4, 8, 16, 32, 64):
        path = os.path.join(fig.work, "weak.json")
        fig.run(["weak-scaling"], ["plan.py", "--dist_backend=custom_fsdp", f"--nproc={w}", f"--n_layer={per_w * w}",
                                   *width, *micro, f"--gradient_accumulation_steps={w}", "--dtype=float32",
                                   "--wrap_policy=block", f"--json={path}"])
        commands.append(fig.commands["weak-scaling"][-1])
        (row,) = json.load(open(path))
        shape = training.settings([f"--n_layer={per_w * w}", *width, *micro])
        shape["vocab_size"] = training.vocab_size(shape)
        row |= {"n_layer": per_w * w, "parameters": sum(p.numel() for p in planner.meta_model(shape).parameters())}
        if w <= (2 if fig.small else 4):
            bench_path = os.path.join(fig.work, f"weak-bench-{w}.json")
            fig.run(["weak-scaling"], ["bench.py", "--backends=custom_fsdp", f"--nproc={w}",
                                       f"--repeats={1 if fig.small else 3}", "--steps=6", "--device=cpu",
                                       f"--n_layer={per_w * w}", *width, *micro, "--wrap_policy=block",
                                       f"--gradient_accumulation_steps={w}", f"--json={bench_path}"])
            commands.append(fig.commands["weak-scaling"][-1])
            row["step_ms"] = json.load(open(bench_path))["backends"]["custom_fsdp"]["step_ms"]
        rows.append(row)
    fig.save("weak-scaling", rows, commands)


def render_weak_scaling(result):
    lines = ["| W | layers | parameters | state per rank MB | peak per rank MB | step ms (CPU, gloo) |",
             "|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        step = f"{r['step_ms']:.0f}" if "step_ms" in r else f"not run: {r['nproc']} processes on 2 cores"
        lines.append(f"| {r['nproc']} | {r['n_layer']} | {r['parameters'] / 1e6:.1f}M | {r['state_bytes'] / 1e6:.1f} | "
                     f"{r['peak_allocated_bytes'] / 1e6:.1f} | {step} |")
    lines += ["", "custom_fsdp, float32, one micro-step of 4 x 64 tokens per rank. The state per rank stays flat.",
              "The peak grows with depth: each rank keeps every layer's activations of its own micro-batch.",
              "Step time is bench.py's median of 3 repeats. Above W=2 the processes share 2 cores, so time grows with W "
              "for want of cores, not for FSDP; above W=4 a step would measure only the sharing."]
    return lines


# ---- correctness: one training run per backend against one process -----------------------------------
# label, W, backend: the same global batch (2 micro-batches) in one process and over 2 ranks
CORRECTNESS_RUNS = [("one process", 1, "ddp"), ("ddp", 2, "ddp"), ("fsdp", 2, "fsdp"), ("custom_fsdp", 2, "custom_fsdp")]


def correctness(fig):
    """Each run's loss and grad norm per iteration (train.py's metrics.jsonl), same seed, data and
    global batch; LEARN.md tabulates how far each is from one process, and from FSDP2."""
    model = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=32", "--batch_size=4"] if fig.small else \
        ["--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=64", "--batch_size=8"]
    iters = 3 if fig.small else 10
    rows = []
    for label, world, backend in CORRECTNESS_RUNS:
        out = os.path.join(fig.work, f"correctness-{label.replace(' ', '-')}")
        argv = ["train.py", "--device=cpu", f"--out_dir={out}", f"--data_dir={fig.data_dir}", f"--dist_backend={backend}",
                *model, "--gradient_accumulation_steps=2", "--dtype=float32", f"--max_iters={iters}", "--eval_iters=0",
                "--eval_interval=1000000", "--keep_checkpoints=0", "--log_interval=1", "--wrap_policy=block"]
        fig.run(["correctness"], argv, torchrun=world if world > 1 else 0)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [r for r in map(json.loads, f) if "loss" in r and "grad_norm" in r]
        rows.append(dict(run=label, world=world, backend=backend, model=model,
                         loss=[r["loss"] for r in steps], grad_norm=[r["grad_norm"] for r in steps]))
    fig.save("correctness", rows, fig.commands["correctness"])


def render_correctness(result):
    """Per run: the last loss, and the largest gaps of loss and grad norm to one process and to FSDP2."""
    runs = {r["run"]: r for r in result["rows"]}
    one, fsdp2 = runs["one process"], runs["fsdp"]

    def gap(r, ref, key):
        return max(abs(a - b) for a, b in zip(r[key], ref[key]))
    lines = ["| run | W | last loss | largest loss gap to one process | largest grad-norm gap | the same bits as FSDP2 |",
             "|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        same = "-" if r is fsdp2 or r["world"] != fsdp2["world"] else \
            ("yes" if r["loss"] == fsdp2["loss"] and r["grad_norm"] == fsdp2["grad_norm"] else "no")
        lines.append(f"| {r['run']} | {r['world']} | {r['loss'][-1]:.6f} | {gap(r, one, 'loss'):.1e} | "
                     f"{gap(r, one, 'grad_norm'):.1e} | {same} |")
    lines += ["", f"{len(one['loss'])} steps of the same global batch, 2 micro-batches, from one seed, float32 on CPU; "
                  f"`{' '.join(one['model'])}`, a unit per block; {result['device']}, {result['torch']}, "
                  f"commit {result['commit']}."]
    exact = [r["run"] for r in result["rows"] if r is not one and not gap(r, one, "loss") and not gap(r, one, "grad_norm")]
    if exact:
        lines.append(f"{' and '.join(exact)} {'equals' if len(exact) == 1 else 'equal'} one process bit for bit.")
    if gap(fsdp2, one, "grad_norm"):
        lines.append("The FSDP backends sum the gradient norm's squares shard by shard, in another order than one process, "
                     "so the norm differs in its last bits. Clipping (grad_clip=1.0) scales each step by it, "
                     "so the losses drift by as much.")
    return lines


# ---- unit size and prefetch: plan.py's peak, bench.py's step -------------------------------------
# name, blocks per unit (None: one unit for the whole model), train.py settings
UNIT_SIZES = [("1 block", 1, ["wrap_policy=block"]), ("1 block, no prefetch", 1, ["wrap_policy=block", "prefetch=False"]),
              ("2 blocks", 2, ["wrap_policy=size"]), ("4 blocks", 4, ["wrap_policy=size"]),
              ("the whole model", None, ["wrap_policy=model"])]


def unit_sizes(fig):
    """The traces' model at W=2 under each unit size of UNIT_SIZES: the planned peak (exact) and the
    measured step (bench.py, the same runs side by side)."""
    model = TINY_TRACE_MODEL if fig.small else TRACE_MODEL
    common = [*model, "--gradient_accumulation_steps=2", f"--data_dir={fig.data_dir}"]
    shape = training.settings(common)
    shape["vocab_size"] = training.vocab_size(shape)
    gpt = planner.meta_model(shape)
    block, whole = (sum(p.numel() for p in m.parameters()) for m in (gpt.transformer.h[0], gpt))
    rows, path, runs = [], os.path.join(fig.work, "unit.json"), []
    for name, blocks, settings in UNIT_SIZES:
        if "wrap_policy=size" in settings:
            settings = settings + [f"min_wrap_params={blocks * block}"]
        fig.run(["unit-sizes"], ["plan.py", "--device=cpu", "--dist_backend=custom_fsdp", "--nproc=2", "--dtype=float32",
                                 *common, *[f"--{kv}" for kv in settings], f"--json={path}"])
        (row,) = json.load(open(path))
        rows.append(dict(row, unit=name, settings=settings, unit_bytes=4 * (blocks * block if blocks else whole)))
        runs.append("custom_fsdp:" + ":".join(settings))
    bench_path = os.path.join(fig.work, "unit-bench.json")
    fig.run(["unit-sizes"], ["bench.py", "--backends=" + ",".join(runs), "--nproc=2", f"--repeats={1 if fig.small else 3}",
                             "--steps=6", "--exposed=False", "--device=cpu", *common, f"--json={bench_path}"])
    measured = json.load(open(bench_path))
    for row, run in zip(rows, runs):
        row["step_ms"] = measured["backends"][run]["step_ms"]
    fig.save("unit-sizes", rows, fig.commands["unit-sizes"])


def render_unit_sizes(result):
    def mb(n):
        return f"{n / 1e6:.1f}"
    lines = ["| unit | unit MB | planned peak MB | peak at | at the peak: gathered MB | communication MB | "
             "all-gather MB/step | step ms (CPU) |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        made = r["peak_made_of"]
        lines.append(f"| {r['unit']} | {mb(r['unit_bytes'])} | {mb(r['peak_allocated_bytes'])} | {r['peak_at'].removeprefix('step 2 ')} | "
                     f"{mb(made['gathered_parameters'])} | {mb(made['communication'])} | "
                     f"{mb(r['comm_bytes_per_step'].get('all_gather', 0))} | {r['step_ms']:.0f} |")
    micro = result["rows"][0]["micro_steps"]
    lines += ["", f"custom_fsdp at W=2, the traces' model (57M parameters, float32), {micro} micro-step"
              f"{'s' if micro > 1 else ''} per rank; "
              f"{result['device']}, {result['torch']}, commit {result['commit']}.",
              "Unit MB: a unit's parameters in float32, what one gather delivers. Peak: plan.py's, the allocator's bytes. "
              "Step: bench.py's median of 3 repeats.",
              "Communication at the peak is what collectives hold in flight: reduce-scatter inputs (unsharded gradients) "
              "and gathers' outputs,",
              "each with gloo's own buffer beside it (`GlooBuffers` in `planner/counting.py`); NCCL needs no such buffers.",
              "Larger units hold more in flight at once, so the peak grows faster than the unit."]
    by_unit = {r["unit"]: r for r in result["rows"]}
    with_, without = by_unit.get("1 block"), by_unit.get("1 block, no prefetch")
    if with_ and without:
        more = {role: with_["peak_made_of"][role] - without["peak_made_of"][role] for role in with_["peak_made_of"]}
        lines += ["", f"Prefetch's memory: it raises the planned peak by "
                      f"{(with_['peak_allocated_bytes'] - without['peak_allocated_bytes']) / 1e6:.1f} MB, "
                      f"where one block gathers {with_['unit_bytes'] / 1e6:.1f} MB in float32.",
                  "By role at the two peaks: " + ", ".join(f"{role.replace('_', ' ')} {mb / 1e6:+.1f} MB"
                                                          for role, mb in more.items() if abs(mb) >= 0.05e6) + "."]
        if with_["peak_at"] != without["peak_at"]:
            lines.append(f"The peak also moves, from {without['peak_at'].removeprefix('step 2 ')} to "
                         f"{with_['peak_at'].removeprefix('step 2 ')}: one unit earlier, where more is alive.")
    return lines


# ---- fsdp_impl's step, drawn ------------------------------------------------------------------------
SHARDING_WORLD = 3  # ranks in the sharding figure: 8 rows do not split evenly, so padding shows


def draw_sharding(png):
    """One transformer block of an 8-wide GPT at W=3, as fsdp_impl lays it out (its ParamShard and
    Layout, on a meta model): each parameter's rows split by rank, with the padding a short last
    chunk gets, and each rank's flat shard, the parameters back to back."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from fsdp_impl.layout import Layout
    from fsdp_impl.param import ParamShard
    from model import GPT, GPTConfig
    world = SHARDING_WORLD
    with torch.device("meta"):
        block = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16, dropout=0.0,
                              bias=False)).transformer.h[0]
    named = list(block.named_parameters())
    shards = []  # per rank: its ParamShards, laid out
    for rank in range(world):
        shards.append([ParamShard([], p, world, rank, None, None, 0) for _, p in named])
        Layout(shards[-1], world)
    rank_colours = ["#4c72b0", "#55a868", "#dd8452"]
    fig_, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1, 1.6]})
    for i, (name, p) in enumerate(named):
        y, rows = len(named) - 1 - i, p.shape[0]
        for rank in range(world):
            ps = shards[rank][i]
            size, held = -(-rows // world), ps.local_shape[0]  # (torch.chunk's rows per rank, and what it got)
            left.barh(y, held, left=ps.first, color=rank_colours[rank], edgecolor="white")
            if held < size:  # (the padding: rows this rank's chunk lacks, zeros in its flat shard)
                left.barh(y, size - held, left=ps.first + held, color="white", edgecolor=rank_colours[rank], hatch="//")
        left.text(-0.5, y, f"{name} {tuple(p.shape)}", ha="right", va="center", fontsize=9)
    left.set_yticks([])
    left.set_xlabel("rows (dim 0): rank r holds torch.chunk's rows r*ceil(rows/W) onwards")
    left.set_title(f"each parameter's rows over W={world} ranks", fontsize=10)
    left.set_xlim(-0.5, max(p.shape[0] for _, p in named) + 2)
    for rank in range(world):
        y = world - 1 - rank
        for i, ((name, p), ps) in enumerate(zip(named, shards[rank])):
            right.barh(y, ps.local_numel, left=ps.offset, color=rank_colours[rank], edgecolor="white")
            if ps.slot > ps.local_numel:
                right.barh(y, ps.slot - ps.local_numel, left=ps.offset + ps.local_numel, color="white",
                           edgecolor=rank_colours[rank], hatch="//")
            if rank == 0:
                right.text(ps.offset + ps.slot / 2, world - 0.5 + 0.15 * (i % 2), name.rsplit(".", 1)[0], ha="center",
                           fontsize=8)
        right.text(-2, y, f"rank {rank}", ha="right", va="center", fontsize=9)
    right.set_yticks([])
    right.set_xlabel(f"elements of flat_shard ({shards[0][-1].offset + shards[0][-1].slot} per rank): "
                     "the all-gather's input; the sharded parameters view it")
    right.set_title("each rank's flat shard: every parameter's chunk, padded to the same size on every rank", fontsize=10)
    right.set_ylim(-0.6, world - 0.05)
    left.barh(0, 0, color="white", edgecolor="grey", hatch="//", label="padding: zeros, never a real row")
    left.legend(loc="upper right", fontsize=8)
    fig_.suptitle(f"One transformer block (8 wide) sharded over W={world}, as fsdp_impl and FSDP2 lay it out")
    fig_.tight_layout()
    fig_.savefig(png, dpi=110)
    plt.close(fig_)


def architecture(fig):
    """docs/figures/fsdp-step.png: where fsdp_impl's hooks fire in one step of two units, and what each
    issues. Drawn from this description, not from a run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    lanes = {"hook": 3.0, "compute": 2.0, "all-gather": 1.0, "reduce-scatter": 0.0}
    colours = {"hook": "#eeeeee", "compute": "#4c72b0", "all-gather": "#55a868", "reduce-scatter": "#dd8452"}
    # the step in order: (lane, text, the collectives it issues, each drawn from the box's end on)
    steps = [("hook", "pre-forward A:\ngather A, wait;\nissue gather B", ["gather B"]),
             ("compute", "forward A", []), ("hook", "post-forward A:\nfree gathered A", []),
             ("hook", "pre-forward B:\nwait for gather B", []), ("compute", "forward B", []),
             ("hook", "post-forward B:\nkeep B gathered,\nbackward is next", []),
             ("hook", "pre-backward B\n(B's output grad):\nissue gather A", ["gather A"]),
             ("compute", "backward B", []),
             ("hook", "post-backward B:\nreduce-scatter B's\ngrads; free B", ["reduce-scatter B"]),
             ("hook", "pre-backward A:\nwait for gather A", []), ("compute", "backward A", []),
             ("hook", "post-backward A:\nreduce-scatter A's\ngrads; free A", ["reduce-scatter A"]),
             ("hook", "end of backward\n(queued callback):\nwait reductions", []),
             ("compute", "optimizer step\non own shards", [])]
    width = {"hook": 2.8, "compute": 2.4}
    boxes, phases, x = [("all-gather", 0.0, 2.8, "gather A:\nnothing to\nhide under")], [], 0.0
    for lane, text, issued in steps:
        phase = {"pre-forward A": "forward", "pre-backward B": "backward", "optimizer": "optimizer"}
        phases += [(x, name) for start, name in phase.items() if text.startswith(start)]
        boxes.append((lane, x, x + width[lane], text))
        x += width[lane]
        for collective in issued:
            boxes.append(("all-gather" if collective.startswith("gather") else "reduce-scatter", x, x + 2.4, collective))
    # two rows, forward above backward and the optimizer, so the text reads at a page's width
    backward_at = next(at for at, name in phases if name == "backward")
    span = max(backward_at, x - backward_at)
    fig_, axes = plt.subplots(2, 1, figsize=(11, 7.4))
    for ax, (lo, hi) in zip(axes, [(0.0, backward_at), (backward_at, x)]):
        for lane, a, b, text in boxes:
            if not lo <= a < hi:
                continue
            y = lanes[lane]
            ax.add_patch(FancyBboxPatch((a - lo + 0.05, y - 0.42), b - a - 0.1, 0.84,
                                        boxstyle="round,pad=0.0,rounding_size=0.1", facecolor=colours[lane],
                                        edgecolor="#555555", linewidth=0.6))
            ax.text((a + b) / 2 - lo, y, text, ha="center", va="center", fontsize=8.5,
                    color="black" if lane == "hook" else "white")
        for at, label in phases:
            if lo <= at < hi:
                ax.axvline(at - lo, color="#999999", linewidth=0.8, linestyle=":")
                ax.text(at - lo + 0.1, 3.5, label, fontsize=10, fontweight="bold", va="bottom")
        ax.set_yticks(list(lanes.values()))
        ax.set_yticklabels(["hooks\n(training thread)", "compute", "all-gather\n(async)", "reduce-scatter\n(async)"],
                           fontsize=9)
        ax.set_xlim(-0.2, span + 0.2)
        ax.set_ylim(-0.6, 4.0)
        ax.set_xticks([])
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
    axes[0].set_title("fsdp_impl's step with two units A and B, ZeRO-3 with prefetch:\nwhere each hook fires and "
                      "what it issues", fontsize=11)
    fig_.text(0.02, 0.01, "No broadcast after the optimizer step: each rank updates only its own shard, and the next "
              "forward's all-gather\ndelivers the new values to every rank.", fontsize=9, va="bottom")
    fig_.tight_layout(rect=(0, 0.05, 1, 1))
    fig_.savefig(fig.figure("fsdp-step"), dpi=110)
    plt.close(fig_)
    fig.commands["fsdp-step"] = ["python scripts/figures.py --only=architecture"]
    draw_sharding(fig.figure("sharding"))
    fig.commands["sharding"] = ["python scripts/figures.py --only=architecture"]


# ---- the time model: plan.py's predicted step against measured ones -------------------------------
# the validation grid's results (scripts/time_grid.py: bench.py --predict per group, in results/)


def time_model(fig):
    """The step plan.py predicts drawn under a profiled one of the same run (the traces' model,
    ZeRO-3, W=2), and the predicted against the measured steps of the validation grid."""
    model = TINY_TRACE_MODEL if fig.small else TRACE_MODEL
    settings = [f"--data_dir={fig.data_dir}", "--dist_backend=custom_fsdp", *model, "--wrap_policy=block",
                "--gradient_accumulation_steps=2", "--dtype=float32"]
    out, lanes = os.path.join(fig.work, "trace-predicted"), os.path.join(fig.work, "predicted.json")
    fig.run(["trace-predicted"], ["train.py", "--device=cpu", f"--out_dir={out}", *settings, "--max_iters=3",
                                  "--eval_iters=0", "--eval_interval=1000", "--keep_checkpoints=0", "--profile=True"],
            torchrun=2)
    plan = os.path.join(fig.work, "predicted-plan.json")
    fig.run(["trace-predicted"], ["plan.py", "--device=cpu", *settings, "--nproc=2", f"--lanes_json={lanes}",
                                  f"--json={plan}"])
    trace, png = os.path.join(out, "traces", "custom_fsdp", "rank0.json"), fig.figure("trace-predicted")
    overlap.draw([trace, lanes], png, step=2, title="custom_fsdp at W=2 on 2 CPU cores, ZeRO-3: a profiled step "
                                                    "(top) and plan.py's prediction of the same settings (bottom)")
    fig.commands["trace-predicted"].append(fig.shown(f"python overlap.py {shlex.join([trace, lanes])} "
                                                     f"--png={png} --step=2"))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        (profiled,) = [r["dt_ms"] for r in map(json.loads, f) if r.get("iter") == 2]
    with open(plan) as f:
        predicted = json.load(f)[0]["step_seconds"] * 1e3
    row = dict(model=model, profiled_step_ms=profiled, predicted_step_ms=predicted, unprofiled=unprofiled_row(settings))
    fig.save("time-model", [row], fig.commands["trace-predicted"])
    results = grid_results()
    if results:
        draw_time_model(results, fig.figure("time-model"))
        fig.commands["time-model"] = [r["command"] for r in results.values()]


def unprofiled_row(settings):
    """The validation grid's row of the traced settings, measured unprofiled, if the grid has one:
    {"group", "backend", "step_ms", "predicted_step_ms"}, else None."""
    for name, r in grid_results().items():
        given = set(r["command"].split())
        for backend, row in r["backends"].items():
            extra = [f"--{s}" for s in backend.split(":")[1:]]
            same = all(a in given or a in extra for a in settings  # (float32: bench.py's default on a CPU)
                       if not a.startswith(("--data_dir", "--dist_backend", "--dtype=float32")))
            if same and r["nproc"] == 2 and backend.split(":")[0] == "custom_fsdp" and not extra:
                return dict(group=name, backend=backend, step_ms=row["step_ms"], predicted_step_ms=row["predicted_step_ms"])
    return None


def grid_results():
    """{group: its results/cpu-grid-<group>.json, with "held_out"} for the grid's groups results/ holds."""
    import time_grid
    out = {}
    for name, (_, _, _, _, held_out) in time_grid.GRID.items():
        path = time_grid.path_of(name, os.path.join(HERE, "results"))
        if os.path.exists(path):
            with open(path) as f:
                out[name] = json.load(f) | {"held_out": held_out}
    return out


def draw_time_model(results, png):
    """Left: every setting, predicted against measured, on log axes, coloured by its group, the held-out
    groups hollow, with the 20% band around equality. Right: each setting's error, beside the spread of
    its own repeats (the measurement's noise), by group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 8), gridspec_kw={"width_ratios": [1, 1.1]})
    colours = plt.get_cmap("tab10").colors
    points, labels, errors, spreads, bar_colours = [], [], [], [], []
    for (name, r), colour in zip(results.items(), colours):
        rows = r["backends"]
        xs, ys = [row["step_ms"] for row in rows.values()], [row["predicted_step_ms"] for row in rows.values()]
        ax.scatter(xs, ys, color=colour if not r["held_out"] else "none", edgecolors=colour, marker="o", s=36,
                   label=f"{name}" + (" (held out)" if r["held_out"] else ""), zorder=3)
        points += xs + ys
        for row_name, row in rows.items():
            runs = r["step_ms_per_repeat"][row_name]
            labels.append(f"{name}: {row_name.replace('custom_fsdp:', 'custom_fsdp ').replace(':', ' ')}")
            errors.append(100 * (row["predicted_step_ms"] / row["step_ms"] - 1))
            spreads.append(100 * (max(runs) - min(runs)) / statistics.median(runs))
            bar_colours.append(colour)
    lo, hi = min(points) / 1.3, max(points) * 1.3
    ax.plot([lo, hi], [lo, hi], color="#444444", linewidth=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="#999999", alpha=0.2,
                    linewidth=0, label="within 20%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step, ms (bench.py: median of 3 repeats, unprofiled)", fontsize=8)
    ax.set_ylabel("predicted step, ms (plan.py's time model)", fontsize=8)
    ax.set_title("(a) predicted against measured; hollow: held out", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper left")
    y = list(range(len(labels)))[::-1]
    bars.barh(y, errors, color=bar_colours, height=0.7, label="error of the prediction")
    bars.scatter([s / 2 for s in spreads], y, marker="|", color="#222222", s=40, zorder=3,
                 label="half the spread of the repeats")
    bars.scatter([-s / 2 for s in spreads], y, marker="|", color="#222222", s=40, zorder=3)
    bars.axvline(0, color="#444444", linewidth=0.8)
    for edge in (-20, 20):
        bars.axvline(edge, color="#999999", linewidth=0.8, linestyle="--")
    bars.set_yticks(y)
    bars.set_yticklabels(labels, fontsize=6)
    bars.set_xlabel("% of the measured step (dashed: the 20% target)", fontsize=8)
    bars.set_title("(b) each setting's error, and its repeats' own spread", fontsize=9)
    bars.tick_params(axis="x", labelsize=7)
    bars.legend(fontsize=7, loc="lower right")
    first = next(iter(results.values()))
    fig.suptitle(f"plan.py's time model against bench.py on settings it was not fitted to: {first['device']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def render_time_model(result):
    """The scatter, a line per group (its largest error, its repeats' largest spread, which is the
    measurement's own noise, and the rank correlation), then the predicted step under a profiled one,
    with the profiled, predicted and unprofiled steps' lengths."""
    import bench
    lines = ["![time-model](figures/time-model.png)", "",
             "| group | held out | W | settings | largest error | largest spread of repeats | Spearman's rank correlation |",
             "|---|---|---:|---:|---:|---:|---:|"]
    results = grid_results()
    for name, r in results.items():
        rows = r["backends"]
        errors = [row["predicted_step_ms"] / row["step_ms"] - 1 for row in rows.values()]
        spread = max((max(v) - min(v)) / statistics.median(v) for v in r["step_ms_per_repeat"].values())
        rho = bench.spearman([row["predicted_step_ms"] for row in rows.values()],
                             [row["step_ms"] for row in rows.values()])
        lines.append(f"| [`{name}`](../results/cpu-grid-{name}.json) | {'yes' if r['held_out'] else 'no'} | {r['nproc']} "
                     f"| {len(rows)} | {max(errors, key=abs):+.1%} | {spread:.0%} | {rho:.2f} |")
    if results:
        r = next(iter(results.values()))
        lines += ["", f"{r['device']}, {r['torch']}, commit {r['commit']}; the commands are in "
                      "[commands.md](figures/commands.md#time-model).", ""]
    lines += ["![trace-predicted](figures/trace-predicted.png)", "",
              "Top, one profiled step of custom_fsdp at W=2 (the traces' model, ZeRO-3). Bottom, the step plan.py "
              "predicts for the same settings, its phases marked.",
              "With a core per rank, gloo's threads share the core the rank computes on: beside a collective, "
              "compute slows, and the collective runs slower than alone. Where compute waits for a gather, gloo has "
              "the core to itself."]
    (row,) = result["rows"]
    lines.append(f"The profiled step took {row['profiled_step_ms']:,.0f} ms; plan.py predicts "
                 f"{row['predicted_step_ms']:,.0f} ms.")
    same = row["unprofiled"]
    if same:
        lines.append(f"Unprofiled, the same settings took {same['step_ms']:,.0f} ms, the median of `bench.py`'s runs "
                     f"(the grid's `{same['group']}`, `{same['backend']}`), against {same['predicted_step_ms']:,.0f} ms "
                     "predicted.")
        lines.append(f"So this step ran {row['profiled_step_ms'] / same['step_ms']:.1f}x as long under the profiler. "
                     "A trace shows the order of events, not the unprofiled step's lengths.")
    else:
        lines.append("The scatter's measured steps are unprofiled.")
    return lines


RENDER = {"memory-by-w": render_memory_by_w, "comm-formula": render_comm_formula, "trace-figures": render_traces,
          "collectives": render_collectives, "step-time": render_step_time, "weak-scaling": render_weak_scaling,
          "time-model": render_time_model, "unit-sizes": render_unit_sizes, "snapshots": render_snapshots,
          "correctness": render_correctness}
SOURCES = {"memory-by-w": "memory-by-w", "comm-formula": "memory-by-w", "trace-figures": "traces",
           "collectives": "collectives", "step-time": os.path.join("..", STEP_TIME), "weak-scaling": "weak-scaling",
           "time-model": "time-model", "unit-sizes": "unit-sizes", "snapshots": "memory-by-w",
           "correctness": "correctness"}


def render(doc, results_dir, missing_ok=False):
    """Fill each `<!-- figures.py: NAME -->` block of `doc` from results_dir/NAME.json (with
    missing_ok, a block whose JSON is not there is left as it is)."""
    with open(doc) as f:
        text = f.read()
    for block, source in SOURCES.items():
        begin = BLOCK_BEGIN.format(block)
        if begin not in text:
            continue
        if source is None:
            result = None
        else:
            path = os.path.join(results_dir, f"{source}.json")
            if not os.path.exists(path):
                if missing_ok:
                    continue
                raise SystemExit(f"error: {path} is missing: run python scripts/figures.py first")
            with open(path) as f:
                result = json.load(f)
        start = text.index(begin) + len(begin)
        end = text.index(BLOCK_END, start)
        text = text[:start] + "\n" + "\n".join(RENDER[block](result)) + "\n" + text[end:]
    with open(doc, "w") as f:
        f.write(text)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="each kind of figure once, on tiny models")
    p.add_argument("--render", action="store_true", help="only fill the tables, from the results' JSON")
    p.add_argument("--only", default="", help="these parts alone, comma-separated: architecture, memory, "
                                              "traces, collectives, correctness, step_time, weak_scaling, unit_sizes, time_model")
    p.add_argument("--figures_dir", default=os.path.join(HERE, "docs", "figures"))
    p.add_argument("--results_dir", default=os.path.join(HERE, "results", "learn"),
                   help="the tables' JSON (not results/*.json, which IMPLEMENTATION.md renders)")
    p.add_argument("--doc", default=os.path.join(HERE, "docs", "LEARN.md"), help="the page whose tables are filled")
    p.add_argument("--data_dir", default=os.path.join(HERE, "data", "shakespeare_char"),
                   help="train.py's data for the traces (its prepare.py writes it)")
    args = p.parse_args()
    args.figures_dir, args.results_dir, args.doc, args.data_dir = map(
        os.path.abspath, (args.figures_dir, args.results_dir, args.doc, args.data_dir))
    os.chdir(HERE)  # (the config files' paths, as in the commands logged)
    inside = [os.path.relpath(path) if path.startswith(HERE + os.sep) else path for path in (
        args.figures_dir, args.results_dir, args.data_dir)]
    args.figures_dir, args.results_dir, args.data_dir = inside  # (as the commands recorded show them)
    if not args.render:
        if not os.path.exists(os.path.join(args.data_dir, "train.bin")):
            p.error(f"--data_dir={args.data_dir} has no train.bin: run python data/shakespeare_char/prepare.py")
        fig = Figures(args.figures_dir, args.results_dir, args.small, args.data_dir)
        try:
            parts = (architecture, memory, traces, collectives, correctness, time_model) if args.small else (
                architecture, memory, traces, collectives, correctness, step_time, weak_scaling, unit_sizes, time_model)
            for part in [p for p in parts if not args.only or p.__name__ in args.only.split(",")]:
                started = time.time()
                print(f"{part.__name__} ...", end=" ", flush=True)
                part(fig)
                print(f"{time.time() - started:.0f} s", flush=True)
        finally:
            shutil.rmtree(fig.work)
        fig.write_commands()
    render(args.doc, args.results_dir, missing_ok=args.small)
    print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
