"""
plan.py's pictures: the peak per rank against W (--png), and each run's memory through the step,
stacked by role, with its collectives (--timeline).
"""
from .counting import ROLES
from .step import meta_model


def draw(rows, settings, path):
    """Each backend's per-rank peak against W (log scales, W from 1 to 1024), beside ZeRO's 16 bytes
    per parameter over W: what sharding divides, and what it leaves (activations, gathered units)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    params = sum(p.numel() for p in meta_model(settings).parameters())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        points = sorted((r["nproc"], r["peak_allocated_bytes"] / 2**30) for r in rows if r["backend"] == backend)
        ax.plot(*zip(*points), marker="o", label=f"{backend}: peak per rank")
    worlds = [2**i for i in range(11)]
    ax.plot(worlds, [16 * params / w / 2**30 for w in worlds], "k--", label="16 bytes/param / W (ZeRO-3 state)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(1, 1024)
    ax.set_xlabel("world size W")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{params / 1e9:.2f}B parameters, batch {settings['batch_size']} x {settings['block_size']}, "
                 f"{settings['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


ROLE_COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
                "gathered_parameters": "#8172b3", "communication": "#c44e52", "activations": "#ccb974", "other": "#999999"}
EVENT_MARKS = {"all_gather": ("v", "#1f77b4", "all-gather"), "reduce_scatter": ("^", "#d62728", "reduce-scatter"),
               "all_reduce": ("D", "#ff7f0e", "all-reduce"), "gathered_freed": ("|", "#555555", "gathered freed")}


def draw_timelines(timelines, settings, path):
    """One panel per planned run: a rank's allocated bytes over two training steps, event by event,
    stacked by role; under it each collective and each free of gathered parameters, at the event
    where the step issues it; phases as dotted lines; the peak and its moment labelled. The panels
    share the y-axis, so backends and world sizes compare at a glance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    top = max(t["peak_allocated_bytes"] for t in timelines)
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    top /= scale
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 2.4 * len(timelines) + 0.9), sharey=True, squeeze=False)
    for ax, t in zip(axes[:, 0], timelines):
        x = [row[0] for row in t["stacked"]]
        layers = [[row[1 + i] / scale for row in t["stacked"]] for i in range(len(t["roles"]))]
        ax.stackplot(x, layers, colors=[ROLE_COLOURS[r] for r in t["roles"]], step="post", linewidth=0)
        events = [(index, kind) for index, kind, _ in t["collectives"]] + [(i, "gathered_freed") for i, _ in t["gathered_freed"]]
        for kind, (marker, colour, _) in EVENT_MARKS.items():
            at = [index for index, k in events if k == kind]
            y = -top * (0.05 if kind == "gathered_freed" else 0.11)
            ax.plot(at, [y] * len(at), marker, color=colour, markersize=4, linestyle="none", clip_on=False)
        for index, where in t["marks"]:
            ax.axvline(index, color="#bbbbbb", linewidth=0.5, linestyle=":")
        ticks = [(index, where) for index, where in t["marks"] if where.endswith("forward 0") or where.endswith("clip")]
        ax.set_xticks([index for index, _ in ticks])
        ax.set_xticklabels([where.replace("step ", "step ").replace(" forward 0", ": forward").replace(" clip", ": clip")
                            for _, where in ticks], fontsize=7)
        ax.annotate(f"peak {t['peak_allocated_bytes'] / scale:,.2f} {unit}: {t['peak_at']}",
                    (t["peak_event"], t["peak_allocated_bytes"] / scale), xytext=(0.01, 0.95), textcoords="axes fraction",
                    fontsize=7, va="top", arrowprops=dict(arrowstyle="->", color="k", linewidth=0.6))
        ax.set_title(f"{t['backend']}, W={t['nproc']}, rank {t['rank']}", fontsize=9, loc="right")
        ax.set_xlim(0, t["events"])
        ax.set_ylim(-top * 0.15, top * 1.1)
        ax.set_ylabel(f"{unit} allocated", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    handles = [Patch(color=ROLE_COLOURS[r], label=r.replace("_", " ")) for r in ROLES] + [
        Line2D([], [], marker=m, color=c, linestyle="none", markersize=5, label=label) for m, c, label in EVENT_MARKS.values()]
    fig.legend(handles=handles, loc="upper center", ncol=6, fontsize=7, frameon=False)
    axes[-1, 0].set_xlabel("allocation events in the order the step makes them: two training steps", fontsize=8)
    fig.text(0.01, 0.995, f"batch {settings['batch_size']} x {settings['block_size']}, {settings['dtype']}",
             fontsize=8, va="top")
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.07, right=0.99, top=1 - 0.8 / height, bottom=0.65 / height, hspace=0.55)
    fig.savefig(path, dpi=110)
    plt.close(fig)
