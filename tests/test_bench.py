"""bench.py and the trace analyser, checked without timing: synthetic traces with known overlap,
table fields on synthetic metrics, and collective bytes per step against the formula."""
import json
import math
import os
import subprocess
import sys
import time

import pytest
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
from conftest import REPO, TINY, launch, run_train  # noqa: E402
from fsdp_impl import overlap  # noqa: E402


def op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def test_overlap_cpu_trace():
    # training thread 1: step 0-100; work 0-40 and 60-100; blocked in a wait 40-60.
    # gloo thread 2 communicates 30-70: 10 + 10 us of it lie under compute.
    trace = {"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"),
        op("aten::mm", 0, 40), op("fsdp::all_gather_wait h.0", 40, 20, cat="user_annotation"),
        op("aten::mm", 60, 40), op("gloo:all_gather", 30, 40, tid=2, cat="user_annotation"),
    ]}
    (row,) = overlap.analyse(trace)
    assert row["comm_ms"] == pytest.approx(0.040)
    assert row["compute_ms"] == pytest.approx(0.080)
    assert row["hidden_ms"] == pytest.approx(0.020)
    assert row["exposed_ms"] == pytest.approx(0.020)
    assert row["hidden_fraction"] == pytest.approx(0.5)


def test_overlap_blocking_inside_an_enclosing_op_is_not_compute():
    # an autograd node 0-100 whose hook blocks in a c10d call 40-60 while gloo works 40-60
    trace = {"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"),
        op("autograd::engine::evaluate_function: AddBackward0", 0, 100),
        op("c10d::allgather_", 40, 20), op("gloo:all_gather", 40, 20, tid=2),
    ]}
    (row,) = overlap.analyse(trace)
    assert row["hidden_fraction"] == 0.0 and row["exposed_ms"] == pytest.approx(0.020)


def test_overlap_gpu_trace_counts_kernels_per_step():
    trace = {"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"), op("ProfilerStep#2", 100, 100, cat="user_annotation"),
        # the profiler's copies of the step ranges on the GPU's timeline are not steps of their own
        op("ProfilerStep#1", 5, 90, tid=7, cat="gpu_user_annotation"),
        op("ProfilerStep#2", 105, 90, tid=7, cat="gpu_user_annotation"),
        op("sm90_gemm", 0, 50, tid=7, cat="kernel"), op("ncclDevKernel_AllGather", 25, 50, tid=8, cat="kernel"),
        op("sm90_gemm", 100, 100, tid=7, cat="kernel"), op("ncclDevKernel_ReduceScatter", 150, 40, tid=8, cat="kernel"),
    ]}
    first, second = overlap.analyse(trace)
    assert first["hidden_fraction"] == pytest.approx(0.5)
    assert second["hidden_fraction"] == pytest.approx(1.0) and second["exposed_ms"] == 0
    assert overlap.summarize([first, second])["hidden_fraction"] == pytest.approx((0.025 + 0.040) / 0.090)


def test_overlap_gpu_trace_counts_kernels_off_the_compute_stream_as_communication():
    # world size 1: the copy standing in for the all-gather runs on a stream of its own (9), 20 of
    # its 30 us beside compute-stream gemms (7); a kernel on stream 7 that is no gemm is compute
    trace = {"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"),
        op("sm90_gemm", 0, 50, tid=7, cat="kernel"), op("unrolled_elementwise_kernel", 30, 30, tid=9, cat="kernel"),
        op("vectorized_elementwise_kernel", 60, 10, tid=7, cat="kernel"), op("sm90_gemm", 70, 30, tid=7, cat="kernel"),
    ]}
    (row,) = overlap.analyse(trace)
    assert row["comm_ms"] == pytest.approx(0.030) and row["compute_ms"] == pytest.approx(0.090)
    assert row["hidden_ms"] == pytest.approx(0.020) and row["exposed_ms"] == pytest.approx(0.010)
    assert overlap.exposed_by_place(trace) == {"unrolled_elementwise_kernel": pytest.approx(0.010)}


def test_overlap_gpu_trace_counts_copies_between_cpu_and_gpu_as_communication():
    # CPU offload: the shard's copy to the GPU (10-40) on a copy stream, 30 us of it beside the
    # gemm; the gradients' copy back (80-100) on the compute stream's tid, exposed: a copy is
    # traffic wherever it runs, and it never makes its stream the compute stream. A copy within
    # the GPU's memory (60-70) is neither
    trace = {"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"),
        op("sm90_gemm", 0, 60, tid=7, cat="kernel"), op("Memcpy HtoD (Pinned -> Device)", 10, 30, tid=9, cat="gpu_memcpy"),
        op("Memcpy DtoD (Device -> Device)", 60, 10, tid=7, cat="gpu_memcpy"),
        op("Memcpy DtoH (Device -> Pinned)", 80, 20, tid=7, cat="gpu_memcpy"),
    ]}
    (row,) = overlap.analyse(trace)
    assert row["comm_ms"] == pytest.approx(0.050) and row["compute_ms"] == pytest.approx(0.060)
    assert row["hidden_ms"] == pytest.approx(0.030) and row["exposed_ms"] == pytest.approx(0.020)
    assert overlap.exposed_by_place(trace) == {"Memcpy DtoH (Device -> Pinned)": pytest.approx(0.020)}


def test_exposed_time_goes_to_the_innermost_range_the_training_thread_was_in():
    # gloo communicates 30-90; the training thread computes 0-40 and 70-100. Exposed 40-70: 40-45 and
    # 55-60 in the FSDP wait range, 45-55 in the c10d call inside it, 60-70 in no range at all.
    trace = {"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"),
        op("aten::mm", 0, 40), op("fsdp::all_gather_wait h.0", 40, 20, cat="user_annotation"),
        op("c10d::allgather_", 45, 10), op("aten::mm", 70, 30), op("gloo:all_gather", 30, 60, tid=2),
    ]}
    places = overlap.exposed_by_place(trace)
    assert places == {"fsdp::all_gather_wait h.0": pytest.approx(0.010), "c10d::allgather_": pytest.approx(0.010),
                      overlap.OUTSIDE: pytest.approx(0.010)}
    assert sum(places.values()) == pytest.approx(overlap.analyse(trace)[0]["exposed_ms"])


def test_exposed_time_on_gpu_goes_to_the_communication_kernel_averaged_over_steps():
    trace = {"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"), op("ProfilerStep#2", 100, 100, cat="user_annotation"),
        op("sm90_gemm", 0, 50, tid=7, cat="kernel"), op("ncclDevKernel_AllGather", 25, 50, tid=8, cat="kernel"),
        op("sm90_gemm", 100, 40, tid=7, cat="kernel"), op("ncclDevKernel_ReduceScatter", 130, 20, tid=8, cat="kernel"),
    ]}
    places = overlap.exposed_by_place(trace)  # 25 us in step 1, 10 us in step 2
    assert list(places) == ["ncclDevKernel_AllGather", "ncclDevKernel_ReduceScatter"]
    assert places == {"ncclDevKernel_AllGather": pytest.approx(0.0125), "ncclDevKernel_ReduceScatter": pytest.approx(0.005)}
    assert overlap.exposed_by_place(trace, top=1) == {"ncclDevKernel_AllGather": pytest.approx(0.0125),
                                                      "1 other place": pytest.approx(0.005)}  # (the sum stays whole)
    assert overlap.exposed_by_place(trace, top=2) == places


