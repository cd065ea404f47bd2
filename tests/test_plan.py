"""
plan.py against the allocator: each case's planned peak (fake tensors, nothing allocated) equals
the peak the CPU allocator reports for the same steps run with real tensors (tests/plan_worker.py),
for the three backends at W = 1, 2 and 4 and under ZeRO-2, activation checkpointing, HSDP 2x2,
bfloat16 and a world size that leaves ranks with empty shards (a unit per block). So do the bytes
per collective kind and step. Also the per-rank state, the largest rank, the reserve model's rules,
and plan.py's refusals and output.

The real runs use a process group whose collectives complete at once on the calling thread, so
their peak is the program's own. A real gloo run also holds gloo's buffers, at times its threads
decide; plan.py --device=cpu counts them at their worst, and the last test holds that plan to the
highest of several train.py runs.
"""
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, launch, launcher, one_error_line

sys.path.insert(0, str(REPO))
import planner  # noqa: E402

WORKER = REPO / "tests" / "plan_worker.py"
MODEL = ["--n_layer=3", "--n_embd=64", "--n_head=4", "--batch_size=4", "--block_size=32"]
# (backend, world size, rank, settings); the default accumulates 4 micro-batches over the ranks
CASES = [(backend, world, 0, []) for backend in ("custom_fsdp", "fsdp", "ddp") for world in (1, 2, 4)] + [
    (backend, 2, 1, knob) for backend in ("custom_fsdp", "fsdp")
    for knob in (["--reshard_after_forward=False"], ["--activation_checkpointing=True"])] + [
    ("ddp", 2, 1, ["--activation_checkpointing=True"]),
    ("custom_fsdp", 4, 3, ["--replicate_degree=2"]), ("fsdp", 4, 3, ["--replicate_degree=2"]),
    # 64 rows over 48 ranks: ranks 32 to 47 hold nothing of most parameters
    ("custom_fsdp", 48, 0, ["--wrap_policy=block"]), ("custom_fsdp", 48, 47, ["--wrap_policy=block"]),
    ("fsdp", 48, 47, ["--wrap_policy=block"]),
    ("custom_fsdp", 2, 0, ["--dtype=bfloat16"]),
    # float32 sums kept between micro-steps: a bf16 grad dropped just after the peak, as the counter watches
    ("custom_fsdp", 2, 0, ["--dtype=bfloat16", "--reshard_after_backward=False", "--batch_size=2"])] + [
    # float8: the gathers of one byte an element, the casts, the scales' one all-reduce after each step
    (backend, 2, 1, ["--float8=True"]) for backend in ("custom_fsdp", "fsdp", "ddp")]
# A bfloat16 matmul on CPU runs in oneDNN, which allocates scratch through PyTorch's allocator inside
# aten::mm, where no dispatch mode sees it, sized by the CPU's instructions: here 1.0% of the peak
# with AMX, 1.4% with AVX-512 BF16, 4.4% with AVX-512 alone. Capped at AVX2, it allocates none, so
# the real runs are the same on every machine the tests meet.
SAME_KERNELS_EVERYWHERE = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def new_interpreter(cmd, timeout, **kwargs):
    """launch(), as a new interpreter: plan.py plans each rank in a forked child, which under the
    tests' fork server would be a fork of a fork of a process that imported torch, where torch
    2.11's CUDA build aborts as autograd starts its threads ("Invalid thread pool")."""
    return launch(cmd, timeout, fork=False, **kwargs)


