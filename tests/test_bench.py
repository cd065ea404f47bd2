"""bench.py and the trace analyser, checked without timing: synthetic traces with known overlap,
table fields and markdown on synthetic metrics, and collective bytes per step against the formula;
and what train.py records for them (traces, memory, host time)."""
import json
import math
import os
import subprocess
import sys
import re
import shlex
import time

import pytest
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import backends  # noqa: E402
import bench  # noqa: E402
from conftest import CACHE, REPO, TINY, launch, run_train  # noqa: E402
import overlap  # noqa: E402


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
              "host_ms": {"batch": dt / 20, "forward_backward": dt / 2, "clip": 1.0, "optimizer": dt / 10}}
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
    assert s["comm_mb"] == 3.0 + 4.0 / 2**20  # the three summed: the table's comm MB/step
    # ddp's gradient all-reduce, which the counter cannot see, is its gradients' size (the loss's beside it)
    ddp = bench.summarize_run(rows, "ddp")
    assert ddp["all_reduce_mb"] == 1.5 + 4.0 / 2**20 and ddp["comm_mb"] == 4.5 + 4.0 / 2**20
    assert s["loss"] == pytest.approx(3.6)
    assert s["host_ms"] == {"batch": 1.0, "forward_backward": 10.0, "clip": 1.0, "optimizer": 2.0}  # medians per phase
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
    rows = [{"iter": i, "loss": 1.0, "dt_ms": dt, "tokens_per_sec": 1000.0 / dt, "mfu": 0.6 / dt, "host_ms": {}}
            for i, dt in enumerate([900.0, 500.0, 20.0, 40.0])]
    rows += [{"event": "memory", "stage": "after last step", "rss_mb": 1.0, "params_mb": 0, "grads_mb": 0, "optim_mb": 0},
             {"event": "comm_per_step", "all_gather_bytes": 0, "reduce_scatter_bytes": 0, "all_reduce_bytes": 0}]
    s = bench.summarize_run(rows, "fsdp")
    assert s["step_ms"] == 30.0
    assert s["tokens_per_sec"] == pytest.approx(1000.0 / 30.0) and s["mfu"] == pytest.approx(0.6 / 30.0)
    runs = [s, s | bench.at_step_ms(s, 60.0)]
    m = bench.median_of(runs)
    assert m["step_ms"] == 45.0 and m["tokens_per_sec"] == pytest.approx(1000.0 / 45.0) and m["mfu"] == pytest.approx(0.6 / 45.0)


def test_median_of_takes_each_host_phase_median_over_repeats():
    """The per-phase CPU times are medians over repeats too, not the first repeat's."""
    def run(step_ms, fb, clip):
        return {"step_ms": step_ms, "tokens_per_sec": 1e3 / step_ms, "mfu": None, "reserved_mb": None,
                "host_ms": {"batch": 0.1, "forward_backward": fb, "clip": clip, "optimizer": 1.0}}
    m = bench.median_of([run(50.0, 40.0, 9.0), run(20.0, 10.0, 1.0), run(30.0, 20.0, 2.0)])
    assert m["host_ms"] == {"batch": 0.1, "forward_backward": 20.0, "clip": 2.0, "optimizer": 1.0}
    assert m["step_ms"] == 30.0 and m["reserved_mb"] is None


def table_row(step_ms=30.0, peak=9000.0, reserved=None, comm=(1.0, 1.0, 0.0), exposed=None, hidden=None,
              by_place=None, mfu=None):
    """A row of bench_backends' table, as median_of and the profiled run make it."""
    ag, rs, ar = comm
    return {"step_ms": step_ms, "tokens_per_sec": 1e5 / step_ms, "mfu": mfu, "peak_mem_mb": peak,
            "reserved_mb": reserved, "state_mb": 10.0, "all_gather_mb": ag, "reduce_scatter_mb": rs,
            "all_reduce_mb": ar, "comm_mb": ag + rs + ar, "loss": 2.0,
            "host_ms": {"batch": 0.2, "forward_backward": step_ms / 3, "clip": 0.5, "optimizer": peak / 3000},
            "exposed_comm_ms": exposed, "comm_ms": None, "hidden_fraction": hidden, "exposed_by_place": by_place}


def test_table_has_the_five_figures_with_ratios_then_the_paired_line():
    """The default output: one table (step ms, tokens/s, peak MB, comm MB/step, exposed comm ms, each
    with its ratio to the first row) and one line of the paired per-repeat ratios, median and range."""
    table = {"ddp": table_row(30.0, 9000.0, comm=(0.0, 0.0, 12.0), exposed=4.0),
             "fsdp": table_row(39.3, 8100.0, comm=(12.0, 12.0, 0.0), exposed=6.0),
             "custom_fsdp": table_row(28.5, 7200.0, comm=(12.0, 12.0, 1e-6), exposed=None)}
    paired = {"fsdp": [1.28, 1.31, 1.35], "custom_fsdp": [0.99, 1.02, 1.05]}
    header, ddp, fsdp, ours, line = bench.main_lines(table, paired)
    assert [c.strip() for c in header.split(" | ")] == ["backend", "step ms", "tokens/s", "peak MB", "comm MB/step",
                                                         "exposed comm ms"]
    assert [c.strip() for c in ours.split(" | ")] == ["custom_fsdp", "28.5 (0.95x)", "3,509 (1.05x)", "7,200 (0.80x)",
                                                       "24.0 (2.00x)", "-"]
    assert [c.strip() for c in fsdp.split(" | ")][-1] == "6.0 (1.50x)" and ddp.split(" | ")[1].strip() == "30.0 (1.00x)"
    assert line == ("step time vs ddp, each repeat's run beside it: fsdp 1.31x (1.28x-1.35x), "
                    "custom_fsdp 1.02x (0.99x-1.05x)")
    assert len({len(row) for row in (header, ddp, fsdp, ours)}) == 1  # (aligned)
    # one repeat: its ratio, no range; one row: nothing to pair
    assert bench.main_lines(table, {"fsdp": [1.3], "custom_fsdp": [0.9]})[-1].endswith("fsdp 1.30x, custom_fsdp 0.90x")
    assert len(bench.main_lines({"ddp": table["ddp"]}, {})) == 2


