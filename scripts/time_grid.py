"""
The time model's validation grid: plan.py's predicted step against bench.py's measured median on
settings nobody tuned the model to. Each group is one model size at one world size, run by one
`bench.py --predict` (3 repeats, rows interleaved), written to results/cpu-grid-<group>.json.
The held-out groups took no part in choosing or fitting the model; they are reported apart.

    python scripts/time_grid.py --data_dir=data/shakespeare_char [--only=1m-w2,57m-w2] [--repeats=3]
    python scripts/time_grid.py --summary        the grid's errors and rank correlations, from results/
    python scripts/time_grid.py --render         that table into IMPLEMENTATION.md

Run it on a quiet machine: every figure is a time.
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import spearman  # noqa: E402


WITHIN = 0.2  # the target: each setting's predicted step within 20% of its measured median


def shape(layers, width, heads):
    return [f"--n_layer={layers}", f"--n_embd={width}", f"--n_head={heads}"]


# name: (W, the model and batch, the rows, steps per run, held out)
GRID = {
    "1m-w2": (2, shape(4, 128, 4) + ["--batch_size=8", "--block_size=128", "--gradient_accumulation_steps=2"],
              ["ddp", "fsdp", "custom_fsdp", "custom_fsdp:wrap_policy=block",
               "custom_fsdp:batch_size=16:block_size=256"], 12, False),
    "3m-w2": (2, shape(4, 256, 4) + ["--batch_size=16", "--block_size=64", "--gradient_accumulation_steps=8"],
              ["ddp", "fsdp", "custom_fsdp", "custom_fsdp:activation_checkpointing=True",
               "custom_fsdp:reshard_after_forward=False"], 10, False),
    "11m-w2": (2, shape(6, 384, 6) + ["--batch_size=8", "--block_size=128", "--gradient_accumulation_steps=4"],
               ["ddp", "fsdp", "custom_fsdp", "custom_fsdp:wrap_policy=block",
                "custom_fsdp:reshard_after_forward=False:activation_checkpointing=True"], 8, False),
    "57m-w2": (2, shape(8, 768, 12) + ["--batch_size=4", "--block_size=64", "--gradient_accumulation_steps=2",
                                       "--wrap_policy=block"],
               ["ddp", "fsdp", "custom_fsdp", "custom_fsdp:reshard_after_forward=False",
                "custom_fsdp:prefetch=False"], 8, False),
    "3m-w4": (4, shape(4, 256, 4) + ["--batch_size=8", "--block_size=128", "--gradient_accumulation_steps=4"],
              ["ddp", "fsdp", "custom_fsdp", "custom_fsdp:wrap_policy=block:activation_checkpointing=True"], 8, False),
    "25m-w2": (2, shape(8, 512, 8) + ["--batch_size=4", "--block_size=256", "--gradient_accumulation_steps=2"],
               ["ddp", "fsdp", "custom_fsdp", "custom_fsdp:activation_checkpointing=True",
                "custom_fsdp:wrap_policy=block:reshard_after_forward=False"], 8, True),
    "11m-w4": (4, shape(6, 384, 6) + ["--batch_size=4", "--block_size=128", "--gradient_accumulation_steps=8"],
               ["ddp", "fsdp", "custom_fsdp", "custom_fsdp:wrap_policy=block"], 8, True),
}


def path_of(name, results):
    return os.path.join(results, f"cpu-grid-{name}.json")


def run(names, data_dir, repeats, results, work_dir):
    for name in names:
        world, model, rows, steps, _ = GRID[name]
        cmd = [sys.executable, os.path.join(REPO, "bench.py"), "--predict", f"--nproc={world}", f"--repeats={repeats}",
               f"--steps={steps}", "--exposed=False", "--device=cpu", f"--data_dir={data_dir}", *model,
               f"--backends={','.join(rows)}", f"--work_dir={work_dir}", f"--json={path_of(name, results)}"]
        print(f"grid {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)


def summary(results):
    """{group: (held out, [(row, predicted ms, measured ms, spread of its repeats)], Spearman's rho)}
    of the groups `results` (a folder) holds."""
    out = {}
    for name, (_, _, _, _, held_out) in GRID.items():
        path = path_of(name, results)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            result = json.load(f)
        rows = [(b, r["predicted_step_ms"], r["step_ms"],
                 (max(result["step_ms_per_repeat"][b]) - min(result["step_ms_per_repeat"][b])) / r["step_ms"])
                for b, r in result["backends"].items()]
        out[name] = (held_out, rows, spearman([p for _, p, _, _ in rows], [m for _, _, m, _ in rows]))
    return out


def part_figures(groups):
    """(settings, within WITHIN, the largest error, the lowest rho) of some groups of summary()."""
    errors = [p / m - 1 for _, rows, _ in groups for _, p, m, _ in rows]
    return (len(errors), sum(abs(e) <= WITHIN for e in errors), max(errors, key=abs),
            min(rho for _, _, rho in groups))


def summary_lines(results):
    """The grid as markdown: a row per group, then what the tuned-on and the held-out parts show."""
    groups = summary(results)
    lines = ["| group | held out | W | settings | within 20% | largest error | largest spread of repeats | "
             "Spearman's rank correlation |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, (held_out, rows, rho) in groups.items():
        n, within, largest, _ = part_figures([(held_out, rows, rho)])
        lines.append(f"| [`cpu-grid-{name}.json`](results/cpu-grid-{name}.json) | {'yes' if held_out else 'no'} | {GRID[name][0]} | {n} | {within} "
                     f"| {largest:+.1%} | {max(r[3] for r in rows):.0%} | {rho:.2f} |")
    lines.append("")
    for part, held in (("Tuned on", False), ("Held out", True)):
        chosen = [g for g in groups.values() if g[0] == held]
        if chosen:
            n, within, largest, rho = part_figures(chosen)
            lines.append(f"{part}: {within} of {n} settings within {WITHIN:.0%}, the largest error {largest:+.1%}, "
                         f"Spearman's rank correlation {'' if rho >= 0.995 else 'at least '}{rho:.2f} in each group.")
    return lines


BEGIN, END = "<!-- time_grid.py: {} -->", "<!-- /time_grid.py -->"


def render_into(path, results):
    """Fill `path`'s time_grid.py block: the grid's table."""
    with open(path) as f:
        text = f.read()
    begin = BEGIN.format("summary")
    if begin in text:
        start = text.index(begin) + len(begin)
        end = text.index(END, start)
        text = text[:start] + "\n" + "\n".join(summary_lines(results)) + "\n" + text[end:]
    with open(path, "w") as f:
        f.write(text)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", default=os.path.join(REPO, "data", "shakespeare_char"))
    p.add_argument("--only", default=",".join(GRID), help="groups to run, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", default=os.path.join(REPO, "results"))
    p.add_argument("--work_dir", default="bench_out")
    p.add_argument("--summary", action="store_true", help="print the grid's table from the results")
    p.add_argument("--render", nargs="*", metavar="FILE.md", help="fill these files' time_grid.py blocks")
    args = p.parse_args()
    if args.summary:
        return print("\n".join(summary_lines(args.results)))
    if args.render is not None:
        for path in args.render or [os.path.join(REPO, "IMPLEMENTATION.md")]:
            render_into(path, args.results)
            print(f"wrote the time_grid.py blocks of {path}")
        return
    names = args.only.split(",")
    unknown = [n for n in names if n not in GRID]
    if unknown:
        p.error(f"--only: unknown group {unknown[0]} (the groups: {', '.join(GRID)})")
    run(names, os.path.abspath(args.data_dir), args.repeats, args.results, args.work_dir)


if __name__ == "__main__":
    main()