def key(backend, world, rank, knob):
    return " ".join([backend, f"W={world}", f"rank={rank}", *MODEL, "--data_dir=DATA", *knob])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A data folder that only names a vocabulary of 65 tokens (meta.pkl): the plan reads no data."""
    import pickle
    folder = tmp_path_factory.mktemp("plan_data")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65}, f)
    return folder


@pytest.fixture(scope="module")
def report(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("plan")
    cases = [[b, w, r, MODEL + [f"--data_dir={data}"] + knob] for b, w, r, knob in CASES]
    (tmp / "cases.json").write_text(json.dumps(cases))
    res = new_interpreter([sys.executable, WORKER, tmp / "cases.json", tmp / "out.json"], timeout=300,
                          env=SAME_KERNELS_EVERYWHERE)
    assert res.returncode == 0, res.describe()
    out = json.loads((tmp / "out.json").read_text())
    return {k.replace(str(data), "DATA"): v for k, v in out.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: " ".join(map(str, c[:3])) + " " + " ".join(c[3]))
def test_planned_peak_is_the_allocators(report, case):
    r = report[key(*case)]
    assert "error" not in r, r["error"]
    assert r["planned_peak"] == r["measured_peak"], r


@pytest.mark.parametrize("case", CASES, ids=lambda c: " ".join(map(str, c[:3])) + " " + " ".join(c[3]))
def test_planned_state_is_what_the_rank_holds(report, case):
    """Parameters, gradients and optimizer state as this rank of the real run holds them (empty
    shards included)."""
    r = report[key(*case)]
    assert "error" not in r, r["error"]
    assert r["planned_state"] == r["measured_state"], r


@pytest.mark.parametrize("case", CASES, ids=lambda c: " ".join(map(str, c[:3])) + " " + " ".join(c[3]))
def test_planned_communication_is_what_the_step_issued(report, case):
    """Bytes per collective kind in the second step, against the real run's: what FSDP2 and
    fsdp_impl hand torch.distributed (observe.py's counter, and DTensor's functional all-reduces),
    and what DDP's reducer hands its process group. DDP rebuilds its buckets once, in the second
    step, and broadcasts rank 0's bucket order: a message of a few bytes that no later step sends.
    The process groups used, each an NCCL communicator on a GPU: none at W=1; the world's; with
    HSDP the shards' and the replicas' too."""
    r = report[key(*case)]
    assert "error" not in r, r["error"]
    assert r["planned_communicators"] == (0 if case[1] == 1 else 3 if "--replicate_degree=2" in case[3] else 1), r
    measured = dict(r["measured_comm"])
    if case[0] == "ddp" and case[1] > 1:
        assert measured.pop("broadcast") < 1024, r
    assert r["planned_comm"] == measured, r


def test_rank_0_holds_the_largest_shards(report):
    """plan.py reports rank 0 by default: torch.chunk's split gives the earlier ranks the rows."""
    first, last = (report[key("custom_fsdp", 48, rank, ["--wrap_policy=block"])] for rank in (0, 47))
    assert first["planned_state"] > last["planned_state"] and first["planned_peak"] > last["planned_peak"]


@pytest.mark.parametrize("rank", [0, 47])
def test_state_is_zeros_arithmetic(report, rank):
    """At W=48, rank r's state: ZeRO's 16 bytes per parameter (float32 parameter, gradient and
    AdamW's two moments) over W, plus padding, plus a 4-byte step counter per parameter tensor.
    Each rank holds ceil(rows / W) rows of each parameter, or fewer or none near the end
    (torch.chunk's split); its parameters and gradients live in buffers of the padded size on
    every rank, as FSDP2's, and the moments are the size of the rows it holds."""
    import math
    import sys
    sys.path.insert(0, str(REPO))
    import torch
    from model import GPT, GPTConfig
    with torch.device("meta"):
        gpt = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, vocab_size=65, bias=False))
    held = padded = 0
    world = 48
    for p in gpt.parameters():
        rows = math.ceil(p.shape[0] / world)
        held += max(0, min(rows, p.shape[0] - rank * rows)) * math.prod(p.shape[1:])
        padded += rows * math.prod(p.shape[1:])
    expected = 8 * padded + 8 * held + 4 * len(list(gpt.parameters()))
    assert report[key("custom_fsdp", world, rank, ["--wrap_policy=block"])]["planned_state"] == expected


def test_sharding_divides_the_state(report):
    states = {w: report[key("custom_fsdp", w, 0, [])]["planned_state"] for w in (1, 2, 4)}
    assert states[1] > states[2] > states[4] >= states[1] / 4


