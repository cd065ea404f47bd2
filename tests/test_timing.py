"""The time model (planner/timing.py): the replay's clocks and waits on hand-made ops, the FLOPs
and bytes it gives aten's ops, and plan.py's timed rows."""
import json
import sys

import torch

import planner.timing as timing
from conftest import REPO, launch

NOTHING = frozenset()


def device(host_runs_ahead, op_seconds=0.0):
    """1 GFLOP/s, 1 GB/s, 1 ms of latency and 1 GB/s of bus bandwidth: times read in round numbers."""
    return timing.Device("test", {torch.float32: 1e9}, 1e9, op_seconds, host_runs_ahead, {"all_gather": 1e-3},
                         {"all_gather": 1e9}, "made up")


def compute(flops=0, nbytes=0, reads=NOTHING, writes=NOTHING, sync=False):
    return timing.Op("compute", flops, nbytes, torch.float32, 1, reads, writes, sync, "")


def gather(nbytes, writes):  # at two ranks: half its bytes cross the link
    return timing.Op("all_gather", 0, nbytes, torch.float32, 2, NOTHING, writes, False, "")


def test_an_op_waits_for_the_collective_that_writes_what_it_reads():
    ops = [gather(2e6, frozenset({1})), compute(flops=1e6), compute(flops=1e6, reads=frozenset({1}))]
    t = timing.replay(ops, device(host_runs_ahead=False))
    # the gather: 1 ms + 1 MB over 1 GB/s = 2 ms; the first op (1 ms) hides half of it
    assert abs(t.seconds - 3e-3) < 1e-12 and abs(t.exposed_comm_seconds - 1e-3) < 1e-12
    assert abs(t.compute_seconds - 2e-3) < 1e-12 and abs(t.comm_seconds - 2e-3) < 1e-12 and t.flops == 2e6


def test_a_collective_hidden_under_independent_compute_costs_nothing():
    ops = [gather(2e6, frozenset({1})), compute(nbytes=5e6), compute(flops=1e3, reads=frozenset({1}))]
    t = timing.replay(ops, device(host_runs_ahead=False))
    assert t.exposed_comm_seconds == 0 and abs(t.seconds - (5e-3 + 1e-6)) < 1e-12


def test_a_cpu_rank_without_a_spare_core_computes_nothing_beside_its_collectives():
    """At W >= cores gloo's threads run on the core the rank computes on: the gather that independent
    compute hid above now adds its whole length, and counts as exposed."""
    ops = [gather(2e6, frozenset({1})), compute(nbytes=5e6), compute(flops=1e3, reads=frozenset({1}))]
    t = timing.replay(ops, device(host_runs_ahead=False)._replace(comm_on_compute_core=True))
    assert abs(t.seconds - (2e-3 + 5e-3 + 1e-6)) < 1e-12 and abs(t.exposed_comm_seconds - 2e-3) < 1e-12


def test_on_shared_cores_compute_and_gloo_split_the_core_and_a_wait_leaves_gloo_the_whole_of_it():
    """A gather of 2 ms alone, 4 ms beside compute, which it slows to half speed: the 1 ms op beside it
    takes 2 ms and leaves the gather half done; the op that reads the gather then waits 1 ms more,
    gloo alone at full speed. Exposed: the slowdown (1 ms) and the wait (1 ms)."""
    ops = [gather(2e6, frozenset({1})), compute(flops=1e6), compute(reads=frozenset({1}))]
    d = device(host_runs_ahead=False)._replace(comm_on_compute_core=True, comm_points={"all_gather": [(1e6, 4e-3)]},
                                                comm_idle_points={"all_gather": [(1e6, 2e-3)]}, comm_takes=0.5)
    bars = []
    t = timing.replay(ops, d, bars)
    assert abs(t.seconds - 3e-3) < 1e-12 and abs(t.exposed_comm_seconds - 2e-3) < 1e-12
    assert abs(t.compute_seconds - 1e-3) < 1e-12 and abs(t.comm_seconds - 3e-3) < 1e-12
    assert [lane for lane, *_ in bars] == ["compute", "all_gather", "exposed", "compute"]
    assert timing.interpolate([(1, 1.0), (3, 2.0)], 2) == 1.5 and timing.interpolate([(1, 1.0), (3, 2.0)], 5) == 3.0
    assert timing.interpolate([(1, 1.0), (3, 2.0)], 0.5) == 1.0


def test_the_replay_draws_as_lanes_with_phases():
    """timing.lanes: what overlap.py draws of a predicted step; compute merged across the host's gap."""
    ops = [gather(2e6, frozenset({1}))._replace(where="step 2 forward 0 @ h.0"),
           *[compute(flops=1e6)._replace(where="step 2 forward 0 @ h.0") for _ in range(2)],
           compute(flops=1e6, reads=frozenset({1}))._replace(where="step 2 backward 0 @ h.0")]
    bars = []
    d = device(host_runs_ahead=False, op_seconds=1e-4)
    t = timing.replay(ops, d, bars)
    drawn = timing.lanes(bars, t.seconds, d)
    assert [phase for _, phase in drawn["phases"]] == ["forward 0", "backward 0"]
    assert len(drawn["lanes"]["compute"]) == 1 and len(drawn["lanes"]["all-gather"]) == 1
    assert abs(drawn["step_ms"] - t.seconds * 1e3) < 1e-12 and drawn["exposed"] == []


