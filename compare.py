"""
Compare training runs from their metrics.jsonl logs.

    python compare.py out-a out-b [out-c ...] [--out compare.png]

Plots train and val loss against iteration, one curve per run, and prints a
table: final losses, the largest loss gap to the first run (over iterations both
logged), tokens/s at the median step time (the first steps, warm-up, left out, as in
bench.py) and peak memory. The overall max gap between any two
runs is printed last: for runs that should be numerically equivalent (e.g. two
parallelism backends from the same seed) it should be ~0.
"""
import math
import os
import statistics
import sys

import configurator
import metrics

WARMUP_STEPS = 2  # a run's first steps (compilation, first allocations): left out of its medians (bench.py too)


def load_metrics(path):
    """Read a run dir (or a metrics.jsonl path) -> (train_rows, eval_rows), each in iter order, one
    row per iter: after a resume, the resumed attempt's."""
    run = metrics.read(path)
    return _as_resumed(run.steps), _as_resumed(run.evals)


def _as_resumed(rows):
    """Rows in file order -> the run's history: a row whose iter is not past the one before it
    starts a resumed attempt, which replaces everything logged from that iter on."""
    history = []
    for row in rows:
        while history and history[-1]["iter"] >= row["iter"]:
            history.pop()
        history.append(row)
    return history


def _by_iter(rows, key):
    return {r["iter"]: float(r[key]) for r in rows if r.get(key) is not None}


def max_loss_diff(rows_a, rows_b, key="loss"):
    """Largest |a - b| over iterations present in both; None if they share none."""
    a, b = _by_iter(rows_a, key), _by_iter(rows_b, key)
    common = sorted(set(a) & set(b))
    if not common:
        return None
    # the same non-finite value in both (a step both skipped as nan) is no difference
    diffs = [0.0 if a[i] == b[i] or math.isnan(a[i]) and math.isnan(b[i]) else abs(a[i] - b[i]) for i in common]
    # a NaN anywhere else means the runs diverged; don't let max() silently drop it
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)


def median_step_tokens_per_sec(rows):
    """Tokens/s at the median step time (a median of tokens/s would invert a mean of the middle two)."""
    if not rows:
        return None
    tokens = rows[0]["tokens_per_sec"] * rows[0]["dt_ms"] / 1000  # per step
    return tokens / (statistics.median(r["dt_ms"] for r in rows) / 1000)


def summarize(runs):
    """runs: list of (name, train_rows, eval_rows); the first is the reference. -> list of dicts."""
    ref_train = runs[0][1] if runs else []
    out = []
    for name, train, evals in runs:
        timed = [r for r in train if r.get("dt_ms") and r.get("tokens_per_sec") is not None][WARMUP_STEPS:]
        mem = [r["peak_mem_mb"] for r in train if r.get("peak_mem_mb") is not None]
        out.append({
            "run": name,
            "final_train_loss": train[-1]["loss"] if train else None,
            "final_val_loss": evals[-1]["val_loss"] if evals else None,
            "max_diff_vs_first": max_loss_diff(ref_train, train),
            "median_tokens_per_sec": median_step_tokens_per_sec(timed),
            "peak_mem_mb": max(mem) if mem else None,
        })
    return out


def overall_max_diff(runs):
    """Largest train-loss gap between any pair of runs -> (diff, name_a, name_b), or (None, None, None)."""
    best = (None, None, None)
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            d = max_loss_diff(runs[i][1], runs[j][1])
            if d is None:
                continue
            if best[0] is None or (not math.isnan(best[0]) and (math.isnan(d) or d > best[0])):  # (first NaN stays)
                best = (d, runs[i][0], runs[j][0])
    return best


def format_table(summary):
    cols = [("run", "run", "{}"),
            ("final_train_loss", "train loss", "{:.4f}"),
            ("final_val_loss", "val loss", "{:.4f}"),
            ("max_diff_vs_first", "max |dloss| vs first", "{:.6g}"),
            ("median_tokens_per_sec", "median tok/s", "{:,.0f}"),
            ("peak_mem_mb", "peak mem MB", "{:,.1f}")]
    rows = [[h for _, h, _ in cols]]
    for s in summary:
        rows.append(["-" if s[k] is None else fmt.format(s[k]) for k, _, fmt in cols])
    widths = [max(len(r[c]) for r in rows) for c in range(len(cols))]
    lines = []
    for n, r in enumerate(rows):
        # run names left-aligned, numbers right-aligned
        cells = [r[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(runs, out_path):
    import matplotlib
    matplotlib.use("Agg")  # headless: no display on training machines
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, train, evals in runs:
        if train:
            ax_t.plot([r["iter"] for r in train], [r["loss"] for r in train], label=name, linewidth=1)
        if evals:
            ax_v.plot([r["iter"] for r in evals], [r["val_loss"] for r in evals], label=name, marker="o", markersize=3)
    for ax, title in ((ax_t, "train loss"), (ax_v, "val loss")):
        ax.set_title(title)
        ax.set_xlabel("iter")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def run_names(dirs):
    # label by dir name; fall back to the path as given when two dirs share a name
    names = [os.path.basename(os.path.normpath(d)) for d in dirs]
    return [n if names.count(n) == 1 else d for n, d in zip(names, dirs)]


def main(argv=None):
    ap = configurator.ArgumentParser(description=__doc__)
    ap.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="run directories holding metrics.jsonl")
    ap.add_argument("--out", default="compare.png", help="where to write the plot, as .png, .svg, .pdf, ...")
    args = ap.parse_args(argv)
    from matplotlib.backend_bases import FigureCanvasBase
    if os.path.splitext(args.out)[1][1:].lower() not in FigureCanvasBase.get_supported_filetypes():
        ap.error(f"--out {args.out}: name a picture file (.png, .svg, .pdf, ...)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"--out {args.out}: its folder does not exist")

    runs = []
    for d, name in zip(args.out_dirs, run_names(args.out_dirs)):
        try:
            train, evals = load_metrics(d)
        except FileNotFoundError as e:
            configurator.fail(str(e))
        runs.append((name, train, evals))

    print(format_table(summarize(runs)))
    diff, a, b = overall_max_diff(runs)
    if len(runs) < 2:
        print("max loss difference between runs: - (only one run)")
    elif diff is None:
        print("max loss difference between runs: - (no common iters)")
    else:
        print(f"max loss difference between runs: {diff:.6g} ({a} vs {b})")

    plot(runs, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
