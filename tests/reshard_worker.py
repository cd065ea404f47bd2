"""
Run under torchrun at 4 ranks (gloo, CPU): reshard_after_forward=2, fsdp_impl against PyTorch's
FSDP2, all 4 ranks data parallel: after forward each rank keeps its piece of the parameters
gathered over a group of 2, which backward gathers from.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 tests/reshard_worker.py OUT.json

The model, its sharding and the training are tests/mesh_training.py's, without tensor parallelism:
every unit resharded to 2, plain, bf16 with accumulation, with a unit of two dtypes, and under HSDP
(replicate=1, shard=4), each all-gather's group size noted; then what reshard_after_forward=2 is
refused beside. Rank 0 writes OUT.json; tests/test_reshard.py asserts on it.
"""
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from halves import Whole
from mesh_training import SHARD, build, compare, data, write_report


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
    for impl in res:  # beside a parameter with the all-gather extension of one input (FSDP2: in backward)
        res[impl]["extension"] = attempt_extension(impl, dp)
    return res


def attempt_extension(impl, mesh):
    try:
        layer = nn.Linear(8, 8)
        layer.weight = nn.Parameter(Whole(layer.weight.detach().clone()))
        model = nn.Sequential(layer, nn.Tanh())
        SHARD[impl](layer, mesh=mesh, reshard_after_forward=2)
        SHARD[impl](model, mesh=mesh)
        model(data(0, 0)).sum().backward()
        return None
    except Exception as e:
        return {"type": type(e).__name__, "lines": len(str(e).splitlines())}


def report():
    return {"reshard_to_2": compare(tp=False, reshard_to=2),
            "reshard_to_2_bf16_accumulation": compare(tp=False, reshard_to=2, bf16=True, micro_steps=2),
            "reshard_to_2_frozen_bf16": compare(tp=False, reshard_to=2, frozen_bf16=True),
            "hsdp_reshard_to_2": compare(tp=False, reshard_to=2, hsdp=True),
            "reshard_to_2_refusals": reshard_to_2_refusals()}


if __name__ == "__main__":
    write_report(report)
