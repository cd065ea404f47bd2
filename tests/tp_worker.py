"""
Run under torchrun at 4 ranks (gloo, CPU): tensor parallel then fully_shard, fsdp_impl against
PyTorch's FSDP2, on a (dp=2, tp=2) mesh and, for HSDP, a (replicate=2, shard=1, tp=2) one.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 tests/tp_worker.py OUT.json

Each block's MLP is split over tp (ColwiseParallel up, RowwiseParallel down, as in Megatron); its
LayerNorm and the model's input and output layers stay plain. Then every block is fully_shard-ed
over the dp dims, then the root. The up projection's 6 rows make 3 per tp rank, which the dp ranks
share unevenly (2 and 1): padding and DTensor's _StridedShard are both exercised. The dim-1 cases
shard the matrices on dim 1 by shard_placement_fn, with a hidden size of 8 (an even split). Both
implementations train from one seed on the same data (the same per dp rank, as tp ranks need) for
a few AdamW steps. The reshard_to_2 cases train the same model without tp, all 4 ranks data
parallel, with reshard_after_forward=2, noting the group size of every all-gather. Rank 0 writes
OUT.json; tests/test_tensor_parallel.py asserts on it.
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
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_impl import MixedPrecisionPolicy as OurMixedPrecision  # noqa: E402
from fsdp_impl import fully_shard as our_fully_shard  # noqa: E402
from fsdp_impl.comm import ledger  # noqa: E402

# DTensor's advice on the _StridedShard gathers of full_tensor() would bury a traceback
warnings.filterwarnings("ignore")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

SHARD = {"fsdp2": fsdp2_fully_shard, "ours": our_fully_shard}
MP = {"fsdp2": FSDP2MixedPrecision, "ours": OurMixedPrecision}
D, H, STEPS, LR = 8, 6, 3, 1e-2


class Block(nn.Module):
    def __init__(self, hidden=H):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x):  # (a frozen bf16 `up` takes its input in its dtype and gives it back in x's, as LoRA's base)
        return x + self.down(torch.relu(self.up(self.norm(x).to(self.up.weight.dtype)).to(x.dtype)))


class Net(nn.Module):
    def __init__(self, hidden=H):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 1)
        self.blocks = nn.ModuleList([Block(hidden) for _ in range(2)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).sum()


def matrices_on_dim_1(param):
    """shard_placement_fn: every matrix on dim 1 (of a tp parameter: of its tp-local tensor)."""
    return Shard(1) if param.dim() == 2 else None


def build(impl, dp_mesh, tp_mesh, bf16=False, dim_1=False, hidden=None, reshard_to=None, frozen_bf16=False):
    """With dim_1, the matrices are sharded on dim 1 and the hidden size is 8 unless given, which
    splits evenly there: up's tp-local [4, 8] becomes Shard(1), down's [8, 4], already split on dim 1
    by tp, _StridedShard(1). Without a tp mesh nothing is tensor parallel; reshard_to is every unit's
    reshard_after_forward; frozen_bf16 makes the first block's `up` a frozen bf16 base (its unit then
    holds two dtypes)."""
    torch.manual_seed(0)
    model = Net(hidden=hidden or (8 if dim_1 else H))
    if frozen_bf16:
        model.blocks[0].up.to(torch.bfloat16).requires_grad_(False)
    for block in model.blocks if tp_mesh is not None else ():
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    kw = {"mp_policy": MP[impl](param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    if dim_1:
        kw["shard_placement_fn"] = matrices_on_dim_1
    if reshard_to:
        kw["reshard_after_forward"] = reshard_to
    for unit in [*model.blocks, model]:
        SHARD[impl](unit, mesh=dp_mesh, **kw)
    return model


def data(dp_rank, step, k=0):
    g = torch.Generator().manual_seed(1000 * dp_rank + 10 * step + k)
    return torch.randn(4, D, generator=g)


GATHERS = []  # (group size, output numel) of each all-gather since it was last cleared


def note_all_gathers():
    """Wrap torch.distributed's all-gather, which both implementations look up at each call: by its
    torch 2.13 name, or by its older one before 2.13 (which FSDP2 there calls)."""
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    gather = getattr(dist, name)

    def noted(output, input, group=None, async_op=False):
        GATHERS.append((group.size(), output.numel()))
        return gather(output, input, group=group, async_op=async_op)
    setattr(dist, name, noted)


def train(model, dp_rank, micro_steps=1):
    """STEPS AdamW steps; with micro_steps > 1, gradient sync is off in all but the last. Returns the
    last step's full grads, the final full parameters, whether every parameter moved, and the last
    micro-step's all-gathers in forward and in backward (and fsdp_impl's ledger events of them)."""
    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t
    initial = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for s in range(STEPS):
        for k in range(micro_steps):
            model.set_requires_gradient_sync(k == micro_steps - 1)
            GATHERS.clear()
            ledger.reset(record_events=True)
            loss = model(data(dp_rank, s, k))
            gathers = {"forward": list(GATHERS), "forward_events": list(ledger.events)}
            GATHERS.clear()
            ledger.reset(record_events=True)
            loss.backward()
            gathers.update(backward=list(GATHERS), backward_events=list(ledger.events))
            ledger.reset()
        grads = {n: None if p.grad is None else full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    final = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    for phase in ("forward", "backward"):  # the ledger's all-gathers issued (not their waits)
        gathers[f"{phase}_events"] = [e for e, _ in gathers[f"{phase}_events"]
                                      if e.startswith("all_gather") and e != "all_gather_wait"]
    moved = all(not torch.equal(initial[n], final[n]) for n, p in model.named_parameters() if p.requires_grad)
    return grads, final, moved, gathers


def meshes(hsdp, tp=True):
    """(the mesh fully_shard takes, the tp mesh (None without tp), this rank's data-parallel index)."""
    if not tp:  # all 4 ranks data parallel: (4,), or for HSDP (replicate=1, shard=4)
        shape, names = ((1, 4), ("replicate", "shard")) if hsdp else ((4,), ("dp",))
        return init_device_mesh("cpu", shape, mesh_dim_names=names), None, dist.get_rank()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
        return mesh["replicate", "shard"], mesh["tp"], mesh.get_local_rank("replicate")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"], mesh.get_local_rank("dp")


def specs(model):
    """Each parameter's sharded DTensor as a checkpoint sees it: mesh dims, placements, local shape."""
    return {n: [list(p.device_mesh.mesh_dim_names), [repr(x) for x in p.placements], list(p.to_local().shape)]
            for n, p in model.named_parameters()}


def compare(hsdp=False, bf16=False, micro_steps=1, dim_1=False, reshard_to=None, frozen_bf16=False):
    """Without reshard_to, tensor parallel; with it, all 4 ranks data parallel."""
    rec, res = {}, {}
    for impl in ("ours", "fsdp2"):
        try:
            dp_mesh, tp_mesh, dp_rank = meshes(hsdp, tp=reshard_to is None)
            model = build(impl, dp_mesh, tp_mesh, bf16, dim_1, reshard_to=reshard_to, frozen_bf16=frozen_bf16)
            rec[f"{impl}_specs"] = specs(model)
            res[impl] = train(model, dp_rank, micro_steps)
        except Exception:
            rec[f"{impl}_error"] = traceback.format_exc()
    if len(res) == 2:
        (g1, p1, m1, rec["ours_gathers"]), (g2, p2, m2, rec["fsdp2_gathers"]) = res["ours"], res["fsdp2"]
        rec["params_bitwise"] = {n: torch.equal(p1[n], p2[n]) for n in p2} if p1.keys() == p2.keys() else False
        rec["grads_bitwise"] = {n: g1[n] is g2[n] is None if g2[n] is None else  # (None: a frozen parameter's)
                                g1[n] is not None and torch.equal(g1[n], g2[n]) for n in g2} \
            if g1.keys() == g2.keys() else False
        rec["params_moved"] = {"ours": m1, "fsdp2": m2}
    return rec


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


def main():
    out_path = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    note_all_gathers()
    result = {"fsdp_over_tp": compare(), "fsdp_over_tp_bf16": compare(bf16=True),
              "fsdp_over_tp_accumulation": compare(micro_steps=2),
              "fsdp_over_tp_bf16_accumulation": compare(bf16=True, micro_steps=2), "hsdp_over_tp": compare(hsdp=True),
              "fsdp_over_tp_dim_1": compare(dim_1=True), "fsdp_over_tp_dim_1_bf16_accumulation":
                  compare(bf16=True, micro_steps=2, dim_1=True), "hsdp_over_tp_dim_1": compare(hsdp=True, dim_1=True),
              "uneven_dim_1_of_a_tp_local_tensor": uneven_dim_1_of_a_tp_local_tensor(),
              "reshard_to_2": compare(reshard_to=2),
              "reshard_to_2_bf16_accumulation": compare(reshard_to=2, bf16=True, micro_steps=2),
              "reshard_to_2_frozen_bf16": compare(reshard_to=2, frozen_bf16=True),
              "hsdp_reshard_to_2": compare(reshard_to=2, hsdp=True),
              "reshard_to_2_refusals": reshard_to_2_refusals()}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # FSDP2 on gloo sometimes aborts at interpreter exit otherwise


if __name__ == "__main__":
    main()