def test_summarize_run_fields_and_medians():
    rows = [{"iter": 0, "train_loss": 4.0, "val_loss": 4.1}]
    rows += [{"iter": i, "loss": 4.0 - i / 10, "grad_norm": 1.0, "lr": 1e-3, "dt_ms": dt,
              "tokens_per_sec": 1000.0 / dt, "mfu": None, "peak_mem_mb": 100.0,
              "host_ms": {"batch": dt / 20, "forward_backward": dt / 2, "clip": 1.0, "optimizer": dt / 10}, "page_faults": 3 * dt,
              "cpu_ms": 2 * dt}
             for i, dt in enumerate([900.0, 500.0, 10.0, 30.0, 20.0])]
    rows += [{"event": "memory", "stage": "after first step", "rss_mb": 300.0, "params_mb": 2.0, "grads_mb": 2.0, "optim_mb": 4.0},
             {"event": "memory", "stage": "after last step", "rss_mb": 321.0, "params_mb": 2.0, "grads_mb": 1.5, "optim_mb": 4.0},
             {"event": "comm_per_step", "all_gather_bytes": 2**21, "reduce_scatter_bytes": 2**20,
              "all_reduce_bytes": 4.0, "all_gather_count": 9, "reduce_scatter_count": 5, "all_reduce_count": 1}]
    s = bench.summarize_run(rows, "custom_fsdp")
    assert s["step_ms"] == 20.0  # median of the steps after the first two (warm-up)
    assert s["tokens_per_sec"] == pytest.approx(1000.0 / 20.0)
    assert s["mfu"] is None and s["peak_mem_mb"] == 321.0 and s["state_mb"] == 7.5  # params, grads, AdamW
    assert s["all_gather_mb"] == 2.0 and s["reduce_scatter_mb"] == 1.0 and s["all_reduce_mb"] == 4.0 / 2**20
    # ddp's gradient all-reduce, which the counter cannot see, is its gradients' size (the loss's beside it)
    assert bench.summarize_run(rows, "ddp")["all_reduce_mb"] == 1.5 + 4.0 / 2**20
    assert s["loss"] == pytest.approx(3.6)
    assert s["host_ms"] == {"batch": 1.0, "forward_backward": 10.0, "clip": 1.0, "optimizer": 2.0}  # medians per phase
    assert s["page_faults"] == 60.0 and s["cpu_ms"] == 40.0
    runs = [s, s | {"step_ms": 40.0, "host_ms": {"batch": 1.5, "forward_backward": 30.0, "clip": 3.0, "optimizer": 4.0}}, s]
    assert bench.median_of(runs)["step_ms"] == 20.0 and bench.median_of(runs)["host_ms"]["optimizer"] == 2.0


@pytest.mark.parametrize("device,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12), ("NVIDIA H100 80GB HBM3", "float32", 494.5e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12), ("NVIDIA H100 NVL", "bfloat16", 835.5e12),
    ("NVIDIA H100 NVL", "float32", 417.5e12), ("NVIDIA H200", "float16", 989e12),
    ("NVIDIA A100-SXM4-40GB", "float32", 156e12), ("NVIDIA GeForce RTX 4090", "bfloat16", None)])
def test_mfu_divides_by_the_peak_of_the_runs_dtype(device, dtype, peak):
    """float32 matmuls run on TF32 tensor cores, at half the bf16 peak: against the bf16 peak
    an fp32 run's MFU read half what it was. An unlisted device has no MFU rather than a guess."""
    import observe
    assert observe.peak_flops(device, dtype) == peak


def test_tokens_per_sec_and_mfu_describe_the_median_step():
    """With an even count the median averages the middle two: 20 and 40 ms give 30 ms, and the
    median of 50 and 25 tokens/s (37.5) would not be 1000 / 30. Every figure is the median step's."""
    rows = [{"iter": i, "loss": 1.0, "dt_ms": dt, "tokens_per_sec": 1000.0 / dt, "mfu": 0.6 / dt,
             "host_ms": {}, "page_faults": 0, "cpu_ms": 0.0} for i, dt in enumerate([900.0, 500.0, 20.0, 40.0])]
    rows += [{"event": "memory", "stage": "after last step", "rss_mb": 1.0, "params_mb": 0, "grads_mb": 0, "optim_mb": 0},
             {"event": "comm_per_step", "all_gather_bytes": 0, "reduce_scatter_bytes": 0, "all_reduce_bytes": 0}]
    s = bench.summarize_run(rows, "fsdp")
    assert s["step_ms"] == 30.0
    assert s["tokens_per_sec"] == pytest.approx(1000.0 / 30.0) and s["mfu"] == pytest.approx(0.6 / 30.0)
    runs = [s, s | bench.at_step_ms(s, 60.0)]
    m = bench.median_of(runs)
    assert m["step_ms"] == 45.0 and m["tokens_per_sec"] == pytest.approx(1000.0 / 45.0) and m["mfu"] == pytest.approx(0.6 / 45.0)


@pytest.mark.parametrize("cuda", [True, False])
def test_table_prints_ratios_and_reserved_memory_on_cuda(cuda, capsys):
    def row(step_ms, peak, reserved, all_reduce_mb):
        return {"step_ms": step_ms, "tokens_per_sec": 1e5 / step_ms, "peak_mem_mb": peak, "state_mb": 10.0,
                "reserved_mb": reserved if cuda else None, "all_gather_mb": 0.0, "reduce_scatter_mb": 0.0,
                "all_reduce_mb": all_reduce_mb, "exposed_comm_ms": None, "hidden_fraction": None, "mfu": None,
                "exposed_by_place": None,
                "host_ms": {"batch": 0.2, "forward_backward": step_ms / 3, "clip": 0.5, "optimizer": peak / 3000},
                "page_faults": peak / 3, "cpu_ms": step_ms * 2}
    bench.print_table({"ddp": row(30.0, 9000.0, 9500.0, 1e-6), "custom_fsdp:wrap_policy=model": row(28.5, 8100.0, 8550.0, 2e-6)})
    header, base, ours, base_host, our_host, sizes_note, ddp_note = capsys.readouterr().out.splitlines()
    assert ("reserved MB" in header) == cuda
    assert ours.startswith("custom_fsdp:wrap_policy=model |") and "28.5 (0.95x)" in ours and "8,100.0 (0.90x)" in ours
    assert ("8,550.0 (0.90x)" in ours) == cuda
    assert "(2.00x)" not in ours  # no ratio between two figures that print as 0.0
    assert base_host == ("ddp: training-thread CPU ms per step: batch 0.2 (1.00x), forward_backward 10.0 (1.00x), clip 0.5 (1.00x), "
                         "optimizer 3.0 (1.00x); rank 0's process (all threads) CPU ms per step 60.0 (1.00x), "
                         "page faults per step 3,000")
    assert our_host.endswith("forward_backward 9.5 (0.95x), clip 0.5 (1.00x), optimizer 2.7 (0.90x); rank 0's "
                             "process (all threads) CPU ms per step 57.0 (0.95x), page faults per step 2,700")
    assert sizes_note.startswith("AG and RS MB/step: the size of each all-gather's output")
    assert ddp_note.startswith("ddp's AR MB/step: its gradients")