def test_a_gpu_is_host_bound_when_its_ops_are_short_and_waits_only_at_a_sync():
    short = [compute(flops=1e3) for _ in range(10)]  # 1 µs each on the device, 10 µs each to issue
    t = timing.replay(short, device(host_runs_ahead=True, op_seconds=10e-6))
    assert abs(t.seconds - 101e-6) < 1e-12 and abs(t.compute_seconds - 10e-6) < 1e-12  # (the last runs after its issue)
    long = [compute(flops=1e6) for _ in range(3)] + [compute(sync=True)]  # 1 ms each: the host runs ahead
    t = timing.replay(long, device(host_runs_ahead=True, op_seconds=10e-6))
    assert abs(t.seconds - (10e-6 + 3e-3)) < 1e-9


def test_a_gpus_figures_are_plan_checks_measured_ones_where_results_hold_them(tmp_path, monkeypatch):
    """timing.gpu takes the newest "time_model" figures scripts/plan_check.py wrote for that GPU into
    results/, and names the file; another GPU's, or none, leaves the assumed efficiencies."""
    import sys
    sys.path.insert(0, str(REPO / "scripts"))
    import plan_check
    monkeypatch.setattr(timing, "RESULTS", str(tmp_path))
    assumed = timing.gpu("h100", 1e11)
    assert "(assumed)" in assumed.source and assumed.bandwidth == 3.35e12 * timing.MEMORY_EFFICIENCY
    speed = {"matmul_bf16_flops": 0.5 * 989e12, "memory_bytes_per_second": 0.9 * 3.35e12, "op_seconds": 5e-6}
    figures = plan_check.time_model_figures(speed, "cuda: NVIDIA H100 80GB HBM3")
    assert figures["gpu"] == "h100" and abs(figures["matmul_efficiency"] - 0.5) < 1e-12
    for name, date, gpu in (("old", "2026-01-01", "h100"), ("new", "2026-06-01", "h100"), ("other", "2026-09-01", "a100")):
        matmul = {"old": 0.3, "new": 0.5, "other": 0.7}[name]
        (tmp_path / f"{name}.json").write_text(json.dumps({"date": date, "time_model": dict(
            figures, gpu=gpu, matmul_efficiency=matmul)}))
    (tmp_path / "bench.json").write_text(json.dumps({"date": "2026-12-01", "backends": {}}))
    measured = timing.gpu("h100", 1e11)
    assert measured.flops_per_second(torch.bfloat16) == 989e12 * 0.5 and measured.op_seconds == 5e-6
    assert "new.json" in measured.source and "plan_check.py measured" in measured.source
    assert plan_check.time_model_figures(dict.fromkeys(speed), "cuda: NVIDIA H100") is None


def test_aten_ops_get_torchs_flops_and_the_bytes_they_move():
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    mm = timing.compute_op(torch.ops.aten.mm.default, (a, b), {}, a @ b, "")
    assert mm.flops == 2 * 8 * 16 * 4 and mm.nbytes == 4 * (8 * 16 + 16 * 4 + 8 * 4)
    view = timing.compute_op(torch.ops.aten.view.default, (a, [128]), {}, a.view(128), "")
    assert view.flops == 0 and view.nbytes == 0
    item = timing.compute_op(torch.ops.aten._local_scalar_dense.default, (a[0, 0],), {}, 1.0, "")
    assert item.sync


def test_ddps_buckets_are_all_reduced_in_the_backward_that_syncs_them():
    """The plan runs DDP's reducer as ops: each gradient copied into its bucket divided by W, each
    bucket all-reduced once its gradients are in, during the last micro-step's backward (so the
    replay overlaps it with the rest of backward), every gradient copied back after the last."""
    import training
    from planner import step
    settings = training.settings(["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=2",
                                  "--gradient_accumulation_steps=4", "--dropout=0.0", "--compile=False"])
    settings["vocab_size"] = 65
    counter, _, local_steps = step.run(settings, "ddp", 2, 0, timed=True)
    assert local_steps == 2
    wheres = [(op.kind, op.where) for op in counter.ops]
    buckets = [i for i, (kind, where) in enumerate(wheres) if "ddp's bucket" in where]
    assert buckets and all(wheres[i][0] == "all_reduce" and "step 2 backward 1" in wheres[i][1] for i in buckets)
    clip = next(i for i, (_, where) in enumerate(wheres) if where.startswith("step 2 clip"))
    assert max(buckets) < clip
    params = sum(p.numel() for p in step.meta_model(settings).parameters())
    assert counter.comm["all_reduce"] == 4 * params + 4  # (every gradient once, float32; and the loss)


