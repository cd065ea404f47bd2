"""
fsdp_impl against PyTorch's FSDP2 in unusual training flows, on CPU with gloo at 2 ranks.

tests/flows_worker.py is launched once (tests/spawn.py) and writes a JSON report; the tests below assert
on it. A flow is a function the worker registers with @flow: it trains an fsdp_impl model and a
reference built from the same seed on the same data for a few AdamW steps, and
test_flow_matches_reference compares the two, once per flow. The flows take training off train.py's
path: several backward passes over one forward, activation checkpointing, requires_grad_() and
load_state_dict(assign=True) between steps, grouped units with modules skipped or run alone,
accumulation and HSDP with the reductions switched per micro-step, recovery with reset_iter_state(),
inference_mode, code written for FSDP2 that trained wrongly or crashed on fsdp_impl, and FSDP2's API
beyond train.py's (divide factors, hooks, shard_placement_fn, mixed precision, LoRA's units). The
other tests each check one behaviour against FSDP2's: what is raised, what a report or a layout holds.

The reference is FSDP2, except in the flows where FSDP2 (torch 2.13) computes something else than
plain PyTorch, which say how in their @flow(fsdp2_differs=...). There the reference is the plain
model, its grads averaged over the ranks before each step (all_reduce AVG). In the other float32
flows FSDP2 matches that plain model bit for bit too (checked when the flows were written), so
matching FSDP2 means computing the right thing.

Every comparison is bitwise: the implementations run the same kernels on the same numbers and the
same reductions ((a + b) / 2 on gloo at 2 ranks, which is deterministic), so any difference is a
real one.
"""
import ast
import json

import pytest
import torch

from conftest import REPO, launch, launcher

WORKER = REPO / "tests" / "flows_worker.py"
LAUNCH_TIMEOUT_S = 240


def registered_flows():
    """The names of the functions tests/flows_worker.py registers with @flow, in its order. Read from
    its source: importing it would import fsdp_impl while collecting, where an error would stop the
    whole suite's collection instead of failing these tests."""
    def is_flow(decorator):  # @flow or @flow(...)
        decorator = getattr(decorator, "func", decorator)
        return isinstance(decorator, ast.Name) and decorator.id == "flow"
    return [node.name for node in ast.parse(WORKER.read_text()).body
            if isinstance(node, ast.FunctionDef) and any(map(is_flow, node.decorator_list))]


FLOWS = registered_flows()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The worker's report, plus its exit code and output (the last flow may kill the process)."""
    out = tmp_path_factory.mktemp("flows") / "flows.json"
    res = launch(launcher(2) + [WORKER, out], timeout=LAUNCH_TIMEOUT_S)
    if not out.exists():
        pytest.fail(f"the flows worker wrote no report: {res.describe()}")
    rep = json.loads(out.read_text())
    rep["launch_result"] = res
    return rep


# The flows are written against FSDP2 in torch 2.13. FSDP2 in an earlier release (2.11, the GPU
# machine's) lacks some of that API and computes otherwise in a few flows: there a comparison with
# it skips, saying how the reference differs. In 2.13 such a difference fails.
REFERENCE_RELEASE = (2, 13)
RELEASE = tuple(int(n) for n in torch.__version__.split("+")[0].split(".")[:2])


def reference_holds(ok, how):
    """The reference behaves as the test expects, or (before 2.13) the test skips saying how not."""
    if not ok:
        if RELEASE >= REFERENCE_RELEASE:
            pytest.fail(f"FSDP2, the reference, {how}")
        pytest.skip(f"FSDP2 in torch {torch.__version__}, the reference, {how}")


def last_line(traceback):
    return (traceback.strip().splitlines() or [""])[-1]


def checked(report, name):
    """A check's records by implementation: fails with the traceback where ours raised, and asks
    reference_holds where FSDP2 did."""
    r = report[name]
    for impl, rec in r.items():
        if isinstance(rec, dict) and "error" in rec:
            if impl == "ours":
                pytest.fail(f"ours raised in {name}:\n{rec['error']}")
            reference_holds(False, f"raised in {name}: {last_line(rec['error'])}")
    return r