def test_table_says_where_exposed_communication_went(capsys):
    row = {"step_ms": 30.0, "tokens_per_sec": 1.0, "peak_mem_mb": 1.0, "state_mb": 1.0, "reserved_mb": None,
           "all_gather_mb": 1.0, "reduce_scatter_mb": 1.0, "all_reduce_mb": 0.0, "exposed_comm_ms": 12.0,
           "hidden_fraction": 0.9, "mfu": None, "host_ms": {p: 1.0 for p in bench.HOST_PHASES}, "page_faults": 0,
           "cpu_ms": 1.0, "exposed_by_place": {"fsdp::reduce_scatter_wait h.0": 9.75, overlap.OUTSIDE: 1.25}}
    bench.print_table({"custom_fsdp": row, "fsdp": row | {"exposed_by_place": {}}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == ("custom_fsdp: exposed communication ms per step, by where it went: "
                         "fsdp::reduce_scatter_wait h.0 9.8, (outside any range) 1.2")
    assert not any(line.startswith("ddp's AR") for line in lines)  # (no ddp row: no ddp note)
    assert not any(line.startswith("fsdp: exposed") for line in lines)  # nothing exposed: no line


def test_paired_ratios_divide_each_repeat_by_the_first_rows_run_beside_it(capsys):
    results = {"ddp": [{"step_ms": 100.0}, {"step_ms": 200.0}, {"step_ms": 100.0}],
               "custom_fsdp": [{"step_ms": 90.0}, {"step_ms": 220.0}, {"step_ms": 100.0}],
               "fsdp": [{"step_ms": 120.0}, {"step_ms": 240.0}, {"step_ms": 130.0}]}
    paired = bench.paired_step_ratios(results)
    assert list(paired) == ["custom_fsdp", "fsdp"]  # (the first row is the base)
    assert paired["custom_fsdp"] == pytest.approx([0.9, 1.1, 1.0]) and paired["fsdp"] == pytest.approx([1.2, 1.2, 1.3])
    bench.print_paired(paired, "ddp")
    ours, theirs = capsys.readouterr().out.splitlines()
    assert ours.endswith("custom_fsdp 0.90x 1.10x 1.00x (median 1.00x, range 0.90x-1.10x)")
    assert "(median 1.20x, range 1.20x-1.30x)" in theirs


def test_median_of_takes_each_host_phase_median_over_repeats():
    """The per-phase CPU times are medians over repeats too, not the first repeat's."""
    def run(step_ms, fb, clip):
        return {"step_ms": step_ms, "tokens_per_sec": 1e3 / step_ms, "mfu": None, "reserved_mb": None,
                "host_ms": {"batch": 0.1, "forward_backward": fb, "clip": clip, "optimizer": 1.0}, "cpu_ms": step_ms}
    m = bench.median_of([run(50.0, 40.0, 9.0), run(20.0, 10.0, 1.0), run(30.0, 20.0, 2.0)])
    assert m["host_ms"] == {"batch": 0.1, "forward_backward": 20.0, "clip": 2.0, "optimizer": 1.0}
    assert m["step_ms"] == 30.0 and m["cpu_ms"] == 30.0 and m["reserved_mb"] is None


def synthetic_run(dt_ms, state_mb, rss_mb):
    """metrics.jsonl rows of a run: 2 warm-up steps and 3 of `dt_ms`, with memory and comm events."""
    rows = [{"iter": i, "loss": 2.0, "dt_ms": dt, "tokens_per_sec": 1e3 / dt, "mfu": None, "host_ms": {},
             "page_faults": 0, "cpu_ms": dt} for i, dt in enumerate([500.0, 400.0] + [dt_ms] * 3)]
    return rows + [{"event": "memory", "stage": "after last step", "rss_mb": rss_mb, "params_mb": state_mb / 4,
                    "grads_mb": state_mb / 4, "optim_mb": state_mb / 2},
                   {"event": "comm_per_step", "all_gather_bytes": 0, "reduce_scatter_bytes": 0, "all_reduce_bytes": 0}]


def test_sweep_prints_each_world_size_against_world_size_1(tmp_path, capsys):
    """Per-rank state and step time at W are divided by the same backend's W=1 run; the peak is the run's own."""
    figures = {1: (100.0, 40.0, 700.0), 2: (60.0, 20.0, 500.0), 4: (50.0, 10.0, 300.0)}  # step ms, state MB, RSS MB
    args = mock.Mock(backends=["custom_fsdp"], steps=5, work_dir=str(tmp_path))
    with mock.patch.object(bench, "run_train", lambda row, w, *a, **k: synthetic_run(*figures[w])):
        out = bench.sweep(args, [])
    # the same global batch at every world size (4 micro-batches), unless the command sets its own
    def accumulation(extra):
        calls = []
        with mock.patch.object(bench, "run_train", lambda row, w, out, steps, extra: calls.append(
                bench.train_args(row, w, out, steps, extra)) or synthetic_run(*figures[w])):
            bench.sweep(args, extra)
        return [[a for a in c if a.startswith("--gradient_accumulation_steps=")][-1] for c in calls]
    assert accumulation(["--n_layer=2"]) == ["--gradient_accumulation_steps=4"] * 3
    assert accumulation(["--gradient_accumulation_steps=8"]) == ["--gradient_accumulation_steps=8"] * 3
    assert sorted(out["sweep"]) == ["custom_fsdp-w1", "custom_fsdp-w2", "custom_fsdp-w4"]
    assert out["sweep"]["custom_fsdp-w4"]["state_mb"] == 10.0 and out["sweep"]["custom_fsdp-w2"]["step_ms"] == 60.0
    lines = [line for line in capsys.readouterr().out.splitlines() if "W=" in line]
    assert lines[1].endswith("W=2: params+grads+optim 20.0 (0.50x) MB, peak 500 MB, step 60.0 (0.60x) ms"), lines
    assert lines[2].endswith("W=4: params+grads+optim 10.0 (0.25x) MB, peak 300 MB, step 50.0 (0.50x) ms"), lines


def test_bench_interleaves_the_rows_and_returns_the_table_it_prints(tmp_path, capsys):
    """Repeats run A B A B (drift hits both rows alike); the result written as JSON holds the
    settings, each row's medians over repeats and the paired ratios."""
    step = {("ddp", 0): 100.0, ("custom_fsdp", 0): 90.0, ("ddp", 1): 200.0, ("custom_fsdp", 1): 220.0,
            ("ddp", 2): 120.0, ("custom_fsdp", 2): 120.0}
    order = []

    def run_train(row, nproc, out, steps, extra):
        rep = int(out.rsplit("-r", 1)[1])
        order.append((row, rep, nproc, steps, tuple(extra)))
        return synthetic_run(step[row, rep], 8.0, 50.0)
    args = mock.Mock(backends=["ddp", "custom_fsdp"], repeats=3, nproc=2, steps=5, exposed=False, work_dir=str(tmp_path))
    with mock.patch.object(bench, "run_train", run_train):
        result = bench.bench_backends(args, ["--n_layer=2"])
    assert [o[:2] for o in order] == [("ddp", 0), ("custom_fsdp", 0), ("ddp", 1), ("custom_fsdp", 1),
                                      ("ddp", 2), ("custom_fsdp", 2)]
    assert all(o[2:] == (2, 5, ("--n_layer=2",)) for o in order)
    assert {k: result[k] for k in ("nproc", "repeats", "steps", "extra")} == {"nproc": 2, "repeats": 3, "steps": 5,
                                                                              "extra": ["--n_layer=2"]}
    assert list(result["backends"]) == ["ddp", "custom_fsdp"]
    assert result["backends"]["ddp"]["step_ms"] == 120.0 and result["backends"]["custom_fsdp"]["step_ms"] == 120.0
    assert result["backends"]["custom_fsdp"]["exposed_comm_ms"] is None  # (--exposed=False: no profiled run)
    assert result["step_ratio_per_repeat"] == {"custom_fsdp": [pytest.approx(0.9), pytest.approx(1.1), 1.0]}
    assert "(median 1.00x, range 0.90x-1.10x)" in capsys.readouterr().out
    json.dumps(result)  # (written as JSON as it is)


@pytest.mark.parametrize("mode,written", [([], "bench.json"), (["--sweep"], "sweep.json"), (["--comm"], "comm.json"),
                                          (["--host"], "host.json")])
def test_each_mode_writes_its_own_default_json(mode, written, tmp_path, capsys):
    result = {"mode": written}
    with mock.patch.object(bench, "bench_backends", return_value=result), \
            mock.patch.object(bench, "sweep", return_value=result), mock.patch.object(bench, "bench_comm", return_value=result), \
            mock.patch.object(bench, "bench_host", return_value=result), \
            mock.patch.object(sys, "argv", ["bench.py", *mode, f"--work_dir={tmp_path}"]):
        bench.main()
    assert os.listdir(tmp_path) == [written] and json.loads((tmp_path / written).read_text()) == result


def test_overlap_summary_is_the_mean_over_steps():
    rows = [{"step_ms": 10.0, "comm_ms": 4.0, "compute_ms": 8.0, "hidden_ms": 3.0, "exposed_ms": 1.0},
            {"step_ms": 20.0, "comm_ms": 6.0, "compute_ms": 16.0, "hidden_ms": 3.0, "exposed_ms": 3.0}]
    s = overlap.summarize(rows)
    assert s == {"step_ms": 15.0, "comm_ms": 5.0, "compute_ms": 12.0, "hidden_ms": 3.0, "exposed_ms": 2.0,
                 "hidden_fraction": pytest.approx(0.6)}
    assert overlap.summarize([]) == {}


def test_overlap_fsdp2_reduce_range_inside_an_enclosing_op_is_not_compute():
    # FSDP2's post-backward reduce blocks 40-60 inside an autograd node 0-100 while gloo works 40-60
    trace = {"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"),
        op("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 0, 100),
        op("FSDP::post_backward_reduce", 40, 20, cat="user_annotation"), op("gloo:reduce_scatter", 40, 20, tid=2),
    ]}
    (row,) = overlap.analyse(trace)
    assert row["compute_ms"] == pytest.approx(0.080) and row["exposed_ms"] == pytest.approx(0.020)


def test_communication_across_a_step_boundary_counts_in_each_step_only_its_part():
    # steps 0-100 and 100-200; the training thread computes 0-50 and 150-200; gloo works 80-120
    trace = {"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"), op("ProfilerStep#2", 100, 100, cat="user_annotation"),
        op("aten::mm", 0, 50), op("aten::mm", 150, 50), op("gloo:all_gather", 80, 40, tid=2),
    ]}
    first, second = overlap.analyse(trace)
    assert first["comm_ms"] == pytest.approx(0.020) and second["comm_ms"] == pytest.approx(0.020)
    assert first["compute_ms"] == pytest.approx(0.050) and second["compute_ms"] == pytest.approx(0.050)
    assert first["exposed_ms"] == pytest.approx(0.020) and second["exposed_ms"] == pytest.approx(0.020)
    assert overlap.exposed_by_place(trace) == {overlap.OUTSIDE: pytest.approx(0.020)}  # per step