def test_plan_times_each_row_on_the_gpu_it_is_asked_for(tmp_path):
    """--gpu=h100: every row is timed; tokens/s is the global batch over the step, the MFU below 1,
    and one rank's step has no communication to expose. --lanes_json: each row's predicted step,
    which overlap.py draws as a group of lanes."""
    import pickle
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65}))
    out = tmp_path / "plan.json"
    res = launch([sys.executable, REPO / "plan.py", "--dist_backend=custom_fsdp", "--nproc=1,2", "--gpu=h100",
                  "--n_layer=2", "--n_embd=64", "--n_head=4", "--batch_size=4", "--block_size=32",
                  f"--data_dir={tmp_path}", f"--json={out}", f"--lanes_json={tmp_path / 'lanes.json'}"],
                 timeout=180, fork=False)
    assert res.returncode == 0, res.describe()
    rows = json.loads(out.read_text())
    for r in rows:
        assert r["device"] == "h100" and r["step_seconds"] > 0
        assert abs(r["tokens_per_second"] * r["step_seconds"] - 4 * 4 * 32) < 1e-6
        assert 0 < r["mfu"] < 1 and r["step_seconds"] >= r["compute_seconds"]
    assert rows[0]["exposed_comm_seconds"] == 0 and rows[1]["comm_busy_seconds"] > 0
    assert "step ms" in res.stdout and max(len(line) for line in res.stdout.splitlines()) <= 120
    import overlap
    groups = overlap.groups(str(tmp_path / "lanes.json"))
    assert [name for name, _ in groups] == ["custom_fsdp W=1 rank 0, predicted", "custom_fsdp W=2 rank 0, predicted"]
    for row, (_, (steps, by_lane, exposed, phases)) in zip(rows, groups):
        assert abs(steps[0][1] - row["step_seconds"] * 1e3) < 1e-9 and by_lane["compute"]
        names = [p for _, p in phases]
        assert names[:2] == ["forward 0", "backward 0"] and names[-3:] == ["clip", "optimizer", "zero_grad"], phases
    assert not groups[0][1][1]["all-gather"] and groups[1][1][1]["all-gather"]
    overlap.draw([str(tmp_path / "lanes.json")], str(tmp_path / "lanes.png"))
    assert (tmp_path / "lanes.png").stat().st_size > 0


def test_search_ranks_the_settings_that_fit_by_time_and_prints_the_best_command(tmp_path):
    """--search over activation checkpointing alone: recomputing every block's forward costs time,
    so the plain run ranks first; the GPU's memory given (--gpu_mem_gib) between the two rows'
    needs, only the checkpointed one fits, and its command line is the one printed."""
    import pickle
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65}))
    model = ["--n_layer=2", "--n_embd=64", "--n_head=4", "--batch_size=16", "--block_size=64", f"--data_dir={tmp_path}"]
    grid = "--search=activation_checkpointing=False,True wrap_policy=block reshard_after_forward=True micro_batch=same"

    def searched(*extra):
        out = tmp_path / "search.json"
        res = launch([sys.executable, REPO / "plan.py", "--dist_backend=custom_fsdp", "--nproc=2", "--gpu=h100",
                      *model, grid, f"--json={out}", *extra], timeout=180, fork=False)
        assert res.returncode == 0, res.describe()
        return res.stdout, json.loads(out.read_text())
    stdout, rows = searched()
    assert [r["settings"]["activation_checkpointing"] for r in rows] == [False, True], rows
    assert rows[0]["tokens_per_second"] > rows[1]["tokens_per_second"] and all(r["fits"] for r in rows)
    assert "--activation_checkpointing=False" in stdout.splitlines()[-1]
    need = [(r["reserved_bytes"] + r["outside_allocator_bytes"]) / 2**30 for r in rows]
    assert need[1] < need[0]
    stdout, rows = searched(f"--gpu_mem_gib={(need[0] + need[1]) / 2}")
    fitting = [r for r in rows if r["fits"]]
    assert [r["settings"]["activation_checkpointing"] for r in fitting] == [True], rows
    assert "--activation_checkpointing=True" in stdout.splitlines()[-1] and "1 of 3 planned settings fit" in stdout


def test_a_grid_may_name_group_sizes_prefetch_and_hsdp_degrees():
    """--search's optional axes: reshard_after_forward as a group size, prefetch, replicate_degree;
    a degree that does not divide W is no setting, and the global batch stays the run's."""
    from planner import search
    grid = search.parse_grid("reshard_after_forward=True,2 prefetch=False replicate_degree=1,3")
    assert grid["reshard_after_forward"] == (True, 2) and grid["prefetch"] == (False,)
    assert grid["wrap_policy"] == search.GRID["wrap_policy"]  # (the axes it does not name: the default grid's)
    run = {"batch_size": 4, "gradient_accumulation_steps": 8}
    choice = {"micro_batch": "double", "replicate_degree": 2, "prefetch": False}
    assert search.settings_of(run, 4, choice) == {"batch_size": 8, "gradient_accumulation_steps": 4,
                                                  "replicate_degree": 2, "prefetch": False}
    assert search.settings_of(run, 4, dict(choice, replicate_degree=3)) is None
    assert search.settings_of(run, 4, {"micro_batch": "same"})["prefetch"] is True
