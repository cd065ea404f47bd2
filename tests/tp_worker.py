"""
Run under torchrun at 4 ranks (gloo, CPU): tensor parallel then fully_shard, fsdp_impl against
PyTorch's FSDP2, on a (dp=2, tp=2) mesh and, for HSDP, a (replicate=2, shard=1, tp=2) one.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 tests/tp_worker.py OUT.json

Each block's MLP is split over tp (ColwiseParallel up, RowwiseParallel down, as in Megatron); its
LayerNorm and the model's input and output layers stay plain. Then every block is fully_shard-ed
over the dp dims, then the root. The up projection's 6 rows make 3 per tp rank, which the dp ranks
share unevenly (2 and 1): padding and DTensor's _StridedShard are both exercised. Both
implementations train from one seed on the same data (the same per dp rank, as tp ranks need) for
a few AdamW steps. Rank 0 writes OUT.json; tests/test_tensor_parallel.py asserts on it.
"""
import json
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_impl import MixedPrecisionPolicy as OurMixedPrecision  # noqa: E402
from fsdp_impl import fully_shard as our_fully_shard  # noqa: E402

# DTensor's advice on the _StridedShard gathers of full_tensor() would bury a traceback
warnings.filterwarnings("ignore")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

SHARD = {"fsdp2": fsdp2_fully_shard, "ours": our_fully_shard}
MP = {"fsdp2": FSDP2MixedPrecision, "ours": OurMixedPrecision}
D, H, STEPS, LR = 8, 6, 3, 1e-2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 1)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).sum()


def build(impl, dp_mesh, tp_mesh, bf16=False):
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    mp = {"mp_policy": MP[impl](param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    for unit in [*model.blocks, model]:
        SHARD[impl](unit, mesh=dp_mesh, **mp)
    return model


def data(dp_rank, step, k=0):
    g = torch.Generator().manual_seed(1000 * dp_rank + 10 * step + k)
    return torch.randn(4, D, generator=g)


def train(model, dp_rank, micro_steps=1):
    """STEPS AdamW steps; with micro_steps > 1, gradient sync is off in all but the last. Returns the
    last step's full grads, the final full parameters, and whether every parameter moved."""
    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t
    initial = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for s in range(STEPS):
        for k in range(micro_steps):
            model.set_requires_gradient_sync(k == micro_steps - 1)
            model(data(dp_rank, s, k)).backward()
        grads = {n: None if p.grad is None else full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    final = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    return grads, final, all(not torch.equal(initial[n], final[n]) for n in final)


def meshes(hsdp):
    """(the mesh fully_shard takes, the tp mesh, this rank's data-parallel index)."""
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
        return mesh["replicate", "shard"], mesh["tp"], mesh.get_local_rank("replicate")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"], mesh.get_local_rank("dp")


def specs(model):
    """Each parameter's sharded DTensor as a checkpoint sees it: mesh dims, placements, local shape."""
    return {n: [list(p.device_mesh.mesh_dim_names), [repr(x) for x in p.placements], list(p.to_local().shape)]
            for n, p in model.named_parameters()}


def compare(hsdp=False, bf16=False, micro_steps=1):
    rec, res = {}, {}
    for impl in ("ours", "fsdp2"):
        try:
            dp_mesh, tp_mesh, dp_rank = meshes(hsdp)
            model = build(impl, dp_mesh, tp_mesh, bf16)
            rec[f"{impl}_specs"] = specs(model)
            res[impl] = train(model, dp_rank, micro_steps)
        except Exception:
            rec[f"{impl}_error"] = traceback.format_exc()
    if len(res) == 2:
        (g1, p1, m1), (g2, p2, m2) = res["ours"], res["fsdp2"]
        rec["params_bitwise"] = {n: torch.equal(p1[n], p2[n]) for n in p2} if p1.keys() == p2.keys() else False
        rec["grads_bitwise"] = {n: g1[n] is not None and torch.equal(g1[n], g2[n]) for n in g2} \
            if g1.keys() == g2.keys() else False
        rec["params_moved"] = {"ours": m1, "fsdp2": m2}
    return rec


def main():
    out_path = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = {"fsdp_over_tp": compare(), "fsdp_over_tp_bf16": compare(bf16=True),
              "fsdp_over_tp_accumulation": compare(micro_steps=2),
              "fsdp_over_tp_bf16_accumulation": compare(bf16=True, micro_steps=2), "hsdp_over_tp": compare(hsdp=True)}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # FSDP2 on gloo sometimes aborts at interpreter exit otherwise


if __name__ == "__main__":
    main()
