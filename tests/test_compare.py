"""compare.py on hand-written metrics.jsonl files with known loss gaps."""
import json
import math
import re
import sys

import pytest

from conftest import REPO, launch

sys.path.insert(0, str(REPO))
import compare  # noqa: E402


def write_run(d, train_losses, val_losses, dt_ms, mem, extra_lines=()):
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"event": "start", "config": {"n_layer": 2}}) + "\n")
        for i, loss in train_losses.items():
            f.write(json.dumps({"iter": i, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "dt_ms": dt_ms[i],
                                "tokens_per_sec": 1000 / (dt_ms[i] / 1000), "mfu": 0.1, "peak_mem_mb": mem[i]}) + "\n")
        for i, loss in val_losses.items():
            f.write(json.dumps({"iter": i, "train_loss": loss + 0.01, "val_loss": loss}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def make_runs(tmp_path):
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    # 1,000 tokens per step; the first two steps (warm-up) are the slowest and count in no median
    write_run(a, {0: 4.0, 10: 3.5, 20: 3.0}, {0: 4.1, 20: 3.2},
              dt_ms={0: 900.0, 10: 400.0, 20: 5.0}, mem={0: 50.0, 10: 75.5, 20: 60.0})
    # run_b differs by 0.25 at iter 10; iter 30 exists only in b and must not count
    write_run(b, {0: 4.0, 10: 3.25, 20: 3.125, 30: 9.0}, {0: 4.1, 20: 3.3},
              dt_ms={0: 900.0, 10: 400.0, 20: 10.0, 30: 40.0}, mem={0: 1.0, 10: 2.0, 20: 3.0, 30: 2.5},
              extra_lines=['{"event": "done"}', "", '{"iter": 5}', "not json", '{"iter": 40, "loss": 1.0'])
    return a, b


def test_load_and_summarize(tmp_path):
    a, b = make_runs(tmp_path)
    ta, ea = compare.load_metrics(a)
    tb, eb = compare.load_metrics(b)
    assert [r["iter"] for r in ta] == [0, 10, 20] and [r["iter"] for r in ea] == [0, 20]
    assert [r["iter"] for r in tb] == [0, 10, 20, 30]

    s = compare.summarize([("run_a", ta, ea), ("run_b", tb, eb)])
    assert s[0]["max_diff_vs_first"] == 0.0
    assert s[1]["max_diff_vs_first"] == 0.25
    assert s[0]["final_train_loss"] == 3.0 and s[1]["final_train_loss"] == 9.0
    assert s[0]["final_val_loss"] == 3.2 and s[1]["final_val_loss"] == 3.3
    # tokens/s at the median of the steps past warm-up: 5 ms; 25 ms (not the 62,500 that the median of
    # 100,000 and 25,000 tokens/s would say)
    assert s[0]["median_tokens_per_sec"] == pytest.approx(200_000) and s[1]["median_tokens_per_sec"] == pytest.approx(40_000)
    assert s[0]["peak_mem_mb"] == 75.5 and s[1]["peak_mem_mb"] == 3.0


def test_a_step_both_runs_skipped_as_nan_is_no_difference():
    """on_nonfinite='skip' logs a skipped step's nan loss: two runs that skipped the same step agree
    there; a nan in one run only is still divergence."""
    def rows(*losses):
        return [{"iter": i, "loss": loss} for i, loss in enumerate(losses)]
    assert compare.max_loss_diff(rows(4.0, math.nan, 3.5), rows(4.0, math.nan, 3.25)) == 0.25
    assert compare.max_loss_diff(rows(4.0, math.inf), rows(4.0, math.inf)) == 0.0
    assert math.isnan(compare.max_loss_diff(rows(4.0, math.nan, 3.5), rows(4.0, 3.9, 3.5)))


def test_overall_max_diff_looks_at_every_pair():
    """Three runs whose largest gap is between the second and the third, not to the first."""
    def rows(*losses):
        return [{"iter": i, "loss": loss} for i, loss in enumerate(losses)]
    runs = [("a", rows(4.0, 3.0), []), ("b", rows(4.0, 3.125), []), ("c", rows(4.0, 2.875), [])]
    assert compare.overall_max_diff(runs) == (0.25, "b", "c")


def test_cli(tmp_path):
    a, b = make_runs(tmp_path)
    png = tmp_path / "cmp.png"
    res = launch([sys.executable, str(REPO / "compare.py"), str(a), str(b), "--out", str(png)], timeout=120)
    assert res.returncode == 0, res.stderr
    assert png.exists() and png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "run_a" in res.stdout and "run_b" in res.stdout
    m = re.search(r"max loss difference between runs: (\S+)", res.stdout)
    assert m, res.stdout
    assert float(m.group(1)) == 0.25


def test_missing_metrics_exits_2(tmp_path):
    a, _ = make_runs(tmp_path)
    empty = tmp_path / "no_metrics"
    empty.mkdir()
    res = launch([sys.executable, str(REPO / "compare.py"), str(a), str(empty),
                          "--out", str(tmp_path / "x.png")], timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert lines == [f"error: no metrics.jsonl in {empty}"], lines
    assert not (tmp_path / "x.png").exists()
    res = launch([sys.executable, str(REPO / "compare.py"), str(a), str(tmp_path / "typo")], timeout=120)
    assert res.returncode == 2 and res.stderr.splitlines() == [f"error: {tmp_path / 'typo'} does not exist"]


@pytest.mark.parametrize("out,problem", [("x.txt", "name a picture file"), ("x", "name a picture file"),
                                         ("no/such/folder/x.png", "its folder does not exist")])
def test_an_unwritable_plot_is_refused_before_reading_runs(tmp_path, out, problem):
    """(matplotlib raised at the end, after the table, for a format it does not write or a missing folder)"""
    a, _ = make_runs(tmp_path)
    res = launch([sys.executable, str(REPO / "compare.py"), str(a), "--out", str(tmp_path / out)], timeout=120)
    assert res.returncode == 2 and problem in res.stderr.splitlines()[-1] and not res.stdout, res.stderr


def test_a_resumed_run_counts_the_rows_of_its_last_attempt(tmp_path):
    """Logged up to iter 30, then resumed from its checkpoint at 10 and stopped after 20: the
    resumed rows replace the first attempt's from 10 on, and its row at 30 (never reached again)
    is gone, in the curves, the medians and the peaks."""
    d = tmp_path / "resumed"
    write_run(d, {0: 4.0, 10: 3.5, 20: 3.0, 30: 2.5}, {0: 4.1, 10: 3.6, 30: 2.6},
              dt_ms={0: 1.0, 10: 1.0, 20: 1.0, 30: 1.0}, mem={0: 50.0, 10: 999.0, 20: 999.0, 30: 999.0})
    with open(d / "metrics.jsonl", "a") as f:  # the resumed attempt's lines, appended
        f.write(json.dumps({"iter": 10, "train_loss": 3.7, "val_loss": 3.65}) + "\n")
        for i, loss in ((10, 3.4), (20, 2.9)):
            f.write(json.dumps({"iter": i, "loss": loss, "dt_ms": 10.0, "tokens_per_sec": 100_000.0,
                                "peak_mem_mb": 60.0}) + "\n")
    train, evals = compare.load_metrics(d)
    assert [(r["iter"], r["loss"]) for r in train] == [(0, 4.0), (10, 3.4), (20, 2.9)]
    assert [(r["iter"], r["val_loss"]) for r in evals] == [(0, 4.1), (10, 3.65)]
    s = compare.summarize([("resumed", train, evals)])[0]
    assert s["median_tokens_per_sec"] == 100_000.0 and s["peak_mem_mb"] == 60.0 and s["final_train_loss"] == 2.9


def test_overall_max_diff_reports_a_pair_that_diverged_to_nan():
    """A NaN in any pair wins over a finite gap found before it: the runs diverged. The first such pair
    is named (here the first run against the one that went NaN)."""
    def rows(*losses):
        return [{"iter": i, "loss": loss} for i, loss in enumerate(losses)]
    runs = [("a", rows(4.0, 3.0), []), ("b", rows(4.0, 3.125), []), ("c", rows(4.0, math.nan), [])]
    diff, a, b = compare.overall_max_diff(runs)
    assert math.isnan(diff) and (a, b) == ("a", "c")


def test_runs_are_named_by_folder_unless_two_share_a_name():
    assert compare.run_names(["x/run", "y/run/", "z/other"]) == ["x/run", "y/run/", "other"]
    assert compare.run_names(["x/a", "x/b"]) == ["a", "b"]


def test_final_losses_are_the_last_logged_not_the_best():
    train = [{"iter": i, "loss": loss} for i, loss in enumerate([4.0, 2.0, 3.0])]
    evals = [{"iter": i, "val_loss": loss} for i, loss in ((0, 4.1), (1, 2.5), (2, 3.5))]
    (s,) = compare.summarize([("r", train, evals)])
    assert s["final_train_loss"] == 3.0 and s["final_val_loss"] == 3.5