def test_table_prints_a_hidden_fraction_of_zero_as_0_percent(capsys):
    row = {"step_ms": 30.0, "tokens_per_sec": 1.0, "peak_mem_mb": 1.0, "state_mb": 1.0, "reserved_mb": None,
           "all_gather_mb": 1.0, "reduce_scatter_mb": 1.0, "all_reduce_mb": 0.0, "exposed_comm_ms": 12.0,
           "hidden_fraction": 0.0, "mfu": None, "host_ms": {p: 1.0 for p in bench.HOST_PHASES}, "page_faults": 0,
           "cpu_ms": 1.0, "exposed_by_place": None}
    bench.print_table({"custom_fsdp": row, "fsdp": row | {"hidden_fraction": None}})
    _, ours, theirs, *_ = capsys.readouterr().out.splitlines()
    assert ours.split(" | ")[-2].strip() == "0%" and theirs.split(" | ")[-2].strip() == "-"


def shard_numel(shapes, world):
    """Per-rank elements of one unit: every parameter padded to ceil(dim0 / W) rows."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes)


@pytest.mark.parametrize("backend,W", [("fsdp", 2), ("custom_fsdp", 2), ("custom_fsdp", 3)])
def test_collective_bytes_per_step_match_the_formula(backend, W, char_data, tmp_path):
    """Counted by train.py's CommCounter; expected from the model's shapes (float32, padded rows).
    custom_fsdp on gloo: W=2 exchanges both ways; W=3 all-gathers by exchange (two messages per
    rank, counted once) and reduce-scatters with gloo's collective."""
    L, C, V, T, steps, micro = 2, 32, 65, 32, 3, 2
    res = run_train(tmp_path, W, f"--data_dir={char_data}", f"--n_layer={L}", "--n_head=2", f"--n_embd={C}",
                    f"--block_size={T}", "--batch_size=2", "--bias=True", f"--max_iters={steps}",
                    f"--gradient_accumulation_steps={W * micro}", "--eval_iters=1", f"--dist_backend={backend}")
    assert res.returncode == 0, res.describe()
    block = [(3 * C, C), (3 * C,), (C, C), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,), (C,), (C,), (C,), (C,)]
    root = [(V, C), (T, C), (C,), (C,)]  # wte (tied with lm_head), wpe, ln_f weight and bias
    ag = lambda shapes: W * shard_numel(shapes, W) * 4  # bytes of one unit's gathered buffer
    # the root and the last block are gathered once (kept for backward), the other blocks twice
    per_micro = ag(root) + ag(block) + 2 * (L - 1) * ag(block)
    # iteration 0 follows the evaluation at iteration 0, which left the root and the last block gathered
    expected_ag = (steps * micro * per_micro - ag(root) - ag(block)) / steps
    expected_rs = ag(root) + L * ag(block)  # once per step; its input is the unsharded gradient
    with open(tmp_path / "metrics.jsonl") as f:
        comm = next(r for r in map(json.loads, f) if r.get("event") == "comm_per_step")
    assert comm["all_gather_bytes"] == pytest.approx(expected_ag, rel=1e-12)
    assert comm["all_gather_count"] == pytest.approx((steps * micro * 2 * L - 2) / steps, rel=1e-12)
    # (custom_fsdp's point-to-point exchanges on gloo count as the collectives they stand for)
    assert comm["reduce_scatter_bytes"] == expected_rs
    assert comm["reduce_scatter_count"] == L + 1