# The training step changed in its one place, training.train_step: each call logged with its
# caller's file and iteration, and HELD bytes more held through it. The script plans ddp at W=1 before
# and after the change, then runs train.py, changed, on the CPU allocator's ledger (tests/ledger.py)
HELD = 2**20
STEP_CHANGED = """
import inspect, json, os, runpy, sys
repo, folder, held, *args = sys.argv[1:]
sys.path.insert(0, repo)
import torch
import planner, training
settings = training.settings(args)
settings["vocab_size"] = training.vocab_size(settings)
planned = [planner.in_child(planner.plan, settings, "ddp", 1, 0)["peak_allocated_bytes"]]
step = training.train_step

def changed_step(*step_args, **kwargs):
    caller = os.path.basename(sys._getframe(1).f_code.co_filename)
    iter_num = inspect.signature(step).bind(*step_args, **kwargs).arguments["iter_num"]
    with open(os.path.join(folder, "steps.log"), "a") as log:
        log.write(f"{caller} {iter_num}\\n")
    kept = torch.empty(int(held), dtype=torch.uint8)  # (freed as the step returns)
    return step(*step_args, **kwargs)
training.train_step = changed_step
planned.append(planner.in_child(planner.plan, settings, "ddp", 1, 0)["peak_allocated_bytes"])
with open(os.path.join(folder, "planned.json"), "w") as f:
    json.dump(planned, f)
sys.argv = [os.path.join(repo, "tests", "ledger.py"), os.path.join(folder, "train"), os.path.join(repo, "train.py"), *args]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_train_py_and_the_plan_take_the_one_step(char_data, tmp_path):
    """train.py and plan.py (planner/step.py) both run training.train_step, once per step. Changed there, the plan
    grows by exactly the bytes the change holds, and train.py's real peak (the allocator's ledger)
    follows: it is the changed plan less the batch, which train.py reads through numpy, within
    train.py's few metric scalars (under 64 bytes)."""
    args = [*MODEL, f"--data_dir={char_data}", "--device=cpu", "--dist_backend=ddp", f"--out_dir={tmp_path / 'out'}",
            "--max_iters=2", "--eval_iters=0", "--eval_interval=1000", "--keep_checkpoints=0"]
    res = new_interpreter([sys.executable, "-c", STEP_CHANGED, REPO, tmp_path, HELD, *args], timeout=180)
    ledger = tmp_path / "train.rank0.log"
    assert res.returncode == 0, res.describe() + (ledger.read_text()[-3000:] if ledger.exists() else "")
    calls = (tmp_path / "steps.log").read_text().splitlines()
    assert calls == ["step.py 0", "step.py 1", "train.py 0", "train.py 1"], calls  # (planner/step.py)
    plain, changed = json.loads((tmp_path / "planned.json").read_text())
    assert changed == plain + HELD, (plain, changed)
    peak = max(int(total) for total in re.findall(r"total alloc (\d+) bytes", ledger.read_text()))
    batch = 2 * 4 * 32 * 8  # (x and y, int64)
    assert changed - batch - 64 <= peak <= changed - batch + 64, (plain, changed, peak)


