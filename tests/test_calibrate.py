"""The CPU's calibration (planner/calibrate.py) and its op costs (planner/opcosts.py), tested without
timing anything: the checks a calibration must pass, what is cached and what is kept when a
measurement is contended, the load meter, and the op signatures the costs are keyed by."""
import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, clean_calibration, launch
from planner import calibrate, opcosts, timing


def copy(figures):
    return json.loads(json.dumps(figures))


def test_a_clean_calibration_passes_its_checks_and_a_poisoned_one_is_named():
    """The issue's poisoned cache: all cores multiplying below one thread's rate, an all-gather's
    latency of seconds, other processes busy while it measured. Each is a problem, in words."""
    clean = clean_calibration()
    assert calibrate.checks(clean) == []
    busy_core = copy(clean)
    busy_core["cores"] = 2
    busy_core["all_cores"][0]["torch.float32"] = 0.9 * busy_core["one_thread"][0]["torch.float32"]
    (problem,) = calibrate.checks(busy_core)
    assert "a core was busy" in problem
    slow = copy(clean)
    slow["gloo"]["2"]["all_gather"][0][1] = 0.5  # (the smallest size's time: its latency)
    problems = calibrate.checks(slow)
    assert problems and all("all_gather" in p and "at 2 processes beside compute" in p for p in problems)
    assert any("latency" in p for p in problems)
    loaded = copy(clean)
    loaded["load"]["others_cores"] = 0.9
    (problem,) = calibrate.checks(loaded)
    assert "other processes took 0.90 cores" in problem


def test_a_failing_calibration_is_measured_again_keeping_each_figure_at_its_best(monkeypatch):
    """Each attempt that fails its checks is followed by another, up to ATTEMPTS; the figures are the
    best over the attempts (the higher rate, the lower latency), and what still fails is named."""
    clean = clean_calibration()
    slow = copy(clean)
    slow["one_thread"][0]["torch.float32"] /= 2
    slow["gloo"]["2"]["all_gather"][0][1] = 0.5
    attempts = [slow, clean]

    def measure_once():
        f = attempts.pop(0)
        keys = ("one_thread", "all_cores", "gloo", "gloo_alone", "gloo_takes", "drift", "typical_over_best")
        return {k: f[k] for k in keys}, f["op_seconds"], calibrate.Load(f["load"])
    monkeypatch.setattr(calibrate, "measure_once", measure_once)
    measured = calibrate.measure()
    assert measured["attempts"] == 2 and not measured["contended"] and measured["problems"] == []
    assert measured["gloo"]["2"]["all_gather"] == clean["gloo"]["2"]["all_gather"]
    assert measured["one_thread"][0]["torch.float32"] == clean["one_thread"][0]["torch.float32"]
    attempts = [slow] * calibrate.ATTEMPTS
    measured = calibrate.measure()
    assert measured["attempts"] == calibrate.ATTEMPTS and measured["contended"]
    assert any("all_gather latency" in p for p in measured["problems"])


