"""
Run under torchrun at 4 ranks (gloo, CPU): tensor parallel then fully_shard, fsdp_impl against
PyTorch's FSDP2, on a (dp=2, tp=2) mesh and, for HSDP, a (replicate=2, shard=1, tp=2) one.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 tests/tp_worker.py OUT.json

The model, its sharding and the training are tests/mesh_training.py's. The up projection's 6 rows
make 3 per tp rank, which the dp ranks share unevenly (2 and 1): padding and DTensor's
_StridedShard are both exercised. The dim-1 cases shard the matrices on dim 1 by
shard_placement_fn, with a hidden size of 8 (an even split). Both implementations train on the same
data per dp rank, as tp ranks need. The reshard_to_2 cases train the same model without tp, all 4
ranks data parallel, with reshard_after_forward=2, noting the group size of every all-gather. Rank 0
writes OUT.json; tests/test_tensor_parallel.py asserts on it.
"""
from torch.distributed.device_mesh import init_device_mesh

from mesh_training import H, build, compare, data, meshes, write_report


def uneven_dim_1_of_a_tp_local_tensor():
    """What fully_shard raises for dim 1 of down's tp-local [8, 3] over dp=2 (hidden size 6): uneven,
    though the global [8, 6] would split evenly."""
    res = {}
    for impl in ("ours", "fsdp2"):
        try:
            build(impl, *meshes(False)[:2], dim_1=True, hidden=H)
            res[impl] = None
        except Exception as e:
            res[impl] = {"type": type(e).__name__, "lines": len(str(e).splitlines())}
    return res


def reshard_to_2_refusals():
    """What reshard_after_forward=2 raises (by the end of a first step) beside a tensor parallel
    parameter (tp over one rank), and what 3 raises at 4 ranks; and fsdp_impl's beside matrices sharded
    on dim 1 (FSDP2 2.13 fails there rank by rank: two ranks in the reshard after forward, while the
    others go on into an all-gather that never completes)."""
    def attempt(impl, dp_mesh, tp_mesh, **kw):
        try:
            build(impl, dp_mesh, tp_mesh, **kw)(data(0, 0)).backward()
            return None
        except Exception as e:
            return {"type": type(e).__name__, "lines": len(str(e).splitlines())}
    dp_tp = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    dp = init_device_mesh("cpu", (4,))
    res = {impl: {"tensor_parallel": attempt(impl, dp_tp["dp"], dp_tp["tp"], reshard_to=2),
                  "not_a_factor": attempt(impl, dp, None, reshard_to=3)} for impl in ("ours", "fsdp2")}
    res["ours"]["dim_1"] = attempt("ours", dp, None, dim_1=True, reshard_to=2)
    return res


def report():
    return {"fsdp_over_tp": compare(), "fsdp_over_tp_bf16": compare(bf16=True),
            "fsdp_over_tp_accumulation": compare(micro_steps=2),
            "fsdp_over_tp_bf16_accumulation": compare(bf16=True, micro_steps=2), "hsdp_over_tp": compare(hsdp=True),
            "fsdp_over_tp_dim_1": compare(dim_1=True), "fsdp_over_tp_dim_1_bf16_accumulation":
                compare(bf16=True, micro_steps=2, dim_1=True), "hsdp_over_tp_dim_1": compare(hsdp=True, dim_1=True),
            "uneven_dim_1_of_a_tp_local_tensor": uneven_dim_1_of_a_tp_local_tensor(),
            "reshard_to_2": compare(tp=False, reshard_to=2),
            "reshard_to_2_bf16_accumulation": compare(tp=False, reshard_to=2, bf16=True, micro_steps=2),
            "reshard_to_2_frozen_bf16": compare(tp=False, reshard_to=2, frozen_bf16=True),
            "hsdp_reshard_to_2": compare(tp=False, reshard_to=2, hsdp=True),
            "reshard_to_2_refusals": reshard_to_2_refusals()}


if __name__ == "__main__":
    write_report(report)