@pytest.mark.parametrize("flow", FLOWS)
def test_flow_matches_reference(report, flow):
    r = report[flow]
    assert "ours_error" not in r, f"ours raised in {flow}:\n{r['ours_error']}"
    if r["reference"] == "fsdp2":
        reference_holds("fsdp2_error" not in r, f"raised: {last_line(r.get('fsdp2_error', ''))}")
    assert "plain_error" not in r, f"the plain model raised in {flow}:\n{r['plain_error']}"
    # the parameters moved (so the comparison is not between untouched inits); equality carries it to ours
    assert r["params_moved"]["reference"], "the reference's parameters did not move: the comparison would be vacuous"
    tol = r["tolerance"]  # 0 (bitwise) but where the worker says why the summation order differs
    assert r["param_diff"] <= tol and (tol or r["param_bitwise"]), f"final parameters differ by up to {r['param_diff']}"
    assert r["grad_diff"] <= tol and (tol or r["grad_bitwise"]), f"the last step's grads differ by up to {r['grad_diff']}"


def test_every_flow_the_worker_ran_is_tested(report):
    """The flows read from the worker's source are those it compared, in its order: a flow
    registered otherwise than by a top-level @flow would run untested."""
    compared = [name for name, rec in report.items() if isinstance(rec, dict) and "reference" in rec]
    assert compared == FLOWS


def test_grouped_unit_casts_every_modules_output(report):
    r = checked(report, "grouped_unit_output_dtypes")
    expected = {f"blocks.{i}": "torch.float32" for i in range(3)}
    assert r["ours"] == expected, r
    reference_holds(r["fsdp2"] == expected, f"returns {r['fsdp2']}")


def test_memory_report_is_the_largest_rank_s(report):
    """train.py's memory rows (observe.Observer.memory) hold the largest of the ranks' figures, each
    rank's its own local ones: rank 0 holds 3 of a Linear(3, 5)'s 5 rows and rank 1 two, rank 0 has
    dropped its grads, and rank 1 has the larger peak RSS. Not the sum over the ranks, nor any one
    rank's figures."""
    for impl in ("fsdp2", "ours"):
        rec = checked(report, "memory_report_of_uneven_shards")[impl]
        row, ranks = rec["row"], rec["ranks"]
        by_rank = {key: [r[key] for r in ranks] for key in ("params_mb", "grads_mb", "optim_mb")}
        # uneven, each way round, so that a sum, a min or one rank's figure would differ from the max
        assert by_rank["params_mb"][0] > by_rank["params_mb"][1] > 0, (impl, by_rank)
        assert by_rank["optim_mb"][0] > by_rank["optim_mb"][1] > 0, (impl, by_rank)
        assert by_rank["grads_mb"][1] > by_rank["grads_mb"][0] == 0, (impl, by_rank)
        assert ranks[1]["rss_before"] > ranks[0]["rss_after"], (impl, ranks)
        for key, mine in by_rank.items():
            assert row[key] == max(mine), (impl, key, row[key], mine)
        assert ranks[1]["rss_before"] <= row["rss_mb"] <= ranks[1]["rss_after"], (impl, row, ranks)
        assert row["event"] == "memory" and row["stage"] == "after first step"


def test_model_is_freed_once_dropped(report):
    """A trained model is garbage once its last reference goes (a hook holding its unit would keep
    every model ever built alive, flat shards and all)."""
    r = checked(report, "freed_after_del")
    assert r["fsdp2"], r  # the reference behaviour
    assert r["ours"], "the model outlived its last reference"


def test_the_input_gate_keeps_containers_and_overlap(report):
    """The gate on a unit's inputs (which runs its post-backward) does not hand the module a copy of
    a list argument, and a forward whose output was dropped leaves no stale gate behind: in the
    next step each block still reduce-scatters before the next block's backward starts."""
    r = checked(report, "list_argument_and_dropped_forward")
    assert r["ours"]["list_entries"] == 1, "the module appended to a copy of the caller's list"
    expected = ["backward:root"] + [f"{e}:blocks.{i}" for i in (2, 1, 0) for e in ("backward", "backward_end")] \
        + ["backward_end:root"]
    assert r["ours"]["order"] == expected, r["ours"]["order"]
    reference_holds(r["fsdp2"]["list_entries"] == 1, "hands the module a copy of a list argument")


