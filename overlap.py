"""
How much communication a profiler trace hid under compute, step by step, for any backend.

    python overlap.py out/traces/custom_fsdp/rank0.json [more traces ...]

Communication: on CPU, collective events (gloo's worker-thread ranges); on GPU, NCCL kernels, copies between CPU and GPU memory (CPU
offload's traffic, and the batch's few bytes) and every kernel off the compute stream (the stream
with the most kernel time), such as the casts FSDP2 runs on its copy-in stream. Compute: the
compute stream's other kernels; on CPU, the time the training thread (the one that runs
ProfilerStep#N) spends in operators, minus the ranges
where it blocks on a collective: any range named like a wait, a c10d call, or FSDP2's all-gather
/ reduce ranges (an autograd node that encloses a blocking hook would otherwise count as compute).
Per step: the union of each, their intersection (hidden), and what stayed exposed. Then where the
exposed time went: on CPU the innermost range the training thread was in (mostly the wait that
blocked it: which unit's all-gather or reduce-scatter to look at), on GPU the communication kernel.

    python overlap.py TRACE [TRACE ...] --png=lanes.png [--step=N]

draws the profiled steps (or step N alone) as lanes, one group per trace (ranks, or backends) on one time axis from
each trace's first step: compute, the all-gathers, the reduce-scatters and all-reduces, each
collective labelled with the unit whose range issued it, and the exposed time shaded. A file that
plan.py --lanes_json wrote draws beside them as the step the time model predicts, its phases marked.
"""
import json
import os

import configurator

COMM_MARKS = ("gloo:", "nccl:", "ncclKernel", "ncclDevKernel")
TOP_PLACES = 3  # how many places of exposed communication are listed (here and in bench.py)
BLOCKING = ("wait", "c10d::", "FSDP::all_gather", "FSDP::post_backward_reduce")
PHASE_RANGE = "phase: "  # train.py's ranges from one mark of the step to the next (observe.Observer.mark)


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _span(e):
    return e["ts"], e["ts"] + e["dur"]


def _subtract(a, b):
    """Parts of the (merged, sorted) intervals a not covered by the (merged, sorted) b."""
    out = []
    for start, end in a:
        for bs, be in b:
            if be <= start or bs >= end:
                continue
            if bs > start:
                out.append([start, bs])
            start = max(start, be)
        if start < end:
            out.append([start, end])
    return out


def _length(intervals):
    return sum(end - start for start, end in intervals)