def test_table_gives_no_ratio_against_a_figure_that_prints_as_zero():
    """A one-rank run communicates a few scalar all-reduces: 0.0 MB, no ratio of one 0.0 to another."""
    lines = bench.main_lines({"fsdp": table_row(comm=(0.0, 0.0, 1e-6)), "ddp": table_row(comm=(0.0, 0.0, 2e-6))}, {})
    assert lines[2].split(" | ")[4].strip() == "0.0"


def test_every_line_fits_120_columns_also_with_long_rows():
    """Rows with their own settings make long names: a name the figures leave no room for goes on a
    line of its own, above its figures; the paired line wraps; so do --detail's lines."""
    long = "custom_fsdp:reshard_after_forward=False:prefetch=False:wrap_policy=block"
    by_place = {f"fsdp::reduce_scatter_wait transformer.h.{i}": 9.75 - i for i in range(3)} | {"12 other places": 7.0}
    table = {"ddp": table_row(123456.7, 812345.0, reserved=900000.0, comm=(0.0, 0.0, 12345.6), exposed=1234.5,
                              hidden=0.5, mfu=0.4),
             long: table_row(98765.4, 712345.0, reserved=800000.0, comm=(12345.6, 12345.6, 0.0), exposed=2345.6,
                             hidden=0.9, by_place=by_place, mfu=0.45),
             "fsdp": table_row(99999.9, 701234.0, reserved=750000.0, comm=(12345.6, 12345.6, 0.0), exposed=3000.0,
                               hidden=0.8, by_place=by_place, mfu=0.44)}
    paired = {long: [0.8, 0.81, 0.79, 0.8, 0.82, 0.8, 0.8, 0.79, 0.8], "fsdp": [0.8] * 9}
    main, detail = bench.main_lines(table, paired), bench.detail_lines(table, paired)
    assert max(map(len, main + detail)) <= 120, "\n".join(line for line in main + detail if len(line) > 120)
    assert long in main and main[main.index(long) + 1].split(" | ")[0].strip() == ""  # its figures below it
    assert len({len(line) for line in main[:main.index(long)] + main[main.index(long) + 1:-2]}) == 1  # (aligned)
    assert main[main.index(long) + 1].split(" | ")[1].strip() == "98,765.4 (0.80x)"
    paired_line = " ".join(" ".join(main[-2:]).split())  # (wrapped in two, the second indented)
    assert main[-1].startswith("  ") and paired_line.startswith(
        f"step time vs ddp, each repeat's run beside it: {long} 0.80x (0.79x-0.82x), fsdp 0.80x")


@pytest.mark.parametrize("cuda", [True, False])
def test_detail_adds_memory_each_collective_host_time_and_the_notes(cuda):
    def row(*args, reserved, **kwargs):  # (CUDA's caching allocator reserves; a CPU run has no such figure)
        return table_row(*args, reserved=reserved if cuda else None, **kwargs)
    table = {"ddp": row(30.0, 9000.0, reserved=9500.0, comm=(0.0, 0.0, 12.0), hidden=0.0, mfu=0.25),
             "custom_fsdp": row(28.5, 8100.0, reserved=8550.0, comm=(3.0, 2.0, 0.0), hidden=0.9,
                                by_place={"fsdp::reduce_scatter_wait h.0": 9.75, overlap.OUTSIDE: 1.25}),
             "fsdp": row(33.0, 8100.0, reserved=8550.0, comm=(3.0, 2.0, 0.0), by_place={})}
    lines = bench.detail_lines(table, {"custom_fsdp": [0.9, 1.1, 1.0], "fsdp": [1.1, 1.1, 1.2]})
    header = next(line for line in lines if "AG MB/step" in line)
    assert ("reserved MB" in header) == cuda and "params+grads+optim MB" in header and "RS MB/step" in header
    ours = [c.strip() for c in next(line for line in lines if line.startswith("custom_fsdp |")).split(" | ")]
    assert ours[1:] == ["8,550.0 (0.90x)"] * cuda + ["10.0 (1.00x)", "3.0", "2.0", "0.0 (0.00x)", "90%", "-"]
    ddp = [c.strip() for c in next(line for line in lines if line.startswith("ddp ")).split(" | ")]
    assert ddp[-2:] == ["0%", "25.0%"]  # (a hidden fraction of zero is 0%, not '-')
    assert next(line for line in lines if line.startswith("fsdp ")).split(" | ")[-2].strip() == "-"
    host = lines[lines.index("the training thread's CPU time per step, ms, by phase (train.py's host_ms):") + 1:][:4]
    assert [c.strip() for c in host[0].split(" | ")] == ["backend", *bench.HOST_PHASES]
    assert [c.strip() for c in host[2].split(" | ")] == ["custom_fsdp", "0.2 (1.00x)", "9.5 (0.95x)", "0.5 (1.00x)",
                                                          "2.7 (0.90x)"]
    assert "  custom_fsdp: fsdp::reduce_scatter_wait h.0 9.8, (outside any range) 1.2" in lines
    assert not any(line.startswith("  fsdp: fsdp::") for line in lines)  # nothing exposed: no line
    assert "  custom_fsdp: 0.90x 1.10x 1.00x" in lines and "  fsdp: 1.10x 1.10x 1.20x" in lines
    assert any(line.startswith("AG and RS MB/step: the size of each all-gather's output") for line in lines)
    assert any(line.startswith("ddp's AR MB/step: its gradients") for line in lines)
    without_ddp = bench.detail_lines({b: r for b, r in table.items() if b != "ddp"}, {})
    assert not any(line.startswith("ddp's AR") for line in without_ddp)  # (no ddp row: no ddp note)


