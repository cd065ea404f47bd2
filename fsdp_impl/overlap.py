"""
How much communication a profiler trace hid under compute, step by step, for any backend.

    python -m fsdp_impl.overlap out/traces/custom_fsdp/rank0.json [more traces ...]

Communication: collective events (gloo's worker-thread ranges on CPU, NCCL kernels on GPU).
Compute: GPU kernels that are not NCCL's; on CPU, the time the training thread (the one that
runs ProfilerStep#N) spends in operators, minus the ranges where it blocks on a collective: any
range named like a wait, a c10d call, or FSDP2's all-gather / reduce ranges (an autograd node
that encloses a blocking hook would otherwise count as compute).
Per step: the union of each, their intersection (hidden), and what stayed exposed.
"""
import json
import sys

COMM_MARKS = ("gloo:", "nccl:", "ncclKernel", "ncclDevKernel")
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


def analyse(trace):
    """Per-step {'step', 'comm_ms', 'compute_ms', 'hidden_ms', 'exposed_ms', 'hidden_fraction'}."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    main_tid = steps[0]["tid"] if steps else None
    on_gpu = any(e.get("cat") == "kernel" for e in events)
    comm = [_span(e) for e in events if any(mark in e["name"] for mark in COMM_MARKS)]
    if on_gpu:
        compute = _union(_span(e) for e in events
                         if e.get("cat") == "kernel" and not any(m in e["name"] for m in COMM_MARKS))
    else:
        on_main = [e for e in events if e["tid"] == main_tid]
        busy = _union(_span(e) for e in on_main if e.get("cat") == "cpu_op")
        blocked = _union(_span(e) for e in on_main if any(b in e["name"] for b in BLOCKING))
        compute = _subtract(busy, blocked)
    rows = []
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        c, k = _union(_clip(comm, lo, hi)), _clip(compute, lo, hi)
        comm_us, hidden_us = _length(c), _length(_intersection(c, k))
        rows.append({"step": step["name"], "step_ms": step["dur"] / 1e3, "comm_ms": comm_us / 1e3,
                     "compute_ms": _length(k) / 1e3, "hidden_ms": hidden_us / 1e3,
                     "exposed_ms": (comm_us - hidden_us) / 1e3,
                     "hidden_fraction": hidden_us / comm_us if comm_us else None})
    return rows


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
        raise SystemExit("usage: python -m fsdp_impl.overlap TRACE [TRACE ...]   (--profile=True writes them)")
    for path in sys.argv[1:]:
        rows = analyse(load(path))
        print(path)
        for r in rows:
            frac = "-" if r["hidden_fraction"] is None else f"{r['hidden_fraction']:.0%}"
            print(f"  {r['step']:>16}: step {r['step_ms']:8.1f} ms, comm {r['comm_ms']:7.1f} ms, "
                  f"compute {r['compute_ms']:7.1f} ms, hidden {frac:>4}, exposed {r['exposed_ms']:7.1f} ms")