def test_plan_prints_a_table_and_writes_json(tmp_path, data):
    out = tmp_path / "plan.json"
    res = new_interpreter([sys.executable, REPO / "plan.py", "--dist_backend=custom_fsdp", "--nproc=1,2", *MODEL,
                  f"--data_dir={data}", f"--json={out}", "--compile=True", f"--png={tmp_path / 'plan.png'}"],
                 timeout=120)
    assert res.returncode == 0, res.describe()
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["nproc"], r["rank"]) for r in rows] == [("custom_fsdp", 1, 0), ("custom_fsdp", 2, 0)]
    for r in rows:
        assert {"backend", "nproc", "rank", "peak_allocated_bytes", "state_bytes", "reserved_bytes",
                "comm_bytes_per_step", "fits", "max_batch_size"} <= set(r)
        assert r["fits"] is None and r["headroom_bytes"] is None and r["max_batch_size"] is None  # (no GPU given)
        assert r["reserved_bytes"] >= r["peak_allocated_bytes"] >= r["state_bytes"] > 0
        assert sum(r["peak_made_of"].values()) == r["peak_allocated_bytes"]
        # at the end of backward (a fixed moment) the state is all there, its gradients reduced, nothing
        # gathered; of the activations only the last micro-batch's tokens (X and Y, int64) and its loss live
        end = r["backward_end_made_of"]
        assert end["parameters"] + end["gradients"] + end["optimizer_state"] == r["state_bytes"]
        assert end["gathered_parameters"] == 0 and end["activations"] == 2 * 8 * 4 * 32 + 4
        # 4 micro-steps over W ranks: gradient sync is off in all but the last, so each rank keeps
        # the whole model's unsharded float32 grads, as large as W=1's (unsharded) parameters
        assert r["micro_steps"] > 1 and r["peak_made_of"]["gradients"] >= rows[0]["peak_made_of"]["parameters"]
        # the projection: nccl-tests' bus bytes ((n-1)/n of a gather's or a reduce-scatter's bytes, twice
        # that of an all-reduce's) over the NVLink default within a node
        share, comm = (r["nproc"] - 1) / r["nproc"], r["comm_bytes_per_step"]
        bus = share * (comm.get("all_gather", 0) + comm.get("reduce_scatter", 0) + 2 * comm.get("all_reduce", 0))
        assert r["comm_bus_bytes_per_step"] == round(bus) and r["busbw_gbps"] == 360
        assert r["comm_seconds_per_step"] == r["comm_bus_bytes_per_step"] / 360e9 and (r["nproc"] == 1) == (bus == 0)
        # what CUDA holds beside the tensors: cuBLAS's workspaces in the allocator; the context and
        # each NCCL communicator's buffers outside it (one process group at W=2, none at W=1)
        workspaces = planner.CUBLAS_WORKSPACES * planner.CUBLAS_WORKSPACE_BYTES
        assert r["cuda_allocated_bytes"] >= r["peak_allocated_bytes"] + workspaces
        assert r["communicators"] == (r["nproc"] > 1)
        nccl = r["communicators"] * planner.NCCL_COMMUNICATOR_BYTES
        assert r["outside_allocator_bytes"] == planner.CUDA_CONTEXT_BYTES + nccl
    assert "custom_fsdp" in res.stdout and "planning custom_fsdp at W=2" in res.stderr
    assert "compile=True is planned as eager" in res.stdout
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert max(len(line) for line in res.stdout.splitlines()) <= 120


def test_the_timeline_stacks_to_the_peak_in_the_schedules_order(tmp_path, data):
    """plan.py --timeline_json: each backend's stacked roles add up to the plan's peak at its peak
    event and nowhere above it; the phases follow train.py's loop, step by step; FSDP's collectives
    follow its schedule: the forward gathers unit after unit, one ahead (prefetch), the backward
    reduce-scatters from the last block to the first, each after that block's backward began.
    --timeline draws the panels."""
    out, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    res = new_interpreter([sys.executable, REPO / "plan.py", "--nproc=2", *MODEL, f"--data_dir={data}",
                           "--wrap_policy=block", "--gradient_accumulation_steps=2", f"--timeline_json={out}",
                           f"--timeline={png}"], timeout=120)
    assert res.returncode == 0, res.describe()
    assert png.stat().st_size > 0
    timelines = json.loads(out.read_text())
    assert [t["backend"] for t in timelines] == ["ddp", "fsdp", "custom_fsdp"]
    phases = ["forward 0", "backward 0", "clip", "optimizer", "zero_grad", "between steps"]
    for t in timelines:
        totals = {row[0]: sum(row[1:]) for row in t["stacked"]}
        assert totals[t["peak_event"]] == t["peak_allocated_bytes"] == max(totals.values()), t["backend"]
        assert list(totals) == sorted(totals) and t["roles"] == list(planner.ROLES)
        assert [where for _, where in t["marks"]] == [f"step {s} {p}" for s in (1, 2) for p in phases]
        assert [index for index, _ in t["marks"]] == sorted(index for index, _ in t["marks"])
        if t["backend"] == "ddp":
            continue
        for step in (1, 2):
            def blocks(kind, phase):
                return [int(where.split("@ h.")[1]) if "@ h." in where else -1 for _, k, where in t["collectives"]
                        if k == kind and where.startswith(f"step {step} {phase}")]
            gathers, scatters = blocks("all_gather", "forward"), blocks("reduce_scatter", "backward")
            assert gathers == [-1, -1, 0, 1], (t["backend"], gathers)  # the root and h.0, then h.1 and h.2 ahead
            assert scatters == [2, 1, 0, 0], (t["backend"], scatters)  # h.2, h.1, h.0, then the root's
            assert not blocks("reduce_scatter", "forward")


