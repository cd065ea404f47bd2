"""
The model, training and comparison that tests/tp_worker.py and tests/reshard_worker.py share: a
small MLP, tensor parallel or not, fully_shard-ed by fsdp_impl and by PyTorch's FSDP2 over a
data-parallel mesh, both trained from one seed on the same data for a few AdamW steps, and compared
bit for bit, each all-gather's group size noted.

Each block's MLP can be split over tp (ColwiseParallel up, RowwiseParallel down, as in Megatron);
its LayerNorm and the model's input and output layers stay plain. Then every block is
fully_shard-ed over the dp dims, then the root.
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


def compare(tp=True, hsdp=False, micro_steps=1, **build_kw):
    """Both implementations trained on the meshes(hsdp, tp) and compared: specs, bitwise equality of
    the final parameters and the last step's grads, whether they moved, and the all-gathers."""
    rec, res = {}, {}
    for impl in ("ours", "fsdp2"):
        try:
            dp_mesh, tp_mesh, dp_rank = meshes(hsdp, tp)
            model = build(impl, dp_mesh, tp_mesh, **build_kw)
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


def write_report(make_report):
    """A worker's main at 4 ranks under torchrun: make_report() on every rank (all-gathers noted),
    rank 0 writing its result as JSON to the path in argv[1]."""
    out_path = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    note_all_gathers()
    result = make_report()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # FSDP2 on gloo sometimes aborts at interpreter exit otherwise