def test_paired_ratios_divide_each_repeat_by_the_first_rows_run_beside_it():
    results = {"ddp": [{"step_ms": 100.0}, {"step_ms": 200.0}, {"step_ms": 100.0}],
               "custom_fsdp": [{"step_ms": 90.0}, {"step_ms": 220.0}, {"step_ms": 100.0}],
               "fsdp": [{"step_ms": 120.0}, {"step_ms": 240.0}, {"step_ms": 130.0}]}
    paired = bench.paired_step_ratios(results)
    assert list(paired) == ["custom_fsdp", "fsdp"]  # (the first row is the base)
    assert paired["custom_fsdp"] == pytest.approx([0.9, 1.1, 1.0]) and paired["fsdp"] == pytest.approx([1.2, 1.2, 1.3])
    assert bench.ratio_range(paired["custom_fsdp"]) == "1.00x (0.90x-1.10x)"
    assert bench.ratio_range(paired["fsdp"]) == "1.20x (1.20x-1.30x)"


def synthetic_run(dt_ms, state_mb, rss_mb):
    """metrics.jsonl rows of a run: 2 warm-up steps and 3 of `dt_ms`, with memory and comm events."""
    rows = [{"iter": i, "loss": 2.0, "dt_ms": dt, "tokens_per_sec": 1e3 / dt, "mfu": None, "host_ms": {}}
            for i, dt in enumerate([500.0, 400.0] + [dt_ms] * 3)]
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
    assert out["device"].startswith("cpu: ")  # (no CUDA figures in the runs)
    lines = [line for line in capsys.readouterr().out.splitlines() if "W=" in line]
    assert lines[1].endswith("W=2: params+grads+optim 20.0 (0.50x) MB, peak 500 MB, step 60.0 (0.60x) ms"), lines
    assert lines[2].endswith("W=4: params+grads+optim 10.0 (0.25x) MB, peak 300 MB, step 50.0 (0.50x) ms"), lines


def test_bench_interleaves_the_rows_and_returns_the_table_it_prints(tmp_path, capsys):
    """Repeats run A B A B (drift hits both rows alike); the result written as JSON holds the
    settings, each row's medians over repeats, each repeat's step time and the paired ratios. The
    output is the table and the paired line (the runs' progress goes to stderr)."""
    step = {("ddp", 0): 100.0, ("custom_fsdp", 0): 90.0, ("ddp", 1): 200.0, ("custom_fsdp", 1): 220.0,
            ("ddp", 2): 120.0, ("custom_fsdp", 2): 120.0}
    order = []

    def run_train(row, nproc, out, steps, extra):
        rep = int(out.rsplit("-r", 1)[1])
        order.append((row, rep, nproc, steps, tuple(extra)))
        return synthetic_run(step[row, rep], 8.0, 50.0)
    args = mock.Mock(backends=["ddp", "custom_fsdp"], repeats=3, nproc=2, steps=5, exposed=False, detail=False,
                     predict=False, work_dir=str(tmp_path))
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
    assert result["step_ms_per_repeat"] == {"ddp": [100.0, 200.0, 120.0], "custom_fsdp": [90.0, 220.0, 120.0]}
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert lines[0].endswith("ratios vs ddp") and lines[1].startswith("backend") and len(lines) == 5
    assert lines[-1] == "step time vs ddp, each repeat's run beside it: custom_fsdp 1.00x (0.90x-1.10x)"
    assert "repeat 3/3 custom_fsdp: 120.0 ms/step" in err
    json.dumps(result)  # (written as JSON as it is)