def test_cpu_offload_plans_the_gpus_side(tmp_path, data):
    """Under cpu_offload the state (sharded parameters, gradients, optimizer state) lives in host
    memory: the GPU's peak is the run's without it, and the host holds the state. A model of the
    offloaded run (no CUDA here), checked against the plan without offload."""
    rows = {}
    for offload in (False, True):
        out = tmp_path / f"plan-{offload}.json"
        res = new_interpreter([sys.executable, REPO / "plan.py", "--dist_backend=custom_fsdp", "--nproc=2", *MODEL,
                      f"--data_dir={data}", f"--json={out}", f"--cpu_offload={offload}"], timeout=120)
        assert res.returncode == 0, res.describe()
        (rows[offload],) = json.loads(out.read_text())
    plain, offloaded = rows[False], rows[True]
    assert plain["host_bytes"] == 0 and offloaded["host_bytes"] == offloaded["state_bytes"] == plain["state_bytes"]
    assert plain["peak_allocated_bytes"] - plain["state_bytes"] <= offloaded["peak_allocated_bytes"]
    assert offloaded["peak_allocated_bytes"] <= plain["peak_allocated_bytes"] - plain["peak_made_of"]["parameters"]
    assert offloaded["comm_bytes_per_step"] == plain["comm_bytes_per_step"]
    assert "host memory" in res.stdout


def test_the_largest_batch_that_fits_is_the_largest(tmp_path, data):
    """--gpu_mem_gib answers: the headroom beside the modelled reserve, the CUDA context and NCCL's
    buffers, and the largest batch_size whose reserve fits (planned again at it and one above, it
    is within and beyond the memory)."""
    limit = (planner.CUDA_CONTEXT_BYTES + planner.NCCL_COMMUNICATOR_BYTES
             + planner.CUBLAS_WORKSPACES * planner.CUBLAS_WORKSPACE_BYTES + 6 * 2**20)
    common = [sys.executable, REPO / "plan.py", "--dist_backend=custom_fsdp", "--nproc=2", *MODEL, f"--data_dir={data}"]
    out = tmp_path / "plan.json"
    res = new_interpreter(common + [f"--gpu_mem_gib={limit / 2**30!r}", f"--json={out}"], timeout=120)
    assert res.returncode == 0, res.describe()
    (row,) = json.loads(out.read_text())
    assert row["communicators"] == 1
    room = limit - row["outside_allocator_bytes"]
    assert row["headroom_bytes"] == room - row["reserved_bytes"] and row["fits"] == (row["headroom_bytes"] >= 0)
    best = row["max_batch_size"]
    assert best > 0
    peaks = {}
    for batch in (best, best + 1):
        out = tmp_path / f"b{batch}.json"
        res = new_interpreter(common + [f"--batch_size={batch}", f"--json={out}"], timeout=120)
        assert res.returncode == 0, res.describe()
        peaks[batch] = json.loads(out.read_text())[0]["reserved_bytes"]
    assert peaks[best] <= room < peaks[best + 1], peaks


