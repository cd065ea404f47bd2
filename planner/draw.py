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


# the phases shaded behind the stack (clip and zero_grad are short, beside the optimizer's step)
PHASE_SHADES = {"forward": ("#e8eef8", "forward"), "backward": ("#fbeee4", "backward"),
                "clip": ("#e9f5ec", "clip, optimizer step, zero_grad"), "optimizer": ("#e9f5ec", None),
                "zero_grad": ("#e9f5ec", None)}
PHASE_TICKS = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


def tick_label(where):
    """'step 2 backward 1' -> 'bwd 1' (micro-step 1); a step's first forward also names the step."""
    _, step, phase = where.split(" ", 2)
    kind, _, micro = phase.partition(" ")
    return f"{PHASE_TICKS[kind]} {micro}".strip() + (f"\nstep {step}" if phase == "forward 0" else "")


def draw_timelines(timelines, settings, path, title=None, decimal=False):
    """One panel per planned run: a rank's allocated bytes over two training steps, event by event,
    stacked by role (in GiB, or with decimal in GB); under it each collective and each free of gathered parameters, at the event
    where the step issues it; phases shaded and named on the axis; the peak and its moment labelled. The panels
    share the y-axis, so backends and world sizes compare at a glance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    top = max(t["peak_allocated_bytes"] for t in timelines)
    unit, scale = (("GB", 1e9) if top >= 1e9 else ("MB", 1e6)) if decimal else (
        ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20))
    top /= scale
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 2.4 * len(timelines) + 1.2), sharey=True, squeeze=False)
    for ax, t in zip(axes[:, 0], timelines):
        x = [row[0] for row in t["stacked"]]
        layers = [[row[1 + i] / scale for row in t["stacked"]] for i in range(len(t["roles"]))]
        ax.stackplot(x, layers, colors=[ROLE_COLOURS[r] for r in t["roles"]], step="post", linewidth=0)
        events = [(index, kind) for index, kind, _ in t["collectives"]] + [(i, "gathered_freed") for i, _ in t["gathered_freed"]]
        for kind, (marker, colour, _) in EVENT_MARKS.items():
            at = [index for index, k in events if k == kind]
            y = -top * (0.05 if kind == "gathered_freed" else 0.11)
            ax.plot(at, [y] * len(at), marker, color=colour, markersize=4, linestyle="none", clip_on=False)
        marks = t["marks"] + [[t["events"], "end"]]
        for (index, where), (following, _) in zip(marks, marks[1:]):  # each phase shaded, its start named
            phase = where.split(" ", 2)[-1]
            kind = phase.split(" ")[0]
            if kind in PHASE_SHADES:
                ax.axvspan(index, following, color=PHASE_SHADES[kind][0], linewidth=0, zorder=0)
        ticks = [(index, where) for index, where in t["marks"] if where.split(" ", 2)[-1].split(" ")[0] in PHASE_TICKS]
        ax.set_xticks([index for index, _ in ticks])
        ax.set_xticklabels([tick_label(where) for _, where in ticks], fontsize=6.5)
        ax.annotate(f"peak {t['peak_allocated_bytes'] / scale:,.2f} {unit}: {t['peak_at']}",
                    (t["peak_event"], t["peak_allocated_bytes"] / scale), xytext=(0.01, 0.95), textcoords="axes fraction",
                    fontsize=7, va="top", arrowprops=dict(arrowstyle="->", color="k", linewidth=0.6))
        ax.set_title(f"{t['backend']}, W={t['nproc']}, rank {t['rank']}", fontsize=9, loc="right")
        ax.set_xlim(0, t["events"])
        ax.set_ylim(-top * 0.15, top * 1.1)
        ax.set_ylabel(f"{unit} allocated", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    handles = [Patch(color=ROLE_COLOURS[r], label=r.replace("_", " ")) for r in ROLES] + [
        Line2D([], [], marker=m, color=c, linestyle="none", markersize=5, label=label) for m, c, label in EVENT_MARKS.values()] + [
        Patch(color=colour, label=f"phase: {label}") for colour, label in PHASE_SHADES.values() if label]
    height = fig.get_figheight()
    fig.legend(handles=handles, loc="upper center", ncol=7, fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.3 / height))
    axes[-1, 0].set_xlabel("allocation events in the order the step makes them: two training steps; "
                           "fwd k / bwd k: micro-step k's forward / backward; opt: the optimizer's step", fontsize=8)
    shape = f"micro-batch {settings['batch_size']} x {settings['block_size']} tokens, {settings['dtype']}"
    fig.suptitle(f"{title}: {shape}" if title else shape, fontsize=9, y=1 - 0.08 / height, va="top")
    fig.subplots_adjust(left=0.07, right=0.99, top=1 - 1.05 / height, bottom=0.65 / height, hspace=0.55)
    fig.savefig(path, dpi=110)
    plt.close(fig)