@pytest.mark.parametrize("nproc,exposed", [(2, True), (1, False)])
def test_bench_table_has_every_backend_and_consistent_fields(nproc, exposed, char_data, tmp_path):
    """bench.py end to end on a tiny model: one row per backend, ratios' base first, the two FSDP
    backends moving the same bytes, and the profiled run's exposed communication only when asked."""
    out = tmp_path / "bench.json"
    res = launch([sys.executable, REPO / "bench.py", "--backends=custom_fsdp,fsdp", f"--nproc={nproc}",
                  "--repeats=1", "--steps=4", f"--exposed={exposed}", f"--work_dir={tmp_path}", f"--json={out}",
                  f"--data_dir={char_data}", "--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=32",
                  "--block_size=32", "--batch_size=2", "--eval_iters=0"], timeout=300)
    assert res.returncode == 0, res.describe()
    table = json.loads(out.read_text())
    assert table["nproc"] == nproc and list(table["backends"]) == ["custom_fsdp", "fsdp"]
    ours, theirs = table["backends"]["custom_fsdp"], table["backends"]["fsdp"]
    for row in (ours, theirs):
        assert row["step_ms"] > 0 and row["tokens_per_sec"] > 0 and row["peak_mem_mb"] > 0
        assert row["mfu"] is None  # no peak FLOP/s on CPU
        assert (row["exposed_comm_ms"] is not None) == exposed and (row["hidden_fraction"] is not None) == exposed
        assert row["host_ms"]["forward_backward"] > 0 and row["host_ms"]["optimizer"] > 0
        assert row["page_faults"] >= 0 and row["cpu_ms"] > 0
        if exposed:  # the largest places, in ms per step, largest first, then the others': the exposed time
            places = list(row["exposed_by_place"].values())
            listed = places[:overlap.TOP_PLACES]
            assert listed == sorted(listed, reverse=True) and len(places) <= overlap.TOP_PLACES + 1
            assert sum(places) == pytest.approx(row["exposed_comm_ms"])
        else:
            assert row["exposed_by_place"] is None
    assert ours["state_mb"] == theirs["state_mb"]  # the same shards and AdamW state
    assert ours["all_gather_mb"] == theirs["all_gather_mb"] and ours["reduce_scatter_mb"] == theirs["reduce_scatter_mb"]
    assert (ours["all_gather_mb"] > 0) == (nproc > 1)  # one rank: nothing to communicate
    assert "custom_fsdp" in res.stdout and "ratios vs custom_fsdp" in res.stdout
    # one repeat: the paired ratio is the ratio of the two rows' step times
    assert table["step_ratio_per_repeat"] == {"fsdp": [pytest.approx(theirs["step_ms"] / ours["step_ms"])]}


def test_sweep_state_falls_as_one_over_world_size(char_data, tmp_path):
    """bench.py --sweep: each rank's parameters, gradients and AdamW state at W=1, 2, 4 are 1/W of
    the whole, up to the padding of each parameter's rows (the largest rank's share is reported)."""
    out = tmp_path / "sweep.json"
    res = launch([sys.executable, REPO / "bench.py", "--sweep", "--backends=custom_fsdp", "--steps=3",
                  f"--work_dir={tmp_path}", f"--json={out}", f"--data_dir={char_data}", "--device=cpu",
                  "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2"], timeout=300)
    assert res.returncode == 0, res.describe()
    sweep = json.loads(out.read_text())["sweep"]
    state = {w: sweep[f"custom_fsdp-w{w}"]["state_mb"] for w in (1, 2, 4)}
    for w in (2, 4):
        assert state[1] / w <= state[w] <= 1.03 * state[1] / w, state
    assert "custom_fsdp  W=4: params+grads+optim" in res.stdout