def test_plan_check_sets_train_py_beside_the_plan(char_data, tmp_path):
    """scripts/plan_check.py, the GPU check's memory part, runs here as it would there: train.py's
    two steps, twice, and the plan of every rank, one JSON row per backend and W. CPU reports no CUDA
    counters, so its measured figures are absent (the GPU issue fills them)."""
    out = tmp_path / "check.json"
    res = new_interpreter([sys.executable, REPO / "scripts" / "plan_check.py", f"--json={out}", "--backends=custom_fsdp",
                  "--nproc=2", "--repeats=2", *MODEL, f"--data_dir={char_data}", "--device=cpu"], timeout=180)
    assert res.returncode == 0, res.describe()
    result = json.loads(out.read_text())
    assert {"command", "device", "torch", "commit", "date", "constants", "plan_assumes"} <= set(result)
    assert result["plan_assumes"]["CUDA_CONTEXT_BYTES"] == planner.CUDA_CONTEXT_BYTES
    assert result["time_model"] is None and result["constants"]["matmul_bf16_flops"] is None  # (no GPU measured)
    (row,) = result["plan_check"]
    assert (row["backend"], row["nproc"]) == ("custom_fsdp", 2)
    assert row["planned_reserved_bytes"] >= row["planned_allocated_bytes"] > row["planned_cpu_peak_bytes"] > 0
    assert row["measured_max_allocated_bytes"] is None and row["allocated_within_target"] is None
    assert row["measured_runs"] == [[None, None]] * 2
    import bench  # (results/ takes the file: its rendering for IMPLEMENTATION.md)
    table = bench.render_file(out)
    assert table[0] == "### " + out.parent.name + "/check.json" and "| `custom_fsdp` | 2 | - |" in "\n".join(table)


@pytest.mark.parametrize("args,names", [(["--nproc=2,x"], "--nproc"), (["--nproc=0"], "--nproc"),
                                        (["--n_layers=3"], "n_layers"), (["--dist_backend=zero"], "zero"),
                                        (["--gpu=v100"], "v100"), (["--gpu_mem_gib=-1"], "--gpu_mem_gib"),
                                        (["--rank=-1"], "--rank"), (["--busbw_gbps=fast"], "--busbw_gbps"),
                                        (["--dist_backend=ddp", "--cpu_offload=True"], "cpu_offload"),
                                        (["--json", "plan.json"], "--json=VALUE"),
                                        (["--search", "--nproc=1,2", "--gpu=h100"], "one world size"),
                                        (["--search", "--nproc=2"], "--gpu=h100"),
                                        (["--search=micro_batch=triple", "--nproc=2", "--gpu=h100"], "micro_batch"),
                                        (["--search=reshard_after_forward=1", "--nproc=2", "--gpu=h100"], "group size")])
def test_bad_input_is_one_line(args, names):
    res = new_interpreter([sys.executable, REPO / "plan.py", *args], timeout=60)
    assert names in one_error_line(res)


def test_caching_allocator_model_follows_cudas_rules():
    """The reserve model's rules, each on a sequence whose answer CUDA's allocator documents: 512-byte
    rounding, 2 MiB segments for requests up to 1 MiB, 20 MiB ones below 10 MiB, a segment of its
    own above, blocks split and reused, freed neighbours merged. (Against a GPU: the GPU issue.)"""
    from planner import CachingAllocatorModel
    MiB = 2**20

    def replay(trace):
        return CachingAllocatorModel().replay(trace)
    one = replay([(0, 100)])
    assert (one.allocated, one.reserved) == (512, 2 * MiB)
    two_small = replay([(0, MiB), (1, MiB)])  # both in one 2 MiB segment
    assert (two_small.allocated, two_small.reserved) == (2 * MiB, 2 * MiB)
    two_large = replay([(0, 3 * MiB), (1, 3 * MiB)])  # the second from the first's 20 MiB segment
    assert (two_large.allocated, two_large.reserved) == (6 * MiB, 20 * MiB)
    big = replay([(0, 12 * MiB + 1)])  # rounded up to 2 MiB
    assert big.reserved == 14 * MiB
    reused = replay([(0, 12 * MiB), (0, 0), (1, 11 * MiB + 512 * 1024)])  # 0.5 MiB left: not split off
    assert (reused.reserved, reused.allocated) == (12 * MiB, 12 * MiB)
    merged = replay([(0, 4 * MiB), (1, 4 * MiB), (0, 0), (1, 0), (2, 15 * MiB)])  # the freed blocks merge
    assert merged.reserved == 20 * MiB and merged.peak_allocated == 15 * MiB
    resized = replay([(0, 0), (0, 4 * MiB), (0, 0)])  # FSDP's storage resize: a block, then none
    assert (resized.allocated, resized.reserved) == (0, 20 * MiB)


