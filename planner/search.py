"""
plan.py --search: the FSDP settings that fit, fastest first. Each setting of the grid is planned
as a row is (memory and time), the ones that fit the GPU are ranked by the time model's tokens/s,
and the best one is printed as a train.py command line.

    --search                         the default grid (GRID)
    --search="wrap_policy=block,size activation_checkpointing=False"   a narrower one

The grid may also name reshard_after_forward=N (ZeRO-3 within groups of N ranks), prefetch and
HSDP's replicate_degree (degrees that do not divide W are skipped). Without prefetch in the grid,
prefetch=False is tried only for settings that do not fit with it on: a prefetch buys overlap for
one more unit's memory. The global batch stays the run's: a micro-batch of half or twice the
size takes twice or half the accumulation steps.
"""
import itertools
import shlex

import configurator

from .step import Child, in_child, plan, time_rows

GRID = {"wrap_policy": ("block", "size", "model"), "reshard_after_forward": (True, False),
        "activation_checkpointing": (False, True), "micro_batch": ("half", "same", "double")}
OPTIONAL = ("prefetch", "replicate_degree")  # axes a grid may name; off the default one, which keeps their defaults
TOP = 5


def _value(key, text):
    """One grid value of `key` from its text, or None where the key does not take it."""
    if text in ("True", "False") and key in ("reshard_after_forward", "prefetch"):
        return text == "True"
    if key in ("reshard_after_forward", "replicate_degree") and text.isdigit() and int(text) >= (
            2 if key == "reshard_after_forward" else 1):
        return int(text)
    return next((v for v in GRID.get(key, ()) if str(v) == text), None)


def parse_grid(text):
    """--search's value -> the grid: GRID, with each key the text names narrowed to its values."""
    grid = dict(GRID)
    for item in text.split() if text not in ("", "True", "all") else []:
        key, _, values = item.partition("=")
        if key not in (*GRID, *OPTIONAL) or not values:
            configurator.fail(f"--search: '{item}' is not KEY=V1,V2 with KEY one of {', '.join((*GRID, *OPTIONAL))}")
        parsed = [_value(key, v) for v in values.split(",")]
        if None in parsed:
            takes = {"reshard_after_forward": "True, False or a group size of 2 or more", "prefetch": "True, False",
                     "replicate_degree": "degrees of 1 or more"}.get(key) or ", ".join(map(str, GRID[key]))
            configurator.fail(f"--search: {key} takes {takes}; got {values}")
        grid[key] = tuple(parsed)
    return grid


def global_accumulation(settings, world):
    """The run's gradient_accumulation_steps, or the nearest multiple of W where it is none (train.py
    refuses a split that leaves ranks uneven)."""
    accum = settings["gradient_accumulation_steps"]
    return accum if accum % world == 0 else world * max(1, round(accum / world))


def settings_of(settings, world, choice):
    """The run's settings with one choice of the grid applied, or None where the batch split fails
    (the accumulation steps must stay a multiple of W)."""
    batch, accum = settings["batch_size"], global_accumulation(settings, world)
    scale = {"half": 0.5, "same": 1, "double": 2}[choice["micro_batch"]]
    if scale < 1 and batch % 2 or scale > 1 and accum % 2:
        return None
    batch, accum = int(batch * scale), int(accum / scale)
    if batch < 1 or accum % world or world % choice.get("replicate_degree", 1):
        return None
    chosen = {k: v for k, v in choice.items() if k != "micro_batch"}
    return dict(settings, **{"prefetch": True} | chosen, batch_size=batch, gradient_accumulation_steps=accum)


def search(settings, backend_name, world, rank, grid, limit, device, gloo, at_once):
    """Every setting of the grid planned, `at_once` side by side -> the rows, fitting ones first,
    fastest first. A row that does not fit is planned again without prefetch."""
    choices = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    runs = [s for s in (settings_of(settings, world, c) for c in choices) if s is not None]
    rows, running = [], []
    for index, run in enumerate(runs):
        running.append((run, Child(plan, run, backend_name, world, rank, gloo=gloo, device=device)))
        while running and (len(running) == at_once or index == len(runs) - 1):
            run, child = running.pop(0)
            rows.append(_judged(child.result(), run, limit))
    for row in [r for r in rows if not r["fits"] and "prefetch" not in grid]:
        run = dict(row["settings"], prefetch=False)
        rows.append(_judged(in_child(plan, run, backend_name, world, rank, gloo=gloo, device=device), run, limit))
    time_rows(rows, [device] * len(rows), [r["settings"] for r in rows])  # (all rows' op costs in one pass)
    for row in rows:
        row.pop("predicted_lanes", None)
    return sorted(rows, key=lambda r: (not r["fits"], -r["tokens_per_second"]))


def _judged(row, run, limit):
    row["settings"] = run
    row["fits"] = limit is None or row["reserved_bytes"] + row["outside_allocator_bytes"] <= limit
    return row


KNOBS = ("wrap_policy", "reshard_after_forward", "activation_checkpointing", "replicate_degree", "prefetch",
         "batch_size", "gradient_accumulation_steps")


def report(rows, argv, backend_name, world, settings):
    """The top rows as a table, then the best one as a train.py command line."""
    fitting = [r for r in rows if r["fits"]]
    shown = [k for k in KNOBS if k != "replicate_degree" or any(r["settings"][k] != 1 for r in rows)]  # (HSDP: asked)
    lines = [f"{'tokens/s':>10} {'step ms':>8} {'exposed':>8} {'reserve GiB':>11}  settings"]
    accum = global_accumulation(settings, world)
    if accum != settings["gradient_accumulation_steps"]:
        lines.insert(0, f"gradient_accumulation_steps={settings['gradient_accumulation_steps']} is no multiple of "
                        f"W={world}: searched at {accum}, the nearest")
    for r in fitting[:TOP]:
        knobs = " ".join(f"{k}={r['settings'][k]}" for k in shown)
        lines.append(f"{r['tokens_per_second']:>10,.0f} {r['step_seconds'] * 1e3:>8,.1f} "
                     f"{r['exposed_comm_seconds'] * 1e3:>8,.1f} {r['reserved_bytes'] / 2**30:>11,.2f}  {knobs}")
    lines.append(f"\n{len(fitting)} of {len(rows)} planned settings fit.")
    if fitting:
        best = fitting[0]["settings"]
        given = [a for a in argv if not any(a.startswith(f"--{k}=") for k in (*KNOBS, "dist_backend"))]
        flags = [f"--dist_backend={backend_name}"] + [f"--{k}={best[k]}" for k in shown]
        lines.append("the fastest that fits:")
        nodes = [f"--nproc_per_node={world}"] if world <= 8 else [f"--nnodes={-(-world // 8)}", "--nproc_per_node=8"]
        lines.append(shlex.join(["torchrun", *nodes, "train.py", *given, *flags]))
    return "\n".join(lines)