def test_bench_rows_carry_their_own_settings(char_data, tmp_path):
    """A --backends entry with settings after colons runs with them: ZeRO-2 (no reshard after
    forward) skips the backward all-gathers, so its row moves fewer all-gather bytes than the
    default row of the same backend and the same reduce-scatter bytes. (With an evaluation at
    the end, which would save a checkpoint in a training run: benchmark runs save none.) Run from
    another folder than the repository's, with a relative --work_dir, which is the caller's folder's
    (train.py ran in the repository and wrote its runs there, where bench.py did not look)."""
    out = tmp_path / "bench.json"
    zero2 = "custom_fsdp:reshard_after_forward=False"
    res = launch([sys.executable, REPO / "bench.py", f"--backends=custom_fsdp,{zero2}", "--nproc=2",
                  "--repeats=1", "--steps=4", "--exposed=False", "--work_dir=runs", "--json=bench.json",
                  f"--data_dir={char_data}", "--device=cpu", "--n_layer=3", "--n_head=2", "--n_embd=32",
                  "--block_size=32", "--batch_size=2", "--eval_iters=1"], timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.describe()
    assert (tmp_path / "runs" / "custom_fsdp-r0" / "metrics.jsonl").exists()
    assert not list(tmp_path.glob("runs/*/ckpt-*"))
    rows = json.loads(out.read_text())["backends"]
    assert list(rows) == ["custom_fsdp", zero2]
    assert rows[zero2]["all_gather_mb"] < rows["custom_fsdp"]["all_gather_mb"]
    assert rows[zero2]["reduce_scatter_mb"] == rows["custom_fsdp"]["reduce_scatter_mb"]


@pytest.mark.parametrize("args,problem", [(["--backends=custom_fsdp:prefetch"], "not key=value"),
                                          (["--backends=fsdp,fsdp"], "twice"),
                                          (["--nproc=0"], "--nproc=0: at least 1"),
                                          (["--repeats=0"], "--repeats=0: at least 1"),
                                          (["--sweep", "--nproc=3"], "--nproc=3: --sweep runs world sizes 1, 2 and 4")])
def test_bench_rejects_bad_arguments_before_running(args, problem, tmp_path):
    res = subprocess.run([sys.executable, REPO / "bench.py", *args, f"--work_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and problem in res.stderr.splitlines()[-1]
    assert not any(tmp_path.iterdir())  # nothing ran


def test_bench_passes_on_train_py_refusal_as_its_one_line(char_data, tmp_path):
    """A setting train.py refuses (here a misspelt key) stops bench.py with train.py's reason in one
    line, not torchrun's traceback. (bench.py takes no abbreviations of its own options: `--step`
    is not its `--steps`.)"""
    res = launch([sys.executable, REPO / "bench.py", "--backends=ddp,custom_fsdp", "--nproc=2", "--repeats=1",
                  "--steps=3", f"--work_dir={tmp_path}", f"--data_dir={char_data}", "--device=cpu", "--step=3"],
                 timeout=120)
    assert res.returncode != 0
    assert res.stderr.splitlines() == ["error: ddp at 2 processes: unknown config key 'step' (bench.py passes the "
                                       "flags it does not take to train.py)"], res.describe()


def test_train_writes_traces_memory_reports_and_a_memory_trace(char_data, tmp_path):
    res = run_train(tmp_path, 2, f"--data_dir={char_data}", "--n_layer=2", "--n_head=2", "--n_embd=32",
                    "--block_size=32", "--batch_size=2", "--max_iters=6", "--eval_iters=1",
                    "--dist_backend=custom_fsdp", "--profile=True", "--memory_snapshot=True")
    assert res.returncode == 0, res.describe()
    assert "leaves out the thread that moves fsdp_impl's bytes" in res.stdout  # (both flags on CPU)
    assert f"wrote {tmp_path / 'traces' / 'custom_fsdp' / 'rank0.json'}, {tmp_path / 'memory' / 'rank0.json'} " \
        in res.stdout, res.stdout  # where to look
    for rank in (0, 1):
        with open(tmp_path / "traces" / "custom_fsdp" / f"rank{rank}.json") as f:
            trace = json.load(f)
        rows = overlap.analyse(trace)
        assert len(rows) == 3 and all(r["comm_ms"] > 0 and r["compute_ms"] > 0 for r in rows)
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"fsdp::all_gather transformer.h.0", "fsdp::reduce_scatter root"} <= names  # named FSDP phases
        # each unit's forward and backward are ranges too, once per micro-step: the root's forward
        # encloses the blocks', which run in order; backward runs them in reverse
        spans = {}
        for e in trace["traceEvents"]:
            if e.get("ph") == "X" and e.get("name", "").startswith(("fsdp::forward ", "fsdp::backward ")):
                spans.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
        order = [sorted(spans[f"fsdp::{phase} {unit}"]) for phase, unit in (
            ("forward", "root"), ("forward", "transformer.h.0"), ("forward", "transformer.h.1"),
            ("backward", "transformer.h.1"), ("backward", "transformer.h.0"))]
        assert len({len(s) for s in order}) == 1 and len(order[0]) >= 3  # three profiled steps
        for root, f0, f1, b1, b0 in zip(*order):
            assert root[0] <= f0[0] <= f0[1] <= f1[0] <= f1[1] <= root[1] <= b1[0] <= b1[1] <= b0[0]
        with open(tmp_path / "memory" / f"rank{rank}.json") as f:
            assert any(e.get("name") == "[memory]" for e in json.load(f)["traceEvents"])
    with open(tmp_path / "metrics.jsonl") as f:
        memory = [r for r in map(json.loads, f) if r.get("event") == "memory"]
    assert [r["stage"] for r in memory] == ["after model creation", "after first step", "after last step", "end"]
    assert all(r["rss_mb"] > 0 and r["params_mb"] > 0 for r in memory)
    # the steps' reports come before zero_grad: the local gradient shards are there (unpadded)
    assert [r["grads_mb"] > 0 for r in memory] == [False, True, True, False]
    assert memory[2]["grads_mb"] <= memory[2]["params_mb"]
    # AdamW: two moments per parameter (plus a 4-byte step counter each)
    assert memory[-1]["optim_mb"] == pytest.approx(2 * memory[-1]["params_mb"], abs=1e-3)


CHECKPOINT_COLLECTIVES = {"c10d::barrier", "c10d::broadcast_", "c10d::scatter_", "c10d::gather_"}  # DCP's save


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "custom_fsdp"])
def test_profiled_steps_hold_training_steps_only_and_enclose_their_logged_time(backend, char_data, tmp_path):
    """Steps 2-4 are profiled, with an evaluation and a checkpoint save at iteration 3 between
    steps 2 and 3: each ProfilerStep#k range holds iteration k's forward/backward/optimizer only
    (its micro-batches' losses, no checkpoint collectives), the evaluation and save lie in the
    trace outside every range, and each step's logged dt_ms lies inside its range, so the trace's
    export (after the window's last step) is in no step's time."""
    res = run_train(tmp_path, 2, f"--data_dir={char_data}", *TINY, "--max_iters=6", "--eval_interval=3",
                    f"--dist_backend={backend}", "--profile=True")
    assert res.returncode == 0, res.describe()
    local_steps, evals_per_split = 4 // 2, 1  # gradient_accumulation_steps=4 on 2 ranks; eval_iters=2
    dt_ms = {r["iter"]: r["dt_ms"] for r in map(json.loads, (tmp_path / "metrics.jsonl").open()) if "dt_ms" in r}
    for rank in (0, 1):
        path = tmp_path / "traces" / backend / f"rank{rank}.json"
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
        assert [s["name"] for s in steps] == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
        main = [e for e in events if e["tid"] == steps[0]["tid"]]  # the training thread
        for s in steps:
            names = [e["name"] for e in main if s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
            assert names.count("aten::cross_entropy_loss") == local_steps  # one per micro-batch: no evaluation
            assert sum(n.startswith("Optimizer.step#") for n in names) == 1  # (#<its class>.step)
            assert not CHECKPOINT_COLLECTIVES & set(names)
        if backend == "custom_fsdp":  # its exchanges (through shared memory) are in the steps, on comm.py's posting thread
            moves = [e for e in events if e["name"].startswith("shm:") and any(
                s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps)]
            assert {e["name"] for e in moves} == {"shm:all_gather", "shm:reduce_scatter"}
            assert all(e["tid"] != steps[0]["tid"] for e in moves)
        between = [e["name"] for e in main if not any(s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps)]
        assert between.count("aten::cross_entropy_loss") == 2 * evals_per_split  # iteration 3's evaluation
        assert CHECKPOINT_COLLECTIVES <= set(between)  # and its save
        if rank == 0:  # (rank 0 logs): the clocks of time.time() and the profiler may differ by far under 0.5 ms
            for s in steps:
                assert dt_ms[int(s["name"].split("#")[1])] <= s["dur"] / 1e3 + 0.5, (s, dt_ms)
    cli = subprocess.run([sys.executable, "-m", "fsdp_impl.overlap", str(tmp_path / "traces" / backend / "rank0.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    path, *step_lines, places_header = cli.stdout.splitlines()[:5]
    assert [line.split(":")[0].strip() for line in step_lines] == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    assert places_header.strip() == "exposed ms per step, by where it went:"


@pytest.mark.parametrize("max_iters,recorded", [(2, []), (3, ["ProfilerStep#2"])])
def test_a_run_shorter_than_the_profiled_window_says_so_or_traces_what_it_reached(max_iters, recorded, char_data,
                                                                                 tmp_path):
    res = run_train(tmp_path, None, f"--data_dir={char_data}", *TINY, f"--max_iters={max_iters}", "--profile=True")
    assert res.returncode == 0, res.describe()
    notes = [line for line in res.stdout.splitlines() if "nothing recorded" in line]
    trace = tmp_path / "traces" / "ddp" / "rank0.json"
    if not recorded:
        assert len(notes) == 1 and "--profile=True" in notes[0] and "trained 2 step(s)" in notes[0], res.stdout
        assert not trace.exists()
    else:
        assert not notes
        assert [r["step"] for r in overlap.analyse(overlap.load(trace))] == recorded


def test_comm_benchmark_times_every_collective_with_consistent_bandwidth(tmp_path):
    """`bench.py --comm`: each collective (fsdp_impl's all-gather and reduce-scatter included, on CPU also
    with gloo's messages) at each size, bus bandwidth = the bytes each rank moves / time ((W-1)/W of the
    buffer, 2(W-1)/W for all-reduce), and the process's CPU time per call. W=3, where (W-1)/W, 1/W
    and 2(W-1)/W all differ (at W=2 the first two are both 1/2), and a buffer cut to a multiple of W."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "comm.json"
    w = 3
    proc = subprocess.run([sys.executable, "bench.py", "--comm", f"--nproc={w}", "--comm_mb=1,4", f"--json={out}"],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["comm"]
    part = (w - 1) / w  # of the buffer, each rank's all-gather or reduce-scatter
    moved = {"all_gather": part, "ag_fsdp_impl": part, "ag_fsdp_impl_msgs": part, "reduce_scatter": part,
             "rs_fsdp_impl": part, "rs_fsdp_impl_msgs": part, "all_reduce": 2 * part}
    assert sorted((r["op"], r["mb"]) for r in rows) == sorted((op, mb) for op in moved for mb in (1, 4))
    for r in rows:
        assert r["ms"] > 0 and r["cpu_ms"] > 0
        numel = r["mb"] * 2**20 // 4
        full_bytes = (numel - numel % w) * 4  # (a whole MB of floats is no multiple of 3: cut to one)
        assert r["busbw_gbps"] * 1e9 * r["ms"] / 1e3 == pytest.approx(full_bytes * moved[r["op"]], rel=1e-9)


def run_snippet(code, arg):
    """Run `code` in a fresh interpreter at the repo root (its own glibc heap); its stdout."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", code, str(arg)], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


def test_observer_counts_the_page_faults_of_a_step(tmp_path):
    """train.py's page_faults: the pages a step touched afresh. A step that writes a new 64 MB
    mapping faults in each of its 16,384 pages; one that allocates nothing faults (almost) none."""
    import mmap
    import torch
    import observe
    obs = observe.Observer(str(tmp_path), "ddp", 0, "cpu", profile=False, memory_snapshot=False)
    obs.before_step()
    obs.after_step()
    quiet = obs.page_faults
    obs.before_step()
    fresh = mmap.mmap(-1, 64 * 2**20)
    torch.frombuffer(fresh, dtype=torch.uint8).fill_(1)  # (in place: a 64 MB bytes object would fault too)
    obs.after_step()
    assert quiet < 1000 and obs.page_faults >= 16384, (quiet, obs.page_faults)
    fresh.close()


def test_observer_counts_the_cpu_time_of_every_thread_in_a_step(tmp_path):
    """train.py's cpu_ms: the process's CPU time in a step, not only the training thread's. A helper
    thread that computes for 200 ms of its own CPU time while the training thread sleeps puts at
    least that much in the step; the training thread's own clock sees almost none of it."""
    import threading
    import observe
    obs = observe.Observer(str(tmp_path), "ddp", 0, "cpu", profile=False, memory_snapshot=False)

    def busy():
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass

    obs.before_step()
    main_before = time.thread_time()
    helper = threading.Thread(target=busy)
    helper.start()
    helper.join()
    main_ms = (time.thread_time() - main_before) * 1e3
    obs.after_step()
    assert obs.cpu_ms >= 200 and main_ms < 100, (obs.cpu_ms, main_ms)


def test_observer_host_time_is_the_training_threads_cpu_time_of_this_step(tmp_path):
    """train.py's host_ms: per phase, the training thread's own CPU time in this step. A phase that
    computes 100 ms counts them; in the next step the same phase, which sleeps 200 ms while another
    thread computes 200 ms, counts (almost) nothing: not the wall-clock time, not the other threads'
    CPU, not the earlier step's."""
    import threading
    import observe
    obs = observe.Observer(str(tmp_path), "ddp", 0, "cpu", profile=False, memory_snapshot=False)

    def busy(seconds):
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    obs.before_step()
    with obs.host_time("forward_backward"):
        busy(0.1)
    obs.after_step()
    computed = obs.host_ms["forward_backward"]
    obs.before_step()
    with obs.host_time("forward_backward"):
        helper = threading.Thread(target=busy, args=(0.2,))
        helper.start()
        time.sleep(0.2)
        helper.join()
    obs.after_step()
    assert computed >= 100 and set(obs.host_ms) == {"forward_backward"}, (computed, obs.host_ms)
    assert obs.host_ms["forward_backward"] < 50, obs.host_ms


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_observer_rss_is_this_process_peak_in_mb():
    """rss_mb (the memory rows' rss_mb, and peak_mem_mb on CPU): this process's peak resident set in
    MB, as the kernel's VmHWM (KiB) gives it (with 64 MB of its own touched)."""
    import torch
    import observe

    def vm_hwm_mb():
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]) / 1024
    held = torch.ones(16 * 2**20)  # noqa: F841 (64 MB, alive through both readings)
    before, mine, after = vm_hwm_mb(), observe.rss_mb(), vm_hwm_mb()
    assert before - 1 <= mine <= after + 1, (before, mine, after)
    assert mine >= 64, mine


@pytest.mark.parametrize("posting", [False, True])
def test_memory_trace_notice_only_where_messages_are_posted_off_the_training_thread(posting, tmp_path, capsys):
    """--profile with --memory_snapshot on CPU records allocations, which leaves out other threads:
    the run says so exactly when fsdp_impl's posting thread carries its messages (custom_fsdp on
    gloo at W>1), not for DDP, FSDP2 or a one-rank run, whose communication the trace still sees."""
    import observe
    from fsdp_impl import comm
    obs = observe.Observer(str(tmp_path), "custom_fsdp", 0, "cpu", profile=True, memory_snapshot=True)
    obs.steps = observe.PROFILE_STEPS[0]
    with mock.patch.object(comm, "_poster", object() if posting else None):
        obs.before_step()
    obs.after_step()
    obs.finish()
    assert ("leaves out the thread that moves fsdp_impl's bytes" in capsys.readouterr().out) == posting
    assert (tmp_path / "traces" / "custom_fsdp" / "rank0.json").exists()


RETAINED_AFTER_FREE = """
import sys, torch, backends
backends.set_malloc_mmap_threshold(float(sys.argv[1]))
anon = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) // 1024
first = torch.ones(24 * 2**18)  # 24 MB, mapped; freeing it raises glibc's dynamic threshold to 24 MB
del first
base = anon()
buffer = torch.ones(16 * 2**18)  # 16 MB: the heap under a raised threshold, its own mapping under 4 MB
later = torch.ones(1024)  # allocated after it, so the heap cannot shrink past it
del buffer
print(anon() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_malloc_threshold_returns_freed_buffers_to_the_os():
    """train.py's malloc_mmap_threshold_mb on CPU: a freed 16 MB buffer leaves the process (4 MB)
    instead of staying in glibc's heap (0: glibc's dynamic default)."""
    retained = {mb: int(run_snippet(RETAINED_AFTER_FREE, mb)) for mb in (0, 4)}
    assert retained[0] >= 12, retained
    assert retained[4] <= 2, retained


REFAULTED = """
import ctypes, resource, sys, backends
backends.set_malloc_mmap_threshold(float(sys.argv[1]))
libc = ctypes.CDLL(None)  # glibc's malloc itself: torch's own small allocations would land above the buffers
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # 320 MB of 1 MB buffers, written and freed, as a step's activations at the heap's top
    buffers = [libc.malloc(2**20) for _ in range(320)]
    for buffer in buffers:
        ctypes.memset(buffer, 1, 2**20)
    for buffer in buffers:
        libc.free(buffer)
