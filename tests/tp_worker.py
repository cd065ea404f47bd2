"""
Run under torchrun at 4 ranks (gloo, CPU): tensor parallel then fully_shard, fsdp_impl against
PyTorch's FSDP2, on a (dp=2, tp=2) mesh and, for HSDP, a (replicate=2, shard=1, tp=2) one.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 tests/tp_worker.py OUT.json

The model, its sharding and the training are tests/mesh_training.py's. The up projection's 6 rows
make 3 per tp rank, which the dp ranks share unevenly (2 and 1): padding and DTensor's
_StridedShard are both exercised. The dim-1 cases shard the matrices on dim 1 by
shard_placement_fn, with a hidden size of 8 (an even split). Both implementations train on the same
data per dp rank, as tp ranks need. Rank 0 writes OUT.json; tests/test_tensor_parallel.py asserts on it.
"""
from mesh_training import H, build, compare, meshes, write_report


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


def report():
    return {"fsdp_over_tp": compare(), "fsdp_over_tp_bf16": compare(bf16=True),
            "fsdp_over_tp_accumulation": compare(micro_steps=2),
            "fsdp_over_tp_bf16_accumulation": compare(bf16=True, micro_steps=2), "hsdp_over_tp": compare(hsdp=True),
            "fsdp_over_tp_dim_1": compare(dim_1=True), "fsdp_over_tp_dim_1_bf16_accumulation":
                compare(bf16=True, micro_steps=2, dim_1=True), "hsdp_over_tp_dim_1": compare(hsdp=True, dim_1=True),
            "uneven_dim_1_of_a_tp_local_tensor": uneven_dim_1_of_a_tp_local_tensor()}


if __name__ == "__main__":
    write_report(report)
