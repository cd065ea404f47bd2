"""
Tensor parallel then fully_shard (FSDP2's "2-D parallelism"), fsdp_impl against FSDP2 on CPU with
gloo at 4 ranks: a (dp=2, tp=2) mesh, with float32 and bf16 parameters, each with and without
gradient accumulation, and HSDP over tp on a (replicate=2, shard=1, tp=2) mesh; the same with
shard_placement_fn putting the matrices on dim 1 (Shard(1), and _StridedShard(1) where tp splits dim
1 too), and a tp-local dim 1 that does not split evenly over dp, refused as FSDP2 refuses it.
(reshard_after_forward=2 beside a tensor parallel parameter, which both refuse: tests/test_reshard.py.)

tests/tp_worker.py is launched once and writes a JSON report; the tests below assert on it. Every
comparison is bitwise: both implementations run DTensor's same tensor parallel ops, and gloo
reduces 2 ranks as (a + b) / 2, deterministically.
"""
import json

import pytest

from conftest import REPO, launch, launcher

WORKER = REPO / "tests" / "tp_worker.py"
CASES = ["fsdp_over_tp", "fsdp_over_tp_bf16", "fsdp_over_tp_accumulation", "fsdp_over_tp_bf16_accumulation",
         "hsdp_over_tp", "fsdp_over_tp_dim_1", "fsdp_over_tp_dim_1_bf16_accumulation", "hsdp_over_tp_dim_1"]


def worker_report(tmp_path_factory, worker, name):
    """A 4-rank worker's JSON report (tests/mesh_training.py's write_report), launched once per module."""
    out = tmp_path_factory.mktemp(name) / f"{name}.json"
    res = launch(launcher(4) + [worker, out], timeout=240)
    if not out.exists():
        pytest.fail(f"{worker.name} wrote no report: {res.describe()}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return worker_report(tmp_path_factory, WORKER, "tp")


def assert_trained_as_fsdp2(report, case):
    r = report[case]
    for impl in ("ours", "fsdp2"):
        assert f"{impl}_error" not in r, f"{impl} raised in {case}:\n{r[f'{impl}_error']}"
    assert r["params_moved"]["fsdp2"], "the reference did not train: the comparison would be vacuous"
    assert r["params_bitwise"] and all(r["params_bitwise"].values()), r["params_bitwise"]
    assert r["grads_bitwise"] and all(r["grads_bitwise"].values()), r["grads_bitwise"]
    return r


@pytest.mark.parametrize("case", CASES)
def test_fsdp_over_tp_trains_as_fsdp2(report, case):
    """Each parameter is sharded over dp as well as tp: a DTensor parameter left unsharded would train
    with its grads never reduced over dp, and the parameters would drift apart across dp ranks."""
    assert_trained_as_fsdp2(report, case)


@pytest.mark.parametrize("case", CASES)
def test_sharded_parameters_are_fsdp2s_dtensors(report, case):
    """The sharded parameters a checkpoint sees have FSDP2's mesh dims, placements (_StridedShard
    where tp shards dim 0 too) and local shapes, so sharded state dicts of the two agree."""
    r = report[case]
    strided = "_StridedShard(dim=1" if "dim_1" in case else "_StridedShard"
    assert any(strided in str(spec) for spec in r["fsdp2_specs"].values())  # the case is exercised
    assert r["ours_specs"] == r["fsdp2_specs"]


def test_uneven_dim_1_of_a_tp_local_tensor_is_refused_as_fsdp2_refuses_it(report):
    """The split that must be even is the tp-local tensor's, not the global one's."""
    r = report["uneven_dim_1_of_a_tp_local_tensor"]
    assert r["fsdp2"] and r["fsdp2"]["type"] == "NotImplementedError", r  # the reference behaviour
    assert r["ours"] == {"type": r["fsdp2"]["type"], "lines": 1}, r