step(), step()
before = faults()
step()
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_malloc_threshold_32_keeps_a_freed_heap_top_for_the_next_step():
    """train.py's default malloc_mmap_threshold_mb=32 on CPU: what a step frees at the top of glibc's
    heap stays for the next step, also when it is more than the 256 MB this setting used to keep
    (a 201M model's step freed more, and faulted 62,000 pages in again every step). Against a
    threshold below the buffers' size (0.25 MB), under which each step maps them afresh and
    faults all 320 MB in again (81,920 pages). (Not against glibc's own dynamic thresholds, 0:
    what they do depends on what the interpreter freed before, and a 64 MB step faulted 256 to
    16,353 pages from one run to the next.)"""
    faults = {mb: int(run_snippet(REFAULTED, mb)) for mb in (0.25, 32)}
    assert faults[0.25] >= 60000, faults
    assert faults[32] <= 2000, faults


RETAINED_HOLES = """
import sys, torch, backends
anon = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) // 1024
base = anon()
pieces = [torch.ones(2**14) for _ in range(2000)]  # 64 KB each: glibc's heap, about 125 MB
kept = pieces[::20]  # every 20th stays alive, so the freed ones are holes the heap cannot shrink past
del pieces
holes = anon() - base
released = backends.trim_malloc_heap() if sys.argv[1] == "trim" else False
print(holes, anon() - base, released)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_malloc_trim_returns_heap_holes_to_the_os():
    """train.py's malloc_trim=True (after every step on CPU): freed memory in the middle of glibc's heap
    stays resident until trimmed, and is given back when it is."""
    out = {mode: run_snippet(RETAINED_HOLES, mode).split() for mode in ("keep", "trim")}
    holes, after, released = out["keep"]
    assert int(holes) >= 100 and int(after) >= 100 and released == "False", out
    holes, after, released = out["trim"]
    assert int(holes) >= 100 and int(after) <= 20 and released == "True", out


def test_a_config_file_sets_the_benchmarked_model(tmp_path):
    """bench.py's default model yields to a config file's (its --key=value flags beat any file, so
    the file's model was benchmarked as 4 x 256); no evaluation or checkpoints either way, and a
    row's own settings still win."""
    import configurator
    config = tmp_path / "wide.py"
    config.write_text("n_layer = 6\nn_embd = 384\nbatch_size = 2\neval_iters = 50\n")

    def settings(extra, row="ddp"):
        train_globals = dict(n_layer=12, n_head=12, n_embd=768, batch_size=12, block_size=1024, dropout=0.1,
                             compile=True, eval_iters=200, log_interval=10, keep_checkpoints=2,
                             gradient_accumulation_steps=40, dist_backend="ddp", out_dir="out", max_iters=600000,
                             eval_interval=2000, profile=False, prefetch=True)
        configurator.apply(train_globals, bench.train_args(row, 2, "o", 5, extra))
        return train_globals
    default, from_file = settings([]), settings([str(config)], row="custom_fsdp:n_layer=3")
    assert (default["n_layer"], default["n_embd"], default["batch_size"], default["compile"]) == (4, 256, 8, False)
    assert (from_file["n_layer"], from_file["n_embd"], from_file["batch_size"], from_file["n_head"]) == (3, 384, 2, 12)
    for run in (default, from_file):
        assert (run["eval_iters"], run["keep_checkpoints"], run["gradient_accumulation_steps"]) == (0, 0, 2)


def test_host_mode_charges_each_backend_its_difference_per_unit(tmp_path):
    """bench.py --host: every row's model in one process, steps interleaved; the units are none for
    DDP's plain model, a block each plus the root for the FSDPs, one under wrap_policy='model' (a
    row's own setting), and the per-unit figure is the row's forward and backward over the first
    row's, divided by its units."""
    out = tmp_path / "host.json"
    one_unit = "custom_fsdp:wrap_policy=model"
    res = launch([sys.executable, REPO / "bench.py", "--host", f"--backends=ddp,custom_fsdp,fsdp,{one_unit}",
                  "--steps=5", f"--json={out}", "--n_layer=2", "--vocab_size=50"], timeout=300)
    assert res.returncode == 0, res.describe()
    result = json.loads(out.read_text())
    rows = result["backends"]
    assert result["steps"] == 5 and list(rows) == ["ddp", "custom_fsdp", "fsdp", one_unit]
    assert [r["units"] for r in rows.values()] == [0, 3, 3, 1]
    base = rows["ddp"]["forward_backward_ms"]
    assert rows["ddp"]["forward_backward_ms_per_unit_vs_first"] is None
    for r in list(rows.values())[1:]:
        assert r["forward_backward_ms"] > 0 and r["optimizer_ms"] > 0
        assert r["forward_backward_ms_per_unit_vs_first"] == pytest.approx((r["forward_backward_ms"] - base) / r["units"])
    assert "per unit vs ddp" in res.stdout and "n_layer=2" in res.stdout and "vocab_size=50" in res.stdout


@pytest.mark.parametrize("flags,message", [
    (["--nproc=2"], "no --nproc, --repeats or --exposed"), (["--exposed=False"], "no --nproc, --repeats or --exposed"),
    (["--sweep"], "separate modes"), (["--n_layers=2"], "unknown config key 'n_layers'"),
    (["--n_head=3"], "n_embd=32 is not divisible by n_head=3"), (["--device=tpu"], "unknown device 'tpu'"),
    (["--backends=ddp,custom_fsdp:block_size=8"], "custom_fsdp:block_size=8 sets block_size=8 for itself"),
    (["--backends=ddp,fsdp:wrap_policy=layer"], "fsdp:wrap_policy=layer: unknown wrap_policy 'layer'")])
def test_host_mode_refuses_what_it_does_not_take(flags, message):
    """One line and exit 2: flags of the other modes, bad settings, and a row's own model shape, batch or
    device (one input serves every row)."""
    res = launch([sys.executable, REPO / "bench.py", "--host", "--backends=ddp", "--steps=3", *flags], timeout=120)
    assert res.returncode == 2 and message in res.stderr, res.describe()
    assert "Traceback" not in res.stderr