@pytest.mark.parametrize("setting", ["default", "empty_lists", "explicit_lists"])
def test_each_prefetch_setting_issues_fsdp2s_collectives_in_fsdp2s_order(report, setting):
    """A step as a rank sees it: each collective issued (kind and size), each unit's forward starting
    and the gradient reaching each unit's computation, under ours and FSDP2, the same. With no
    lists, or empty ones, nothing is prefetched in forward, and in backward each unit gathers the
    unit that runs backward next before its own gradient is computed."""
    r = checked(report, "prefetch_orders")
    ours, theirs = r["ours"][setting], r["fsdp2"][setting]
    first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    assert ours == theirs, (f"{setting}: from event {first_difference} on, ours {ours[first_difference:]} "
                            f"against FSDP2's {theirs[first_difference:]}")
    after_forward = max(i for i, e in enumerate(ours) if e.startswith("forward:"))
    gathered_when = [e for e in ours[:after_forward + 1] if e.startswith(("all_gather", "forward"))]
    if setting == "explicit_lists":  # (train.py's: each unit's forward issues the next unit's gather)
        assert gathered_when[:3] == ["all_gather:90", "all_gather:144", "forward:root"], gathered_when
    else:  # (each unit gathered at its own forward, none ahead)
        assert gathered_when == [x for i in range(4) for x in ([f"all_gather:{90 if i == 0 else 144}",
                                                                "forward:" + ("root" if i == 0 else f"blocks.{i - 1}")])]
    # backward: the gathers issued before each unit's gradient (the root's, blocks.2's, .1's, .0's);
    # prefetching, the root gathers blocks.2, and blocks.0 is there before blocks.1 has finished
    marks = [i for i, e in enumerate(ours) if e.startswith("grad:")]
    bounds = [after_forward] + marks
    gathers = [sum(e.startswith("all_gather") for e in ours[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert [ours[i] for i in marks] == ["grad:root", "grad:blocks.2", "grad:blocks.1", "grad:blocks.0"], ours
    assert gathers == [1, 1, 1, 0], (gathers, ours)


def test_a_late_unshard_handle_wait_gathers_nothing(report):
    """wait() on an unshard handle whose gather the forward already used and freed does nothing: it
    must not gather the block again and leave it gathered (its DTensors unregistered)."""
    r = checked(report, "late_unshard_handle_wait")
    assert r["fsdp2"]["sharded_after_wait"], r  # the reference behaviour
    assert r["ours"]["sharded_after_wait"], "the late wait gathered blocks.0 again"


def test_fully_shard_twice_is_a_clear_error(report):
    r = checked(report, "fully_shard_twice")
    assert r["fsdp2"]["raised"] and r["fsdp2"]["trains_after"], r["fsdp2"]  # the reference behaviour
    assert r["ours"]["raised"] == r["fsdp2"]["raised"] and "once per module" in r["ours"]["message"], r["ours"]
    assert r["ours"]["trains_after"], f"the failed call left the model broken:\n{r['ours'].get('traceback')}"


def test_a_submodules_state_dict_is_sharded_while_its_unit_is_gathered(report):
    """state_dict() on a module holding some of a gathered unit's parameters reshards first, as on
    the unit's own module: it returned the gathered tensors, and loading DTensors failed."""
    r = checked(report, "submodule_state_dict_while_gathered")
    assert r["fsdp2"] == {"dtensors": True, "loaded": True}, r  # the reference behaviour
    assert r["ours"] == r["fsdp2"], r["ours"]


def test_a_meta_model_first_forward_is_a_clear_error(report):
    r = checked(report, "meta_model_first_forward")
    assert r["fsdp2"]["raised"] == "RuntimeError", r  # the reference behaviour
    assert r["ours"]["raised"] == "RuntimeError" and "meta device" in r["ours"]["message"], r["ours"]


def test_compiling_a_blocks_call_leaves_the_hooks_out_of_its_graphs(report):
    r = checked(report, "graphs_of_compiled_blocks")
    assert r["ours"] == r["fsdp2"], r


def test_deepcopy_is_a_clear_error(report):
    """FSDP2 refuses copy.deepcopy of a sharded model in a sentence; ours failed deep in torch's
    storage code ("invalid python storage")."""
    r = checked(report, "deepcopy_of_a_sharded_model")
    assert r["fsdp2"]["raised"], r["fsdp2"]  # the reference behaviour
    assert r["ours"]["raised"] == r["fsdp2"]["raised"] and "state_dict" in r["ours"]["message"], r["ours"]
    assert r["ours"]["trains_after"], f"the model was left broken:\n{r['ours'].get('traceback')}"


def test_backward_without_its_gather_is_an_error(report):
    """A unit whose output hook was lost (an in-place op on a view output) must not train on
    parameters still arriving: their storage stays empty until the gather's wait, so its backward
    raises a RuntimeError, as FSDP2's does, and reset_iter_state() recovers the model."""
    r = checked(report, "inplace_on_a_view_output")
    assert r["fsdp2"]["raised"] == "RuntimeError", r["fsdp2"]  # the reference behaviour
    assert r["ours"]["raised"] == "RuntimeError", r["ours"]
    assert r["ours"]["trains_after"], f"reset_iter_state() left the model broken:\n{r['ours'].get('traceback')}"


def test_non_root_forward_first_raises(report):
    """A block run before the root's first forward: a clear RuntimeError naming the root, as FSDP2
    gives, not a crash (the worker runs this last, after writing the other flows' results)."""
    res = report["launch_result"]
    assert "non_root_forward_first" in report, f"the worker crashed in this flow: {res.describe()}"
    assert res.returncode == 0, res.describe()
    r = report["non_root_forward_first"]
    for block, fsdp2 in r["fsdp2"].items():  # the reference behaviour, so the check below means something
        assert fsdp2["raised"] == "RuntimeError" and "root" in fsdp2["message"], (block, fsdp2)
    for block, ours in r["ours"].items():
        assert ours["raised"] == "RuntimeError", f"probe of {block}: ours raised {ours['raised']} " \
                                                 f"(FSDP2: RuntimeError)\n{ours.get('traceback', '')}"
        assert "root" in ours["message"], f"probe of {block}: the message does not name the root: {ours['message']}"


def test_what_fsdp2_refuses_is_refused_at_fully_shard_with_its_exception_type(report):
    """A container without a forward of its own, a 3-D mesh, a 2-D mesh without dim names, an uneven
    split on dim 1, a channels_last weight: refused at once, in one line, with FSDP2's exception type."""
    r = checked(report, "what_is_refused")
    assert all(r["fsdp2"][case] for case in r["fsdp2"]), r["fsdp2"]  # the reference behaviour
    for case, theirs in r["fsdp2"].items():
        assert r["ours"][case] == {"type": theirs["type"], "lines": 1}, (case, r)


def test_a_slice_of_a_sharded_sequential_is_a_plain_sequential(report):
    r = checked(report, "slice_of_a_sharded_sequential")
    assert r["fsdp2"] == {"class": "Sequential", "fsdp": False, "same_layers": True}, r  # the reference behaviour
    assert r["ours"] == r["fsdp2"], r


def test_jvp_through_a_sharded_model_computes_the_plain_models_numbers(report):
    """torch.func.jvp failed on the first forward (set-up read the storage of a transform's wrapper).
    The reference is the plain model, which FSDP2 matches where it runs this flow."""
    r = report["jvp_through_a_sharded_model"]
    assert "error" not in r["plain"] and r["plain"]["trains_after"], r["plain"]  # the reference behaviour
    assert r["ours"] == r["plain"], r
    reference_holds("error" not in r["fsdp2"], f"raised: {last_line(r['fsdp2'].get('error', ''))}")
    assert r["fsdp2"] == r["plain"], r


def test_fsdp2_methods_fsdp_impl_lacks_are_refused_in_one_line(report):
    """Each FSDPModule method FSDP2 has and fsdp_impl does not support (custom collectives, memory
    and group knobs) raises NotImplementedError in one line, never a silent no-op."""
    r = checked(report, "refused_api")
    assert r["ours"] == {name: {"type": "NotImplementedError", "lines": 1} for name in r["fsdp2"]}, r["ours"]
    reference_holds(all(r["fsdp2"].values()), f"lacks {[name for name, has in r['fsdp2'].items() if not has]}")


def test_fully_shard_arguments_fsdp_impl_lacks_are_refused_in_one_line(report):
    """dp_mesh_dims: refused at fully_shard time with NotImplementedError, in one line. (shard_placement_fn
    on dim 1 of a tensor parallel parameter trains as FSDP2's: tests/test_tensor_parallel.py.)"""
    import torch.distributed.fsdp
    reference_holds(hasattr(torch.distributed.fsdp, "DataParallelMeshDims"), "has no dp_mesh_dims")
    r = checked(report, "refused_arguments")
    assert r["ours"] == {case: {"type": "NotImplementedError", "lines": 1} for case in r["ours"]}, r["ours"]
    assert set(r["ours"]) == {"dp_mesh_dims"}


def test_sharded_parameters_on_dim_1_are_laid_out_as_fsdp2s(report):
    """With the matrices on dim 1, each sharded parameter and grad has FSDP2's placements and local
    shape, and a contiguous local stride."""
    r = checked(report, "sharded_layouts_on_dim_1")
    assert r["fsdp2"]["blocks.0.a.weight"][1] == ["(Shard(dim=1),)", [8, 4], [4, 1]], r["fsdp2"]  # the reference
    assert r["ours"] == r["fsdp2"], r


def test_cast_forward_inputs_decides_the_dtype_the_root_receives(report):
    r = checked(report, "root_input_dtype_seen")
    assert r["fsdp2"] == {"cast_forward_inputs=True": "torch.bfloat16", "cast_forward_inputs=False": "torch.float32"}, r
    assert r["ours"] == r["fsdp2"], r