def test_only_a_clean_calibration_is_cached_and_a_contended_one_keeps_the_clean(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clean = clean_calibration()
    contended = copy(clean) | {"contended": True, "problems": ["other processes took 0.90 cores"]}
    monkeypatch.setattr(calibrate, "measure", lambda: copy(contended))
    got = calibrate.figures()
    assert got["contended"] and not (tmp_path / "fsdp-gpt" / "cpu-calibration.json").exists()
    assert "CONTENDED, not cached: other processes took 0.90 cores" in calibrate.describe(got)
    monkeypatch.setattr(calibrate, "measure", lambda: copy(clean) | {"measured_at": "2026-02-02 00:00:00"})
    assert calibrate.figures()["measured_at"] == "2026-02-02 00:00:00"  # (measured and cached)
    monkeypatch.setattr(calibrate, "measure", lambda: pytest.fail("a clean cache is not measured again"))
    assert calibrate.figures()["measured_at"] == "2026-02-02 00:00:00"
    (tmp_path / "fsdp-gpt" / "cpu-op-costs.json").write_text("{}")
    monkeypatch.setattr(calibrate, "measure", lambda: copy(contended))
    kept = calibrate.figures(recalibrate=True)  # (the op costs are measured again too)
    assert kept["measured_at"] == "2026-02-02 00:00:00" and "a new calibration was contended" in kept["kept"]
    assert not (tmp_path / "fsdp-gpt" / "cpu-op-costs.json").exists()
    assert "kept, as a new calibration was contended" in calibrate.describe(kept)


def test_the_load_meter_counts_anothers_busy_process_and_not_its_own():
    """A process spinning outside this one's descendants is the machine's load, even in this process
    group (a shell script's other job); one this process started is the plan's own work, even once it
    has ended. (CPU time is counted, not timed: other tests' load only adds to the first.)"""
    import os
    import signal
    spin = f"{sys.executable} -c 'while True: pass'"
    meter = calibrate.LoadMeter()
    # (started by a shell that exits at once: the spinner is nobody's descendant here, in our group)
    other = int(subprocess.run(["sh", "-c", f"{spin} >/dev/null 2>&1 & echo $!"], capture_output=True,
                               text=True, check=True).stdout)
    ours = subprocess.Popen(["sh", "-c", f"exec {spin}"])  # (as a plan's own children)
    try:
        assert os.getpgid(other) == os.getpgrp()
        time.sleep(1.5)
    finally:
        os.kill(other, signal.SIGKILL)
        ours.kill()
        ours.wait()
    own = meter.own()
    load = meter.read()
    assert load["others_cores"] >= 0.5 and load.contended
    assert own >= 0.5 * calibrate.os.sysconf("SC_CLK_TCK")  # (the spinner started here: half a core for 1.5 s)


def test_an_ops_signature_rebuilds_it_on_real_tensors_of_its_shapes_and_strides():
    a, b = torch.ones(8, 16), torch.ones(4, 16).t()  # (b: a transposed weight, as a Linear's)
    sig = opcosts.signature(torch.ops.aten.mm.default, (a, b), {})
    func, args, kwargs = opcosts.rebuilt(sig)
    assert func is torch.ops.aten.mm.default and kwargs == {}
    assert [(x.shape, x.stride()) for x in args] == [(a.shape, a.stride()), (b.shape, b.stride())]
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as fake:  # (a plan's tensors: the same signature)
        assert opcosts.signature(torch.ops.aten.mm.default, (fake.from_tensor(a), fake.from_tensor(b)), {}) == sig
    cat = opcosts.signature(torch.ops.aten.cat.default, ([a, a[:, :4]], 1), {})
    func, (tensors, dim), _ = opcosts.rebuilt(cat)
    assert [t.shape for t in tensors] == [(8, 16), (8, 4)] and tensors[1].stride() == (16, 1) and dim == 1
    to = opcosts.signature(torch.ops.aten._to_copy.default, (a,), {"dtype": torch.bfloat16})
    assert opcosts.rebuilt(to)[2] == {"dtype": torch.bfloat16}
    assert opcosts.signature(torch.ops.aten.view.default, (a, [128]), {}) == "free"
    assert opcosts.signature(torch.ops.aten.t.default, (a,), {}) == "free"
    from torch.distributed.tensor import DTensor
    assert opcosts.signature(torch.ops.aten.add.Tensor, (a, object()), {}) is None
    assert DTensor  # (a wrapper subclass is no signature either: the counter sees its local ops)


def test_op_costs_are_keyed_by_the_cpu_and_threads_and_a_device_prefers_them(tmp_path):
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    sig = opcosts.signature(torch.ops.aten.mm.default, (a, b), {})
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"key": "this cpu", "costs": {"1": {sig: 2e-3}, "2": {sig: 1e-3}}}))
    one, two = opcosts.OpCosts(str(path), "this cpu", 1), opcosts.OpCosts(str(path), "this cpu", 2)
    assert one.cost(sig) == 2e-3 and two.cost(sig) == 1e-3 and one.cost("free") == 0.0
    assert opcosts.OpCosts(str(path), "another cpu", 1).cost(sig) is None
    one.scale = 2.0  # (four ranks on two cores: each op takes twice as long)
    assert one.cost(sig) == 4e-3
    op = timing.compute_op(torch.ops.aten.mm.default, (a, b), {}, a @ b, "")
    device = timing.Device("cpu", {torch.float32: 1e9}, 1e9, 0.0, False, {}, {}, "made up")
    roofline = max(op.flops, op.nbytes) / 1e9  # (no costs: its FLOPs or bytes, whichever takes longer)
    assert device.compute_seconds(op) == roofline
    assert device._replace(op_costs=one).compute_seconds(op) == 4e-3
    unknown = op._replace(signature=None)  # (an op no signature describes: FLOPs and bytes again)
    assert device._replace(op_costs=one).compute_seconds(unknown) == roofline