def _intersection(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _clip(intervals, lo, hi):
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def _stream(kernel):
    return kernel.get("args", {}).get("stream", kernel["tid"])


def _is_comm(e):
    return any(mark in e["name"] for mark in COMM_MARKS)


def _events_and_steps(trace):
    """The trace's complete events, and its ProfilerStep ranges in time order (on GPU the profiler
    repeats each range on the GPU's timeline, as a gpu_user_annotation: the host's are taken)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    return events, sorted((e for e in events if e["name"].startswith("ProfilerStep#")
                           and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])


def _timelines(trace):
    """(steps, the events exposed communication is attributed to, communication, compute); the
    last two as merged intervals."""
    events, steps = _events_and_steps(trace)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:  # GPU
        busy = {}
        for e in kernels:
            busy[_stream(e)] = busy.get(_stream(e), 0) + e["dur"]
        compute_stream = max(busy, key=busy.get)
        copies = [e for e in events if e.get("cat") == "gpu_memcpy" and ("HtoD" in e["name"] or "DtoH" in e["name"])]
        comm = [e for e in kernels if _is_comm(e) or _stream(e) != compute_stream] + copies
        compute = _union(_span(e) for e in kernels if not _is_comm(e) and _stream(e) == compute_stream)
        return steps, comm, _union(map(_span, comm)), compute
    comm = [e for e in events if _is_comm(e)]
    on_main = [e for e in events if steps and e["tid"] == steps[0]["tid"]]  # the training thread
    busy = _union(_span(e) for e in on_main if e.get("cat") == "cpu_op")
    blocked = _union(_span(e) for e in on_main if any(b in e["name"] for b in BLOCKING))
    ranges = [e for e in on_main if not e["name"].startswith(("ProfilerStep#", PHASE_RANGE))]
    return steps, ranges, _union(map(_span, comm)), _subtract(busy, blocked)


def analyse(trace):
    """Per-step {'step', 'comm_ms', 'compute_ms', 'hidden_ms', 'exposed_ms', 'hidden_fraction'}."""
    steps, _, comm, compute = _timelines(trace)
    rows = []
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        c, k = _clip(comm, lo, hi), _clip(compute, lo, hi)
        comm_us, hidden_us = _length(c), _length(_intersection(c, k))
        rows.append({"step": step["name"], "step_ms": step["dur"] / 1e3, "comm_ms": comm_us / 1e3,
                     "compute_ms": _length(k) / 1e3, "hidden_ms": hidden_us / 1e3,
                     "exposed_ms": (comm_us - hidden_us) / 1e3,
                     "hidden_fraction": hidden_us / comm_us if comm_us else None})
    return rows


OUTSIDE = "(outside any range)"


def exposed_by_place(trace, top=None):
    """{where: exposed ms per step}, largest first: each exposed stretch goes to the innermost event
    covering it (on CPU, the training thread's ranges; on GPU, the communication kernels). With
    `top`, the `top` largest, then the rest summed ("N other places"), so that they add up to the
    exposed time."""
    steps, places, comm, compute = _timelines(trace)
    totals = {}
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        in_step = [e for e in places if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        for start, end in _subtract(_clip(comm, lo, hi), _clip(compute, lo, hi)):
            inside = [e for e in in_step if e["ts"] < end and e["ts"] + e["dur"] > start]
            cuts = sorted({start, end} | {t for e in inside for t in _span(e) if start < t < end})
            for a, b in zip(cuts, cuts[1:]):
                cover = [e for e in inside if e["ts"] <= a and e["ts"] + e["dur"] >= b]
                name = min(cover, key=lambda e: e["dur"])["name"] if cover else OUTSIDE
                totals[name] = totals.get(name, 0.0) + (b - a) / 1e3 / len(steps)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    if top is not None and len(ranked) > top:
        others = len(ranked) - top
        ranked[top:] = [(f"{others} other place" + "s" * (others > 1), sum(ms for _, ms in ranked[top:]))]
    return dict(ranked)


def summarize(rows):
    """Means over steps of the per-step figures."""
    keys = ("step_ms", "comm_ms", "compute_ms", "hidden_ms", "exposed_ms")
    out = {k: sum(r[k] for r in rows) / len(rows) for k in keys} if rows else {}
    if rows and out["comm_ms"]:
        out["hidden_fraction"] = out["hidden_ms"] / out["comm_ms"]
    return out


LANES = ("compute", "all-gather", "reduce-scatter / all-reduce")
KIND_LANE = {"all_gather": 1, "allgather": 1, "reduce_scatter": 2, "all_reduce": 2, "allreduce": 2}


def lane_of(name):
    """The lane of a collective, from its name (gloo's, NCCL's kernels, c10d's ops), or None. On
    gloo a reduce-scatter runs as an all-reduce, which is why the two share a lane."""
    flat = name.lower().replace("_", "")
    return next((lane for kind, lane in KIND_LANE.items() if kind.replace("_", "") in flat), None)


def unit_of(name):
    """The unit a range names: fsdp_impl's "fsdp::all_gather transformer.h.3" and FSDP2's
    "FSDP::all_gather (transformer.h.3)" give "h.3"."""
    rest = name.split("::", 1)[-1].split(" ", 1)
    return rest[1].strip("()").removeprefix("transformer.") if len(rest) > 1 else ""


def lanes(trace, step=None):
    """(steps as (start, end) in ms from the first step's start, {lane: [(start, end, label)]},
    exposed intervals as (start, end)); with `step`, only ProfilerStep#<step>, from its start. Collectives of one lane run in the order the training
    thread issued them (its c10d ops), so the k-th in a lane is labelled with the unit of the
    innermost FSDP range around the k-th c10d op of that lane. No range: no label (DDP's reducer,
    the loss's all-reduce)."""
    steps, _, comm, compute = _timelines(trace)
    out = {lane: [] for lane in LANES}
    if not steps:
        return [], out, []
    t0, main = steps[0]["ts"], steps[0]["tid"]
    events = _events_and_steps(trace)[0]
    on_main = [e for e in events if e["tid"] == main]
    ranges = [e for e in on_main if e.get("cat") == "user_annotation" and "::" in e["name"]]
    issued = {lane: [] for lane in (1, 2)}
    for op in sorted((e for e in on_main if e["name"].startswith("c10d::") and lane_of(e["name"])), key=lambda e: e["ts"]):
        around = [r for r in ranges if r["ts"] <= op["ts"] and r["ts"] + r["dur"] >= op["ts"] + op["dur"]]
        issued[lane_of(op["name"])].append(unit_of(min(around, key=lambda r: r["dur"])["name"]) if around else "")
    moved = [e for e in events if lane_of(e["name"]) and (e["name"].startswith("gloo:") or e.get("cat") == "kernel")]
    for e in sorted(moved, key=lambda e: e["ts"]):
        lane = lane_of(e["name"])
        label = issued[lane].pop(0) if issued[lane] else ""
        out[LANES[lane]].append(((e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3, label))
    out["compute"] = [((a - t0) / 1e3, (b - t0) / 1e3, "") for a, b in compute]
    spans = [((s["ts"] - t0) / 1e3, (s["ts"] + s["dur"] - t0) / 1e3) for s in steps]
    exposed = [((a - t0) / 1e3, (b - t0) / 1e3) for a, b in _subtract(comm, compute)]
    if step is not None:
        (lo, hi), = [span for s, span in zip(steps, spans) if s["name"] == f"ProfilerStep#{step}"] or [(None, None)]
        if lo is None:
            configurator.fail(f"the trace has no ProfilerStep#{step}; it has " + ", ".join(s["name"] for s in steps))
        out = {lane: [(a - lo, b - lo, label) for a, b, label in bars if lo <= a < hi] for lane, bars in out.items()}
        spans, exposed = [(0.0, hi - lo)], [(a - lo, min(b, hi) - lo) for a, b in exposed if lo <= a < hi]
    return spans, out, exposed


def phases(trace, step=None):
    """[(ms, phase)]: where each of the step's phases begins ("forward 0", "backward 0", "clip",
    "optimizer", "zero_grad": train.py's phase ranges), in ms from the first profiled step's start,
    or with `step` from that step's. On a GPU the ranges' copies on the GPU's timeline, where there."""
    events, steps = _events_and_steps(trace)
    if step is not None:
        steps = [s for s in steps if s["name"] == f"ProfilerStep#{step}"]
    if not steps:
        return []
    marked = [e for e in events if e["name"].startswith(PHASE_RANGE)]
    on_gpu = [e for e in marked if e.get("cat") == "gpu_user_annotation"]
    t0, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    return [((e["ts"] - t0) / 1e3, e["name"].removeprefix(PHASE_RANGE)) for e in sorted(on_gpu or marked, key=lambda e: e["ts"])
            if t0 <= e["ts"] < hi]


def group_name(path, data):
    """A profiled trace's name in a figure: the backend (the folder train.py writes it to) and the rank."""
    rank = data.get("distributedInfo", {}).get("rank")
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{os.path.basename(os.path.dirname(path))}, " + (f"rank {rank}" if rank is not None else stem)


def groups(path, step=None, name=None):
    """[(name, (steps, {lane: bars}, exposed, phases))]: the lanes a file draws. A profiled trace
    gives one group; plan.py --lanes_json gives a group per row it timed. `name` replaces the
    group's own name (a file's backend and rank)."""
    data = load(path)
    if "predicted_lanes" in data:
        return [(name or f"{p['backend']} W={p['nproc']} rank {p['rank']}, predicted",
                 ([(0.0, p["step_ms"])], {lane: [tuple(b) for b in p["lanes"][lane]] for lane in LANES},
                  [tuple(e) for e in p["exposed"]], p["phases"])) for p in data["predicted_lanes"]]
    return [(name or group_name(path, data) + ", profiled", lanes(data, step) + (phases(data, step),))]


def draw(paths, png, step=None, title=None, names=None):
    """The lanes of each file in `paths` (profiled traces, plan.py's predicted steps), one group
    under another, each under its name (`names`, else the file's), on one time axis, into `png`
    (with `step`: that profiled step alone; a list: each file's own). Phases start at the grey lines;
    a legend says the rest."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    colours = {"compute": "#4c72b0", "all-gather": "#55a868", "reduce-scatter / all-reduce": "#dd8452"}
    steps_of = list(step) if isinstance(step, (list, tuple)) else [step] * len(paths)
    drawn = [group for i, path in enumerate(paths) for group in groups(path, steps_of[i], names[i] if names else None)]
    end = max([steps[-1][1] for _, (steps, _, _, _) in drawn if steps]
              + [b for _, (_, by_lane, _, _) in drawn for bars in by_lane.values() for _, b, _ in bars] or [1.0])
    height = len(LANES) + 1.6  # (a group's lanes, its name and phases above them, a gap)
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.45 * height * len(drawn)))
    ticks = []
    for g, (name, (steps, by_lane, exposed, phases)) in enumerate(drawn):
        top = (len(drawn) - g) * height - 1.6  # (the group's first lane)
        for a, b in exposed:
            ax.fill_between([a, b], top - len(LANES) + 0.5, top + 0.5, color="#e41a1c", alpha=0.2, linewidth=0)
        for a, b in steps:
            ax.vlines([a, b], top - len(LANES) + 0.5, top + 0.5, color="#444444", linewidth=0.8, linestyles=":")
        for i, (at, phase) in enumerate(phases):
            ax.vlines(at, top - len(LANES) + 0.5, top + 0.6, color="#888888", linewidth=0.6)
            following = phases[i + 1][0] if i + 1 < len(phases) else end
            if following - at > end * 0.0065 * len(phase):  # (where the name fits)
                ax.text(at + end * 0.002, top + 0.62, phase, ha="left", va="bottom", fontsize=6.5, color="#444444")
        ax.text(0, top + 1.15, name, ha="left", va="bottom", fontsize=8.5, fontweight="bold")
        for i, lane in enumerate(LANES):
            y = top - i
            bars = by_lane[lane]
            ax.broken_barh([(a, b - a) for a, b, _ in bars], (y - 0.35, 0.7), color=colours[lane], linewidth=0)
            for a, b, label in bars:
                if label and b - a > end * 0.009 * len(label):  # (where the label fits)
                    ax.text((a + b) / 2, y, label, ha="center", va="center", fontsize=6, color="white")
            ticks.append((y, lane))
    ax.set_yticks([y for y, _ in ticks])
    ax.set_yticklabels([label for _, label in ticks], fontsize=7)
    ax.set_ylim(0.3, len(drawn) * height)
    ax.set_xlim(0, end * 1.005)
    start = (f"ProfilerStep#{step}'s start" if isinstance(step, int) else "each drawn step's start" if step is not None
             else "each trace's first profiled step")
    ax.set_xlabel(f"ms from {start}; labels on bars: the unit (transformer block) a collective serves", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    handles = [Patch(color=c, label=lane) for lane, c in colours.items()] + [
        Patch(color="#e41a1c", alpha=0.2, label="communication no compute hid (the training thread waits)"),
        Line2D([], [], color="#888888", linewidth=0.6, label="a phase begins (forward k, backward k: micro-step k)"),
        Line2D([], [], color="#444444", linewidth=0.8, linestyle=":", label="step boundary")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.09 - 0.3 / fig.get_figheight()),
              ncol=3, fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def load(path):
    """The trace in file `path`, or an exit with one line saying why it cannot be read."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except OSError as e:
        configurator.fail(f"cannot read {path}: {e.strerror}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        configurator.fail(f"{path} is not JSON: {e}")
    if not isinstance(trace, dict) or "traceEvents" not in trace and "predicted_lanes" not in trace:
        configurator.fail(f"{path} is not a profiler trace (no traceEvents) nor plan.py's --lanes_json")
    return trace


if __name__ == "__main__":
    parser = configurator.ArgumentParser(description=__doc__)
    parser.add_argument("paths", nargs="+", metavar="TRACE",
                        help="profiler traces (train.py --profile=True writes them), or plan.py --lanes_json files")
    parser.add_argument("--png", metavar="PATH", default=None, help="draw the profiled steps as lanes into PATH")
    parser.add_argument("--step", metavar="N", type=int, default=None,
                        help="with --png: draw ProfilerStep#N alone (default: every profiled step)")
    args = parser.parse_args()
    if args.step is not None and (args.png is None or args.step < 0):
        parser.error(f"--step={args.step}: a profiled step's number, with --png")
    if args.png is not None:
        draw(args.paths, args.png, args.step)
    for path in args.paths:
        trace = load(path)
        for p in trace.get("predicted_lanes", ()):
            print(f"{path}: {p['backend']} W={p['nproc']} rank {p['rank']}, predicted on {p['device']}: "
                  f"step {p['step_ms']:8.1f} ms, exposed {sum(b - a for a, b in p['exposed']):7.1f} ms")
        if "predicted_lanes" in trace:
            continue
        rows = analyse(trace)
        print(path)
        for r in rows:
            frac = "-" if r["hidden_fraction"] is None else f"{r['hidden_fraction']:.0%}"
            print(f"  {r['step']:>16}: step {r['step_ms']:8.1f} ms, comm {r['comm_ms']:7.1f} ms, "
                  f"compute {r['compute_ms']:7.1f} ms, hidden {frac:>4}, exposed {r['exposed_ms']:7.1f} ms")
        print("  exposed ms per step, by where it went:")
        for name, ms in exposed_by_place(trace, TOP_PLACES).items() or [("nothing exposed", 0.0)]:
            print(f"    {ms:7.2f}  {name}")