@pytest.mark.parametrize("mode,written", [([], "bench.json"), (["--sweep"], "sweep.json")])
def test_each_mode_writes_its_own_default_json_opening_with_its_provenance(mode, written, tmp_path, capsys):
    """Every JSON bench.py writes opens with how it was made: the command as another checkout reruns it
    (a path inside this one relative to it, the scratch --work_dir left out), the device, torch, the
    commit and the date (UTC, to the second)."""
    import torch
    result = {"device": "cpu: a test CPU (2 cores)", "mode": written}
    argv = ["bench.py", *mode, f"--work_dir={tmp_path}", "--data_dir=my data", "--n_layer=2", f"--config={REPO / 'config'}"]
    with mock.patch.object(bench, "bench_backends", return_value=result), \
            mock.patch.object(bench, "sweep", return_value=result), mock.patch.object(sys, "argv", argv):
        bench.main()
    assert os.listdir(tmp_path) == [written]
    saved = json.loads((tmp_path / written).read_text())
    assert list(saved) == ["command", "device", "torch", "commit", "date", "mode"]
    assert saved["command"] == "python bench.py " + " ".join(mode + ["'--data_dir=my data'", "--n_layer=2", "--config=config"])
    assert shlex.split(saved["command"])[2:] == [*mode, "--data_dir=my data", "--n_layer=2", "--config=config"]
    assert saved["device"] == "cpu: a test CPU (2 cores)" and saved["torch"] == torch.__version__
    assert saved["commit"] == bench.git_commit()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", saved["date"]), saved["date"]
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {tmp_path / written}"


def test_device_names_the_cuda_device_or_the_cpu_model_and_its_cores():
    import torch
    with mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA H100 80GB HBM3"):
        assert bench.device_name(cuda=True) == "NVIDIA H100 80GB HBM3"
    cpuinfo = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
               "flags\t\t: fpu\n")
    real_open = open
    with mock.patch("builtins.open", lambda path, *a, **k: __import__("io").StringIO(cpuinfo)
                    if path == "/proc/cpuinfo" else real_open(path, *a, **k)):
        assert bench.device_name(cuda=False) == f"cpu: Intel(R) Xeon(R) Platinum 8480+ ({os.cpu_count()} cores)"
    with mock.patch("builtins.open", side_effect=OSError), mock.patch("platform.processor", return_value="arm"):
        assert bench.device_name(cuda=False) == f"cpu: arm ({os.cpu_count()} cores)"
    # which one a result names: CUDA where its runs reported CUDA's allocator (reserved memory)
    assert bench.ran_on_cuda([{"reserved_mb": None}, {"reserved_mb": 10.0}])
    assert not bench.ran_on_cuda([{"reserved_mb": None}])


