"""
FSDP2's all-gather extension, fsdp_impl against FSDP2 on CPU with gloo at 2 and 3 ranks: torchao's
float8 training with float8 all-gather, and a hand-written subclass with the hooks (two inputs of
two dtypes, the five-argument hook, uneven shards). Then the refusals.
(reshard_after_forward=2 beside the extension, which both refuse: tests/test_reshard.py.)

tests/extension_worker.py is launched once per world size and writes a JSON report. Every
comparison is bitwise: the gathered inputs are copies, and gloo's reductions are deterministic.
"""
import json

import pytest

from conftest import REPO, launch, launcher

WORKER = REPO / "tests" / "extension_worker.py"
CASES = ["float8_zero3", "float8_zero2", "float8_accumulation", "float8_bf16", "halves", "halves_zero2_accumulation",
         "halves_mesh_only"]


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def report(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("extension") / "extension.json"
    res = launch(launcher(request.param) + [WORKER, out], timeout=240)
    if not out.exists():
        pytest.fail(f"{WORKER.name} wrote no report: {res.describe()}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_extension_trains_as_fsdp2(report, case):
    """The parameters after three steps and the last step's grads, on every rank, bit for bit."""
    r = report[case]
    assert "error" not in r, r["error"]
    assert r["params_moved"], "the reference did not train: the comparison would be vacuous"
    assert r["params_bitwise"] and r["grads_bitwise"], r


@pytest.mark.parametrize("case", CASES)
def test_extension_gathers_fsdp2s_bytes(report, case):
    """Both issue the same all-gathers and reduce-scatters, byte for byte; fsdp_impl's ledger agrees."""
    r = report[case]
    assert "error" not in r, r["error"]
    assert r["ours_bytes"] == r["fsdp2_bytes"], r
    assert r["ours_ledger"]["all_gather"] == r["ours_bytes"]["all_gather"], r


def test_float8_weights_are_gathered_in_one_byte(report):
    """ZeRO-3 gathers each unit twice a step: its float8 weights at one byte an element and its float32
    biases at four. (48x96, 96x48 and 48x48 weights, 3 steps.) Without the extension it is 4x."""
    weights, biases, steps = 48 * 96 + 96 * 48 + 48 * 48, 96 + 48 + 48, 3
    assert report["float8_zero3"]["fsdp2_bytes"]["all_gather"] == steps * 2 * (weights * 1 + biases * 4)


def test_extension_refusals_match_fsdp2(report):
    """One hook defined without the other (at fully_shard), and an unevenly sharded parameter's
    inputs returned without their padding (on a rank with padding): FSDP2's exception types, one line."""
    r = report["refusals"]
    assert "error" not in r, r["error"]
    assert r["fsdp2"]["one_hook"]["type"] == r["ours"]["one_hook"]["type"] == "AssertionError", r
    assert r["fsdp2"]["unpadded"]["type"] == r["ours"]["unpadded"]["type"] == "AssertionError", r
    assert r["ours"]["one_hook"]["lines"] == r["ours"]["unpadded"]["lines"] == 1, r
