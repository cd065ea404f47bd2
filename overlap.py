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
"""
import json
import sys

COMM_MARKS = ("gloo:", "nccl:", "ncclKernel", "ncclDevKernel")
TOP_PLACES = 3  # how many places of exposed communication are listed (here and in bench.py)
BLOCKING = ("wait", "c10d::", "FSDP::all_gather", "FSDP::post_backward_reduce")


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


def _timelines(trace):
    """(steps, the events exposed communication is attributed to, communication, compute); the
    last two as merged intervals."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    # (on GPU the profiler repeats each range on the GPU's timeline, as a gpu_user_annotation)
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")
                    and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])
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
    ranges = [e for e in on_main if not e["name"].startswith("ProfilerStep#")]
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


def load(path):
    """The trace in file `path`, or an exit with one line saying why it cannot be read."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except OSError as e:
        raise SystemExit(f"error: cannot read {path}: {e.strerror}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {path} is not JSON: {e}")
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise SystemExit(f"error: {path} is not a profiler trace (no traceEvents)")
    return trace


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python overlap.py TRACE [TRACE ...]   (--profile=True writes them)")
    for path in sys.argv[1:]:
        trace = load(path)
        rows = analyse(trace)
        print(path)
        for r in rows:
            frac = "-" if r["hidden_fraction"] is None else f"{r['hidden_fraction']:.0%}"
            print(f"  {r['step']:>16}: step {r['step_ms']:8.1f} ms, comm {r['comm_ms']:7.1f} ms, "
                  f"compute {r['compute_ms']:7.1f} ms, hidden {frac:>4}, exposed {r['exposed_ms']:7.1f} ms")
        print("  exposed ms per step, by where it went:")
        for name, ms in exposed_by_place(trace, TOP_PLACES).items() or [("nothing exposed", 0.0)]:
            print(f"    {ms:7.2f}  {name}")