# custom_fsdp, a unit per block: in backward each block's gather of the next one is in flight while
# it computes, so gloo's buffer for that gather is alive at the peak in some runs and not in others
REPEATED = ["--dist_backend=custom_fsdp", "--wrap_policy=block", "--n_layer=4", "--n_head=4", "--n_embd=128",
            "--batch_size=12", "--block_size=64", "--gradient_accumulation_steps=2", "--dtype=float32"]


def test_the_plan_of_a_cpu_run_holds_its_highest_real_peak(char_data, tmp_path):
    """plan.py --device=cpu against train.py run for real, four times at W=2 on gloo, beside a
    process that keeps a core busy. Each run's peak is the CPU allocator's own ledger over every
    thread (tests/ledger.py): gloo's threads allocate too. The program's own memory is the same in
    every run; gloo's buffers come and go with its threads' timing, and the plan counts them at
    their worst. So every run lies between the plan without gloo's buffers and the plan with them.
    Both plans count the batch, which a CPU run keeps in numpy's memory, and leave out train.py's
    few metric scalars (under 64 bytes)."""
    data = [f"--data_dir={char_data}"]
    plans = {}
    for device in ([], ["--device=cpu"]):  # (without --device: a GPU run's plan, no gloo)
        out = tmp_path / f"plan{len(device)}.json"
        res = new_interpreter([sys.executable, REPO / "plan.py", *REPEATED, *data, *device, "--nproc=2",
                               f"--json={out}"], timeout=120)
        assert res.returncode == 0, res.describe()
        (row,) = json.loads(out.read_text())
        plans[bool(device)] = row["peak_allocated_bytes"]
    assert "gloo's buffers count at their worst" in res.stdout
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        peaks = []
        for run in range(4):
            res = launch(launcher(2) + [REPO / "tests" / "ledger.py", tmp_path / f"run{run}", REPO / "train.py",
                                        *REPEATED, *data, "--device=cpu", f"--out_dir={tmp_path / f'out{run}'}",
                                        "--max_iters=2", "--eval_iters=0", "--eval_interval=1000",
                                        "--keep_checkpoints=0"], timeout=120)
            assert res.returncode == 0, res.describe()
            log = (tmp_path / f"run{run}.rank0.log").read_text()  # (rank 0: the rank plan.py reports)
            peaks.append(max(int(total) for total in re.findall(r"total alloc (\d+) bytes", log)))
    finally:
        busy.kill()
        busy.wait()
    batch = 2 * 12 * 64 * 8  # (x and y, int64)
    assert plans[True] > plans[False], plans  # (gloo's buffers reach the peak at their worst)
    for peak in peaks:
        assert plans[False] - batch - 64 <= peak <= plans[True] - batch + 64, (plans, peaks)


LINE_AGAINST_PLANS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import planner, training
out, cases = sys.argv[2], json.loads(sys.argv[3])
answers = []
for backend, world, room_mib, args in cases:
    settings = training.settings(args)
    settings["vocab_size"], settings["dtype"] = training.vocab_size(settings), "bfloat16"
    other = planner.second_batch(settings["batch_size"])
    row, second = (planner.in_child(planner.plan, dict(settings, batch_size=b), backend, world, 0, keep_trace=True)
                   for b in (settings["batch_size"], other))
    lined = planner.batch_line(row["trace"], settings["batch_size"], second["trace"], other) is not None
    room = planner.CUBLAS_WORKSPACES * planner.CUBLAS_WORKSPACE_BYTES + room_mib * 2**20
    answers.append([lined] + [planner.largest_batch(settings, backend, world, 0, row, second, room, line=line)
                              for line in (True, False)])
with open(out, "w") as f:
    json.dump(answers, f)
