"""
reshard_after_forward=2, fsdp_impl against FSDP2 on CPU with gloo at 4 ranks, all data parallel:
after forward each rank keeps its piece of the parameters gathered over a group of 2 (FSDP2's
reshard to a smaller group), so backward gathers within that group. Plain, bf16 with accumulation,
with a unit of two dtypes, and under HSDP (replicate=1, shard=4); and where it is refused.

tests/reshard_worker.py is launched once and writes a JSON report; the tests below assert on it.
Every comparison is bitwise: the gathered parameters are copies wherever they come from, and gloo's
reductions are deterministic.

The values reshard_after_forward takes, an int among them, are tested last. The other reshard
settings are tested elsewhere: False (ZeRO-2) and
set_reshard_after_backward(False) in its parity modes zero2 and no_reshard_after_backward*; train.py's
--reshard_after_forward=False in tests/test_bench.py, its units kept gathered through accumulation in
tests/test_train.py (tests/accum_worker.py), and on GPUs in tests/test_cuda_multi.py.
"""
import pytest

from conftest import REPO
from test_tensor_parallel import assert_trained_as_fsdp2, worker_report

WORKER = REPO / "tests" / "reshard_worker.py"
CASES = ["reshard_to_2", "reshard_to_2_bf16_accumulation", "reshard_to_2_frozen_bf16", "hsdp_reshard_to_2"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return worker_report(tmp_path_factory, WORKER, "reshard")


@pytest.mark.parametrize("case", CASES)
def test_resharding_to_a_smaller_group_trains_as_fsdp2(report, case):
    """The gathered parameters are copies wherever they come from, so training is FSDP2's, bit for bit."""
    r = assert_trained_as_fsdp2(report, case)
    assert r["ours_specs"] == r["fsdp2_specs"]


@pytest.mark.parametrize("case", CASES)
def test_backward_gathers_within_the_smaller_group(report, case):
    """Forward gathers over the 4 ranks, backward over groups of 2, as FSDP2's collectives (their
    sizes too, but for a unit of two dtypes: fsdp_impl's byte layout aligns each parameter to 16
    bytes); fsdp_impl's ledger names the smaller group's all-gathers."""
    r = report[case]
    ours, theirs = r["ours_gathers"], r["fsdp2_gathers"]
    assert {size for size, _ in theirs["forward"]} == {4} and {size for size, _ in theirs["backward"]} == {2}, theirs
    for phase in ("forward", "backward"):
        assert [size for size, _ in ours[phase]] == [size for size, _ in theirs[phase]], (phase, ours, theirs)
        assert ours[phase] == theirs[phase] or case == "reshard_to_2_frozen_bf16", (phase, ours, theirs)
    assert ours["forward_events"] == ["all_gather"] * len(ours["forward"]), ours
    assert ours["backward_events"] == ["all_gather_in_smaller_group"] * len(ours["backward"]), ours


def test_resharding_to_a_smaller_group_is_refused_where_fsdp2_refuses_it(report):
    """Beside a tensor parallel parameter FSDP2 refuses it (at the first forward; fsdp_impl at
    fully_shard), beside a parameter with the all-gather extension (in backward; fsdp_impl at
    fully_shard), and a size that does not divide the shard group's; beside matrices sharded on dim 1
    FSDP2 fails, and fsdp_impl refuses it. Each in one line."""
    r = report["reshard_to_2_refusals"]
    assert {k: v["type"] for k, v in r["fsdp2"].items()} == {
        "tensor_parallel": "NotImplementedError", "not_a_factor": "ValueError", "extension": "NotImplementedError"}, r
    r["fsdp2"]["extension"]["lines"] = 1  # (FSDP2's says nothing: an empty message; fsdp_impl's names the cause)
    assert r["ours"] == {**r["fsdp2"], "dim_1": {"type": "NotImplementedError", "lines": 1}}, r


@pytest.mark.parametrize("value, expected", [(True, (True, None)), (False, (False, None)), (None, (None, None)),
                                             (4, (True, None)), (1, (False, None)), (2, (True, 2))])
def test_reshard_after_forward_takes_fsdp2s_values(value, expected):
    """FSDP2 reads an int as the size of the group to reshard to after forward: the whole shard group
    is True, one rank is False, another factor of the group's size a smaller group (the
    tests above train with it)."""
    from fsdp_impl.unit import reshard_after_forward_flag
    assert reshard_after_forward_flag(value, 4) == expected


@pytest.mark.parametrize("value", [3, 0, -2, 8, "yes", 1.0])
def test_reshard_after_forward_refuses_what_it_cannot_do(value):
    from fsdp_impl.unit import reshard_after_forward_flag
    with pytest.raises(ValueError, match="reshard_after_forward"):
        reshard_after_forward_flag(value, 4)