def test_commit_is_the_short_head_and_dirty_with_changes_to_tracked_files(tmp_path):
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()
    assert bench.git_commit(tmp_path) is None  # (no repository)
    git("init", "-q")
    (tmp_path / "a.py").write_text("1\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text("{}\n")
    (tmp_path / "docs" / "figures").mkdir(parents=True)
    (tmp_path / "docs" / "figures" / "f.png").write_text("png\n")
    git("add", "a.py", "results/r.json", "docs/figures/f.png")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    head = git("rev-parse", "--short", "HEAD")
    assert bench.git_commit(tmp_path) == head
    (tmp_path / "new.py").write_text("untracked\n")
    assert bench.git_commit(tmp_path) == head  # (an untracked file changes no result)
    (tmp_path / "results" / "r.json").write_text('{"rewritten": 1}\n')
    assert bench.git_commit(tmp_path) == head  # (nor a result that an earlier bench of the same run wrote)
    (tmp_path / "docs" / "figures" / "f.png").write_text("redrawn\n")
    assert bench.git_commit(tmp_path) == head  # (nor a figure figures.py drew before its benches)
    (tmp_path / "a.py").write_text("2\n")
    assert bench.git_commit(tmp_path) == head + "-dirty"
    with mock.patch.object(subprocess, "run", side_effect=FileNotFoundError("git")):
        assert bench.git_commit(tmp_path) is None  # (no git)


PROVENANCE = {"command": "python bench.py --backends=ddp,fsdp --nproc=2", "device": "NVIDIA H100 80GB HBM3",
              "torch": "2.13.0", "commit": "abc1234", "date": "2025-01-02T03:04:05+00:00"}


def write_results(folder):
    """Two synthetic results files (a backends table and a sweep) in `folder`: the rows the markdown must show."""
    folder.mkdir(parents=True, exist_ok=True)
    table = {"ddp": table_row(30.0, 9000.0, comm=(0.0, 0.0, 12.0), exposed=4.0),
             "fsdp": table_row(39.0, 8100.0, comm=(12.0, 12.0, 0.0), exposed=6.0),
             "custom_fsdp:prefetch=False": table_row(28.5, 7200.0, comm=(12.0, 12.0, 0.0))}
    bench_json = PROVENANCE | {"nproc": 2, "repeats": 3, "steps": 12, "extra": [], "backends": table,
                               "step_ratio_per_repeat": {"fsdp": [1.28, 1.31, 1.35],
                                                         "custom_fsdp:prefetch=False": [0.99, 0.95, 1.05]}}
    sweep = {f"custom_fsdp-w{w}": bench.summarize_run(synthetic_run(100.0 / w, 40.0 / w, 700.0 - w), "custom_fsdp")
             for w in (1, 2, 4)}
    (folder / "h100-gpt2.json").write_text(json.dumps(bench_json))
    (folder / "cpu-sweep.json").write_text(json.dumps(PROVENANCE | {"device": "cpu: X (2 cores)", "sweep": sweep,
                                                                     "date": "2025-01-03T00:00:00+00:00"}))
    return folder


@pytest.mark.parametrize("rows,extra,noted", [(["ddp", "custom_fsdp:prefetch=False"], [], False),
                                              (["ddp", "fsdp:prefetch=False"], [], True),
                                              (["ddp", "fsdp"], ["--prefetch=False"], True),
                                              (["ddp", "fsdp:prefetch=True"], ["--prefetch=False"], False)])
def test_a_table_with_fsdp_unprefetched_says_only_its_forward_prefetch_is_off(rows, extra, noted):
    """FSDP2 has no switch for its backward prefetch: a row of fsdp with prefetch=False (its own, or
    every row's) gets a line under the table saying so; custom_fsdp's prefetch=False is all off."""
    table = {b: table_row(30.0, 9000.0, comm=(0.0, 0.0, 12.0)) for b in rows}
    lines = bench.render_backends({"backends": table, "extra": extra})
    assert (backends.FSDP_PREFETCH_OFF.split("prefetch=False", 1)[1] in lines[-1]) == noted, lines


def test_render_writes_each_results_file_as_a_markdown_table(tmp_path, capsys):
    """The newest first; each a heading, where it was measured (device, torch, commit, date, command),
    and its table: the figures with their ratios to the first row, and the paired ratio."""
    folder = write_results(tmp_path / "results")
    md = bench.render_results(folder).split("\n")
    sweep_at, table_at = md.index("### results/cpu-sweep.json"), md.index("### results/h100-gpt2.json")
    assert sweep_at < table_at  # (the sweep's date is the later one, its name too: then the other way round)
    older_sweep = json.loads((folder / "cpu-sweep.json").read_text()) | {"date": "2024-12-31T00:00:00+00:00"}
    (folder / "cpu-sweep.json").write_text(json.dumps(older_sweep))
    reordered = bench.render_results(folder).split("\n")
    assert reordered.index("### results/h100-gpt2.json") < reordered.index("### results/cpu-sweep.json")
    assert md[table_at + 2] == ("NVIDIA H100 80GB HBM3; torch 2.13.0; commit abc1234; 2025-01-02T03:04:05+00:00; "
                                "`python bench.py --backends=ddp,fsdp --nproc=2`")
    header, rule, ddp, fsdp, ours = md[table_at + 4:table_at + 9]
    assert header == ("| backend | step ms | tokens/s | peak MB | comm MB/step | exposed comm ms "
                      "| step vs ddp, paired: median (range) |")
    assert rule == "| --- | --: | --: | --: | --: | --: | --: |"
    assert ddp == "| `ddp` | 30.0 (1.00x) | 3,333 (1.00x) | 9,000 (1.00x) | 12.0 (1.00x) | 4.0 (1.00x) | - |"
    assert fsdp == ("| `fsdp` | 39.0 (1.30x) | 2,564 (0.77x) | 8,100 (0.90x) | 24.0 (2.00x) | 6.0 (1.50x) "
                    "| 1.31x (1.28x-1.35x) |")
    assert ours == ("| `custom_fsdp:prefetch=False` | 28.5 (0.95x) | 3,509 (1.05x) | 7,200 (0.80x) | 24.0 (2.00x) | - "
                    "| 0.99x (0.95x-1.05x) |")
    # the text output's cells come from the same columns
    table = json.loads((tmp_path / "results" / "h100-gpt2.json").read_text())["backends"]
    assert [c.strip() for c in bench.main_lines(table, {})[2].split(" | ")[1:]] == fsdp.strip("| ").split(" | ")[1:-1]
    assert md[sweep_at + 2].startswith("cpu: X (2 cores); torch 2.13.0;")
    assert md[sweep_at + 4:sweep_at + 9] == [
        "| backend | W | params+grads+optim MB | peak MB | step ms |", "| --- | --: | --: | --: | --: |",
        "| `custom_fsdp` | 1 | 40.0 (1.00x) | 699 | 100.0 |", "| `custom_fsdp` | 2 | 20.0 (0.50x) | 698 | 50.0 |",
        "| `custom_fsdp` | 4 | 10.0 (0.25x) | 696 | 25.0 |"]
    (tmp_path / "results" / "comm.json").write_text(json.dumps({"comm": []}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as failed:
        bench.render_results(tmp_path / "results")
    assert failed.value.code == 2 and "comm.json is neither bench.py's JSON" in capsys.readouterr().err


DOC = """# Title

Some text.
<!-- results: generated by python bench.py --render IMPLEMENTATION.md -->
an old table
| a | b |
<!-- /results -->
More text, <!-- /results --> kept.
"""


def test_render_into_a_file_replaces_only_its_results_block(tmp_path, capsys):
    results = write_results(tmp_path / "results")
    doc = tmp_path / "DOC.md"
    doc.write_bytes(DOC.encode())
    with mock.patch.object(bench, "RESULTS_DIR", str(results)), \
            mock.patch.object(sys, "argv", ["bench.py", "--render", str(doc)]):
        bench.main()
    before, after = DOC.split("an old table\n| a | b |\n")
    assert doc.read_text() == before + bench.render_results(results) + "\n" + after
    bench.render_into(doc, results)  # again: the same file
    assert doc.read_text() == before + bench.render_results(results) + "\n" + after
    capsys.readouterr()
    with mock.patch.object(bench, "RESULTS_DIR", str(results)), \
            mock.patch.object(sys, "argv", ["bench.py", "--render"]):
        bench.main()  # without a file: printed
    assert capsys.readouterr().out == bench.render_results(results) + "\n"
    crlf = tmp_path / "CRLF.md"
    crlf.write_bytes(DOC.replace("\n", "\r\n").encode())
    bench.render_into(crlf, results)
    assert crlf.read_bytes() == (before + bench.render_results(results) + "\n" + after).replace("\n", "\r\n").encode()
    bench.render_into(doc, tmp_path / "empty")  # (no results: an empty block)
    assert doc.read_text() == before + after


@pytest.mark.parametrize("text", ["# no block\n", "<!-- /results -->\n" + DOC.split("<!-- /results -->")[0]])
def test_render_into_a_file_without_the_block_fails_in_one_line(text, tmp_path):
    doc = tmp_path / "DOC.md"
    doc.write_text(text)
    res = launch([sys.executable, REPO / "bench.py", "--render", doc], timeout=60)
    assert res.returncode != 0 and res.stderr.splitlines() == [
        f"error: {doc} has no results block: a line '{bench.RESULTS_BEGIN}', later one '{bench.RESULTS_END}'"]
    assert doc.read_text() == text  # (untouched)


def test_render_of_what_cannot_be_read_fails_in_one_line(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "half.json").write_text('{"backends": ')
    for call, message in [(lambda: bench.render_into(tmp_path / "missing.md"), "error: cannot read "),
                          (lambda: bench.render_results(tmp_path / "results"), "half.json is not JSON: ")]:
        with pytest.raises(SystemExit) as failed:
            call()
        err = capsys.readouterr().err
        assert failed.value.code == 2 and err.startswith("error: ") and message in err
        assert err.count("\n") == 1, err


def test_implementation_md_shows_the_rendering_of_results():
    """IMPLEMENTATION.md's results block is `python bench.py --render IMPLEMENTATION.md`'s output on
    the repository's results/: a figure the docs show comes from a file there."""
    text = (REPO / "IMPLEMENTATION.md").read_text()
    lines = text.split("\n")
    if bench.RESULTS_BEGIN not in lines:
        pytest.skip("IMPLEMENTATION.md has no results block yet")
    start, end = bench.results_block(text, "IMPLEMENTATION.md")
    assert "\n".join(lines[start + 1:end]) == bench.render_results(), \
        "IMPLEMENTATION.md's results block is stale: run python bench.py --render IMPLEMENTATION.md"


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


def shard_numel(shapes, world):
    """Per-rank elements of one unit: every parameter padded to ceil(dim0 / W) rows."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes)


@pytest.mark.parametrize("backend,W", [("fsdp", 2), ("custom_fsdp", 2), ("custom_fsdp", 3)])
def test_collective_bytes_per_step_match_the_formula(backend, W, char_data, tmp_path):
    """Counted by train.py's CommCounter; expected from the model's shapes (float32, padded rows),
    a unit per block and the root. W=3: a world size that divides no dimension (padding)."""
    L, C, V, T, steps, micro = 2, 32, 65, 32, 3, 2
    res = run_train(tmp_path, W, f"--data_dir={char_data}", f"--n_layer={L}", "--n_head=2", f"--n_embd={C}",
                    f"--block_size={T}", "--batch_size=2", "--bias=True", f"--max_iters={steps}",
                    f"--gradient_accumulation_steps={W * micro}", "--eval_iters=1", f"--dist_backend={backend}",
                    "--wrap_policy=block")
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
    assert comm["reduce_scatter_bytes"] == expected_rs
    assert comm["reduce_scatter_count"] == L + 1


@pytest.mark.parametrize("nproc,exposed", [(2, True), (1, False)])
def test_bench_table_has_every_backend_and_consistent_fields(nproc, exposed, char_data, tmp_path):
    """bench.py end to end on a tiny model: one row per backend, ratios' base first, the two FSDP
    backends moving the same bytes, the profiled run's exposed communication only when asked; the
    output the table and the paired line, in 120 columns; the JSON opening with its provenance."""
    out = tmp_path / "bench.json"
    res = launch([sys.executable, REPO / "bench.py", "--backends=custom_fsdp,fsdp", f"--nproc={nproc}",
                  "--repeats=1", "--steps=4", f"--exposed={exposed}", f"--work_dir={tmp_path}", f"--json={out}",
                  f"--data_dir={char_data}", "--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=32",
                  "--block_size=32", "--batch_size=2", "--eval_iters=0"], timeout=300)
    assert res.returncode == 0, res.describe()
    table = json.loads(out.read_text())
    assert list(table)[:5] == ["command", "device", "torch", "commit", "date"]
    assert table["command"].startswith("python bench.py --backends=custom_fsdp,fsdp ")
    assert table["device"].startswith("cpu: ") and table["device"].endswith(f"({os.cpu_count()} cores)")
    assert table["nproc"] == nproc and list(table["backends"]) == ["custom_fsdp", "fsdp"]
    ours, theirs = table["backends"]["custom_fsdp"], table["backends"]["fsdp"]
    for row in (ours, theirs):
        assert row["step_ms"] > 0 and row["tokens_per_sec"] > 0 and row["peak_mem_mb"] > 0
        assert row["mfu"] is None and row["reserved_mb"] is None  # no peak FLOP/s, no caching allocator on CPU
        assert (row["exposed_comm_ms"] is not None) == exposed and (row["hidden_fraction"] is not None) == exposed
        assert row["host_ms"]["forward_backward"] > 0 and row["host_ms"]["optimizer"] > 0
        assert row["comm_mb"] == pytest.approx(row["all_gather_mb"] + row["reduce_scatter_mb"] + row["all_reduce_mb"])
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
    # one repeat: the paired ratio is the ratio of the two rows' step times
    assert table["step_ratio_per_repeat"] == {"fsdp": [pytest.approx(theirs["step_ms"] / ours["step_ms"])]}
    lines = res.stdout.strip().splitlines()
    assert lines[-1] == f"wrote {out}" and max(map(len, lines)) <= 120
    title, header, *rows, paired = lines[-6:-1]
    assert title.endswith("ratios vs custom_fsdp") and header.startswith("backend")
    assert [r.split(" | ")[0].strip() for r in rows] == ["custom_fsdp", "fsdp"]
    assert rows[0].split(" | ")[1].strip() == f"{ours['step_ms']:,.1f} (1.00x)"
    assert paired.startswith("step time vs custom_fsdp, each repeat's run beside it: fsdp ")


def test_sweep_state_falls_as_one_over_world_size(char_data, tmp_path):
    """bench.py --sweep: each rank's parameters, gradients and AdamW state at W=1, 2, 4 are 1/W of
    the whole, up to the padding of each parameter's rows (the largest rank's share is reported)."""
    out = tmp_path / "sweep.json"
    res = launch([sys.executable, REPO / "bench.py", "--sweep", "--backends=custom_fsdp", "--steps=3",
                  f"--work_dir={tmp_path}", f"--json={out}", f"--data_dir={char_data}", "--device=cpu",
                  "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2"], timeout=300)
    assert res.returncode == 0, res.describe()
    result = json.loads(out.read_text())
    assert list(result)[:5] == ["command", "device", "torch", "commit", "date"] and result["device"].startswith("cpu: ")
    sweep = result["sweep"]
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
                  "--block_size=32", "--batch_size=2", "--eval_iters=1", "--wrap_policy=block"], timeout=300,
                 cwd=tmp_path)
    assert res.returncode == 0, res.describe()
    assert (tmp_path / "runs" / "custom_fsdp-r0" / "metrics.jsonl").exists()
    assert not list(tmp_path.glob("runs/*/ckpt-*"))
    rows = json.loads(out.read_text())["backends"]
    assert list(rows) == ["custom_fsdp", zero2]
    assert rows[zero2]["all_gather_mb"] < rows["custom_fsdp"]["all_gather_mb"]
    assert rows[zero2]["reduce_scatter_mb"] == rows["custom_fsdp"]["reduce_scatter_mb"]


@pytest.mark.parametrize("args,problem", [(["--backends=custom_fsdp:prefetch"], "not key=value"),
                                          (["--backends=fsdp,fsdp"], "twice"),
                                          (["--backends=ddp,zero"], "unknown backend 'zero'"),
                                          (["--nproc=0"], "--nproc=0: at least 1"),
                                          (["--repeats=0"], "--repeats=0: at least 1"),
                                          (["--steps=2"], "--steps=2: at least 3"),
                                          (["--exposed=maybe"], "invalid"),
                                          (["--sweep", "--nproc=3"], "--nproc=3: --sweep runs world sizes 1, 2 and 4"),
                                          (["--sweep", "--repeats=2"], "--sweep runs each world size once"),
                                          (["--render", "--steps=3"], "--render reads results/ and runs nothing: "
                                                                      "--steps is not for it"),
                                          (["--render", "--n_layer=2"], "--n_layer=2 is not for it")])
def test_bench_rejects_bad_arguments_before_running(args, problem, tmp_path):
    res = launch([sys.executable, REPO / "bench.py", *args, f"--work_dir={tmp_path}"], timeout=60)
    assert res.returncode == 2 and problem in res.stderr.splitlines()[-1], res.stderr
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
                    "--dist_backend=custom_fsdp", "--wrap_policy=block", "--profile=True", "--memory_snapshot=True")
    assert res.returncode == 0, res.describe()
    assert f"wrote {tmp_path / 'traces' / 'custom_fsdp' / 'rank0.json'}, {tmp_path / 'memory' / 'rank0.json'} " \
        in res.stdout, res.stdout  # where to look
    for rank in (0, 1):
        with open(tmp_path / "traces" / "custom_fsdp" / f"rank{rank}.json") as f:
            trace = json.load(f)
        rows = overlap.analyse(trace)
        assert len(rows) == 3 and all(r["compute_ms"] > 0 for r in rows)
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
        rows = list(map(json.loads, f))
    memory = [r for r in rows if r.get("event") == "memory"]
    # the lanes overlap.py draws hold, in each profiled step, the collectives the step issued: on
    # gloo a reduce-scatter runs as an all-reduce and shares that lane; each gather is named after its unit
    (comm,) = [r for r in rows if r.get("event") == "comm_per_step"]
    # (iteration 0 follows the evaluation at 0, which left the root and the last block gathered: that
    # step gathers two fewer than the others, the profiled ones among them)
    gathers_per_step = (6 * comm["all_gather_count"] + 2) / 6
    for rank in (0, 1):
        steps, by_lane, exposed = overlap.lanes(overlap.load(tmp_path / "traces" / "custom_fsdp" / f"rank{rank}.json"))
        assert len(steps) == 3 and by_lane["compute"]
        for a, b in steps:
            gathers, reductions = ([bar for bar in by_lane[lane] if a <= bar[0] < b] for lane in overlap.LANES[1:])
            assert len(gathers) == pytest.approx(gathers_per_step), (gathers, comm)
            assert len(reductions) == comm["reduce_scatter_count"] + comm["all_reduce_count"], (reductions, comm)
            assert {label for _, _, label in gathers} == {"root", "h.0", "h.1"}
    png = tmp_path / "lanes.png"
    cli = launch([sys.executable, REPO / "overlap.py", *(tmp_path / "traces" / "custom_fsdp" / f"rank{r}.json" for r in (0, 1)),
                  f"--png={png}"], timeout=60)
    assert cli.returncode == 0 and png.stat().st_size > 0, cli.stderr
    assert [r["stage"] for r in memory] == ["after model creation", "after first step", "after last step", "end"]
    assert all(r["rss_mb"] > 0 and r["params_mb"] > 0 for r in memory)
    # the steps' reports come before zero_grad: the local gradient shards are there (unpadded)
    assert [r["grads_mb"] > 0 for r in memory] == [False, True, True, False]
    assert memory[2]["grads_mb"] <= memory[2]["params_mb"]
    # AdamW: two moments per parameter (plus a 4-byte step counter each)
    assert memory[-1]["optim_mb"] == pytest.approx(2 * memory[-1]["params_mb"], abs=1e-3)


CHECKPOINT_COLLECTIVES = {"c10d::barrier", "c10d::broadcast_", "c10d::scatter_", "c10d::gather_"}  # DCP's save
GLOO_MOVES = {"ddp": "gloo:all_reduce", "fsdp": "gloo:all_gather", "custom_fsdp": "gloo:all_gather"}


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "custom_fsdp"])
def test_profiled_steps_hold_training_steps_only_and_enclose_their_logged_time(backend, char_data, tmp_path):
    """Steps 2-4 are profiled, with an evaluation and a checkpoint save at iteration 3 between
    steps 2 and 3: each ProfilerStep#k range holds iteration k's forward/backward/optimizer only
    (its micro-batches' losses, no checkpoint collectives), the evaluation and save lie in the
    trace outside every range, and each step's logged dt_ms lies inside its range, so the trace's
    export (after the window's last step) is in no step's time. The steps hold gloo's ranges, on
    its own threads: the communication overlap.py measures. overlap.py's command line reads the trace."""
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
            moves = [e for e in events if e["name"].startswith("gloo:") and s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
            assert GLOO_MOVES[backend] in {e["name"] for e in moves}
            assert all(e["tid"] != steps[0]["tid"] for e in moves)
        between = [e["name"] for e in main if not any(s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps)]
        assert between.count("aten::cross_entropy_loss") == 2 * evals_per_split  # iteration 3's evaluation
        assert CHECKPOINT_COLLECTIVES <= set(between)  # and its save
        if rank == 0:  # (rank 0 logs): the clocks of time.time() and the profiler may differ by far under 0.5 ms
            for s in steps:
                assert dt_ms[int(s["name"].split("#")[1])] <= s["dur"] / 1e3 + 0.5, (s, dt_ms)
    cli = launch([sys.executable, "overlap.py", str(tmp_path / "traces" / backend / "rank0.json")], timeout=60)
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


def test_predict_plans_each_row_as_train_py_would_run_it_and_sets_it_beside_the_measured(tmp_path, capsys):
    """--predict: each row planned with its own settings on this CPU's figures (the time model),
    before the runs; the table then shows predicted against measured, and the ranks' agreement."""
    import pickle
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65}))
    args = mock.Mock(backends=["custom_fsdp", "custom_fsdp:activation_checkpointing=True"], nproc=2, steps=3,
                     work_dir=str(tmp_path))
    with mock.patch.dict(os.environ, {"XDG_CACHE_HOME": CACHE}):  # (the tests' clean calibration)
        predicted = bench.predictions(args, [*TINY, "--device=cpu", f"--data_dir={tmp_path}"])
    plain, checkpointed = (predicted[b]["predicted_step_ms"] for b in args.backends)
    assert 0 < plain < checkpointed  # (the checkpointed run computes each block's forward twice)
    table = {"a": {"step_ms": 100.0, "predicted_step_ms": 110.0}, "b": {"step_ms": 200.0, "predicted_step_ms": 190.0},
             "c": {"step_ms": 300.0, "predicted_step_ms": 150.0}}
    lines = bench.prediction_lines(table)
    assert [line.split("|")[-1].strip() for line in lines[3:6]] == ["+10.0%", "-5.0%", "-50.0%"]
    assert lines[-1] == "Spearman's rank correlation of the 3 rows: 0.50"
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0 and bench.spearman([1, 2, 2], [3, 2, 1]) < 0