"""


def test_the_largest_batch_from_lines_is_the_one_planned_batch_by_batch(tmp_path, data):
    """plan.py's largest batch comes from two plans, each allocation's bytes a line in the batch,
    and one plan at the answer. Searched with a plan at every batch it asks, the answer is the
    same, on two backends and memories."""
    small = ["--n_layer=1", "--n_embd=64", "--n_head=4", "--block_size=32", "--gradient_accumulation_steps=2",
             f"--data_dir={data}"]  # (cheap plans: the search by plans makes several)
    cases = [["custom_fsdp", 2, 6, small + ["--batch_size=4"]], ["ddp", 2, 20, small + ["--batch_size=3"]]]
    out = tmp_path / "answers.json"
    res = new_interpreter([sys.executable, "-c", LINE_AGAINST_PLANS, REPO, out, json.dumps(cases)], timeout=240)
    assert res.returncode == 0, res.describe()
    for (lined, from_lines, planned), case in zip(json.loads(out.read_text()), cases):
        assert lined and from_lines == planned > 0, (case, from_lines, planned)


def test_no_batch_fits_where_the_context_and_nccl_alone_take_more():
    """A GPU whose memory the CUDA context and NCCL's buffers exceed: no batch fits, answered at once."""
    settings = {"batch_size": 4}
    assert planner.largest_batch(settings, "ddp", 2, 0, row={}, second={}, limit=-1) == 0


def test_the_snapshot_is_the_cuda_models_replay_as_pytorch_reads_it(tmp_path, data):
    """plan.py --snapshot writes the CUDA model's replay as torch.cuda.memory._snapshot() gives one:
    PyTorch's own reader takes it on a machine without CUDA (stats, trace); its events add up to the
    plan's allocated peak and its segments to the reserve; what is allocated at the end is what its
    segments hold; each allocation names its storage's role and the moment, cuBLAS's workspaces first."""
    path, out = tmp_path / "memory.pickle", tmp_path / "plan.json"
    tiny = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=2"]
    res = new_interpreter([sys.executable, REPO / "plan.py", "--dist_backend=custom_fsdp", "--nproc=2", *tiny,
                           f"--data_dir={data}", f"--snapshot={path}", f"--json={out}"], timeout=120)
    assert res.returncode == 0, res.describe()
    assert f"memory snapshot of custom_fsdp at W=2, rank 0: {path}" in res.stdout
    (row,) = json.loads(out.read_text())
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:  # (the two readers side by side: each spends a second importing torch)
        reads = list(pool.map(lambda command: new_interpreter(
            [sys.executable, "-m", "torch.cuda._memory_viz", command, path], timeout=60), ("stats", "trace")))
    for read in reads:
        assert read.returncode == 0 and read.stdout, read.describe()
    assert "total_reserved" in reads[0].stdout and "cudaMalloc" in reads[1].stdout
    import pickle
    assert path.read_bytes()[:2] == b"\x80\x04"  # (protocol 4: pytorch.org/memory_viz reads 2 to 4)
    snapshot = pickle.loads(path.read_bytes())
    (events,) = snapshot["device_traces"]
    assert [e["time_us"] for e in events] == sorted({e["time_us"] for e in events})
    allocated = peak = 0
    live = {}
    for e in events:
        if e["action"] == "alloc":
            allocated += e["size"]
            peak = max(peak, allocated)
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            allocated -= live.pop(e["addr"])
    assert peak == row["cuda_allocated_bytes"]
    assert sum(s["total_size"] for s in snapshot["segments"]) == row["reserved_bytes"]
    held = {b["address"]: b["size"] for s in snapshot["segments"] for b in s["blocks"]
            if b["state"] == "active_allocated"}
    assert held == live  # (the viewer takes a held block whose alloc it did not see as made before the trace)
    allocs = [e for e in events if e["action"] == "alloc"]
    roles = [f["filename"].removeprefix("role: ") for e in allocs for f in e["frames"]
             if f["filename"].startswith("role: ")]
    assert len(roles) == len(allocs) and set(roles) <= {*planner.ROLES, "cublas_workspace"}, set(roles)
    assert roles[:planner.CUBLAS_WORKSPACES] == ["cublas_workspace"] * planner.CUBLAS_WORKSPACES
    assert {"activations", "parameters", "gradients", "optimizer_state", "gathered_parameters"} <= set(roles)
    assert any(f["name"].startswith("step 2 backward 0 @ h.") for e in allocs for f in e["frames"])