def test_the_cpus_attention_kernels_count_their_flops():
    """torch's FLOP counter names the GPU's attention kernels, not the CPU's, which a plan runs."""
    q = torch.ones(2, 4, 32, 16)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, True)
    op = timing.compute_op(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.0, True),
                           {}, out, "")
    assert op.flops == 4 * 2 * 4 * 32 * 32 * 16  # (QK^T and PV: 2 FLOPs a multiply-add each)
    grad = timing.compute_op(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                             (q, q, q, q, out[0], out[1], 0.0, True), {}, (q, q, q), "")
    assert grad.flops == 2.5 * op.flops


def test_a_gpus_measured_figures_that_fail_their_checks_are_refused(tmp_path, monkeypatch):
    """plan_check.py's figures pass the same kind of checks: a matmul above the datasheet's peak (a
    misnamed GPU), or a host time per op of a shared machine, is not planned on; the device says so."""
    monkeypatch.setattr(timing, "RESULTS", str(tmp_path))
    sys.path.insert(0, str(REPO / "scripts"))
    import plan_check
    speed = {"matmul_bf16_flops": 1.5 * 989e12, "memory_bytes_per_second": 0.9 * 3.35e12, "op_seconds": 5e-6}
    figures = plan_check.time_model_figures(speed, "cuda: NVIDIA H100 80GB HBM3")
    assert len(figures["problems"]) == 1 and "matmul_efficiency 1.5" in figures["problems"][0]
    (tmp_path / "gpu.json").write_text(json.dumps({"date": "2026-06-01", "time_model": figures}))
    device = timing.gpu("h100", 1e11)
    assert device.flops_per_second(torch.bfloat16) == 989e12 * timing.MATMUL_EFFICIENCY
    assert "gpu.json failed its checks: matmul_efficiency 1.5" in device.source


def test_plan_of_a_cpu_run_plans_float32_and_recalibrate_needs_one(tmp_path, char_data):
    """plan.py --device=cpu without --dtype plans what train.py runs there (float32); it names the
    calibration it timed on; --recalibrate without a CPU run is refused in one line."""
    args = [sys.executable, REPO / "plan.py", "--dist_backend=custom_fsdp", "--nproc=2", "--n_layer=2", "--n_embd=32",
            "--n_head=2", "--batch_size=2", "--block_size=32", f"--data_dir={char_data}"]
    res = launch(args + ["--device=cpu"], timeout=180)
    assert res.returncode == 0, res.describe()
    said = " ".join(res.stdout.split())
    assert "dtype=float32" in said and "measured on this CPU at 2026-01-01 00:00:00" in said
    res = launch(args + ["--recalibrate"], timeout=60)
    assert res.returncode != 0 and res.stderr.strip().splitlines()[-1].startswith("error: --recalibrate")
