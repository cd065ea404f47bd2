"""scripts/figures.py, which makes docs/LEARN.md's figures and tables: its small form end to end
(a plan's timeline and table, a profiled step's lanes, the collectives alone), and the page as
committed, which must be what the committed results/learn/*.json render to."""
import gzip
import json
import re
import shutil
import sys

from conftest import REPO, launch

SCRIPT = REPO / "scripts" / "figures.py"


def blocks(text):
    """{name: the lines between its markers} of every figures.py block in `text`."""
    found = re.findall(r"<!-- figures\.py: (\S+) -->\n(.*?)<!-- /figures\.py -->", text, re.S)
    return {name: body.strip().splitlines() for name, body in found}


def test_the_small_form_makes_each_kind_of_figure_and_fills_its_tables(char_data, tmp_path):
    doc = tmp_path / "LEARN.md"
    shutil.copy(REPO / "docs" / "LEARN.md", doc)
    for name in blocks(doc.read_text()):  # (emptied: each filled block is this run's)
        doc.write_text(re.sub(rf"(<!-- figures\.py: {name} -->\n).*?(<!-- /figures\.py -->)", r"\1\2",
                              doc.read_text(), flags=re.S))
    figures, results = tmp_path / "figures", tmp_path / "results"
    res = launch([sys.executable, SCRIPT, "--small", f"--figures_dir={figures}", f"--results_dir={results}",
                  f"--doc={doc}", f"--data_dir={char_data}"], timeout=240, fork=False)
    assert res.returncode == 0, res.describe()
    made = {p.name for p in figures.glob("*.png")}
    assert made == {"fsdp-step.png", "sharding.png", "memory-tiny-w2.png", "trace-zero3.png", "trace-h100.png",
                    "trace-predicted.png", "time-model.png"} and all((figures / p).stat().st_size > 10_000 for p in made)
    commands = (figures / "commands.md").read_text()
    for name, command in (("memory-tiny-w2", "python plan.py"), ("trace-zero3", "python overlap.py"),
                          ("collectives", "scripts/collectives.py"), ("trace-predicted", "--lanes_json="),
                          ("time-model", "bench.py --predict")):
        assert f"## {name}" in commands and command in commands.split(f"## {name}")[1].split("## ")[0], name
    filled = blocks(doc.read_text())
    rows = json.loads((results / "memory-by-w.json").read_text())
    assert rows["commit"] and rows["command"].startswith("python plan.py")
    table = [line for line in filled["memory-by-w"] if line.startswith("| tiny | custom_fsdp |")]
    assert len(table) == sum(r["backend"] == "custom_fsdp" for r in rows["rows"]) == 1  # W = 2
    peaks = [f"{r['peak_allocated_bytes'] / 1e9:.2f}" for r in rows["rows"] if r["backend"] == "custom_fsdp"]
    assert [line.split(" | ")[4] for line in table] == peaks
    assert any(line.startswith("| tiny | ddp | 2 |") for line in filled["memory-by-w"])  # the baseline
    assert [x["backend"] for x in rows["snapshots"]] == ["ddp", "fsdp", "custom_fsdp"]  # (memory_viz's, linked)
    assert all((figures / x["file"]).stat().st_size == x["bytes"] for x in rows["snapshots"])
    assert len(filled["snapshots"]) == 3
    traces = json.loads((results / "traces.json").read_text())["rows"]
    assert [(r["schedule"], r["backend"]) for r in traces] == [("zero3", "custom_fsdp")]
    with gzip.open(figures / "perfetto" / "zero3-custom_fsdp.json.gz", "rt") as f:  # (Perfetto opens it as is)
        names = [e.get("name", "") for e in json.load(f)["traceEvents"]]
    (step,) = [n for n in names if n.startswith("ProfilerStep#")]  # (the median profiled step alone)
    assert step == traces[0]["step"] and len(traces[0]["profiled_steps_ms"]) == 3
    assert [n for n in names if n.startswith("phase: ")] == [
        "phase: forward 0", "phase: backward 0", "phase: clip", "phase: optimizer", "phase: zero_grad"]
    collectives = json.loads((results / "collectives.json").read_text())["rows"]
    assert [r["op"] for r in collectives] == ["all_gather", "reduce_scatter", "all_reduce"]
    assert [r["ran_as"] for r in collectives] == ["gloo:all_gather", "gloo:all_reduce", "gloo:all_reduce"]
    assert len([line for line in filled["collectives"] if line.startswith("| all_")]) == 2
    assert not filled.get("step-time") and not filled.get("weak-scaling")  # (the full form's: bench.py runs)
    runs = json.loads((results / "correctness.json").read_text())["rows"]
    assert [r["run"] for r in runs] == ["one process", "ddp", "fsdp", "custom_fsdp"] and len(runs[0]["loss"]) == 3
    fsdp2, ours = runs[2], runs[3]
    assert (ours["loss"], ours["grad_norm"]) == (fsdp2["loss"], fsdp2["grad_norm"])  # (bit for bit: same kernels, sums)
    assert [line.split(" | ")[-1] for line in filled["correctness"] if line.startswith("| custom_fsdp |")] == ["yes |"]


def test_learn_md_is_what_its_results_render_to(tmp_path):
    """docs/LEARN.md's tables are the rendering of results/learn/*.json, as committed."""
    doc = tmp_path / "LEARN.md"
    shutil.copy(REPO / "docs" / "LEARN.md", doc)
    res = launch([sys.executable, SCRIPT, "--render", f"--doc={doc}"], timeout=60, fork=False)
    assert res.returncode == 0, res.describe()
    assert doc.read_text() == (REPO / "docs" / "LEARN.md").read_text()
    assert all(blocks(doc.read_text()).values())
    for figure in re.findall(r"\]\((figures/[^)]+\.png)\)", doc.read_text()):
        assert (REPO / "docs" / figure).exists(), figure
