"""
Run at 2 or 3 ranks (gloo, CPU): FSDP2's all-gather extension, fsdp_impl against FSDP2.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=W tests/extension_worker.py OUT.json

Each case builds one model twice from one seed, shards every Linear and then the root with FSDP2 and
with fsdp_impl, trains a few AdamW steps on rank-dependent data, and compares on every rank the
local shards of the parameters and of the last step's grads, bit for bit, and the bytes each
all-gathered (observe.CommCounter on both; fsdp_impl's own ledger beside). The models:

- torchao's float8 training with float8 all-gather (its hook takes the mesh only; one float8
  input per weight, the scale as metadata): ZeRO-3, ZeRO-2, no_sync accumulation, bfloat16 compute.
- Halves (tests/halves.py): the smallest subclass with the hooks that FSDP2 trains. It gathers a float32
  weight exactly, as its high and low 16 bits (bfloat16 and int16: two inputs of two dtypes), takes
  the five-argument hook, pads unevenly sharded rows itself and checks the metadata it gets back.

Then the refusals, each against FSDP2's exception type. Rank 0 writes OUT.json; tests/test_extension.py
asserts on it.
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
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_impl import MixedPrecisionPolicy as OurMixedPrecision  # noqa: E402
from fsdp_impl import fully_shard as our_fully_shard  # noqa: E402
from fsdp_impl.comm import ledger  # noqa: E402
from observe import CommCounter  # noqa: E402
from halves import Halves, HalvesMeshOnly, HalvesUnpadded, PreOnly, Wrapped  # noqa: E402

logging.getLogger("torchao").setLevel(logging.ERROR)  # (its CUDA kernels do not load on a CPU build)
warnings.filterwarnings("ignore")
from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,  # noqa: E402
                            precompute_float8_dynamic_scale_for_fsdp)

SHARD = {"fsdp2": fsdp2_fully_shard, "ours": our_fully_shard}
MIXED = {"fsdp2": FSDP2MixedPrecision, "ours": OurMixedPrecision}
def float8_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 48), nn.ReLU(), nn.Linear(48, 48))
    return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def halves_model(kind=Halves, dims=(16, 14, 9, 4)):
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(dims, dims[1:])]
    for layer in layers:
        layer.weight = nn.Parameter(kind(layer.weight.detach().clone()))
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])


def shard(impl, model, reshard_after_forward=True, bf16=False):
    kw = {"reshard_after_forward": reshard_after_forward}
    if bf16:
        kw["mp_policy"] = MIXED[impl](param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model:
        if isinstance(m, nn.Linear):
            SHARD[impl](m, **kw)
    SHARD[impl](model, **kw)
    return model


def plain(t):
    """A local shard as a plain tensor: a subclass's data."""
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t._data if isinstance(t, Wrapped) else t._tensor if hasattr(t, "_tensor") else t


def train(impl, make, steps=3, micro=1, float8=False, **kw):
    counter.take()
    ledger.reset()
    model = shard(impl, make(), **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    width = model[0].in_features
    for step in range(steps):
        opt.zero_grad()
        for k in range(micro):
            if micro > 1:
                model.set_requires_gradient_sync(k == micro - 1)
            torch.manual_seed(1000 * step + 10 * k + dist.get_rank())
            model(torch.randn(8, width)).square().mean().backward()
        grads = [plain(p.grad).clone() for p in model.parameters()]
        opt.step()
        if float8:
            precompute_float8_dynamic_scale_for_fsdp(model)
    taken = counter.take()
    return ([plain(p).detach().clone() for p in model.parameters()], grads,
            {"all_gather": taken["all_gather_bytes"], "all_gather_count": taken["all_gather_count"],
             "reduce_scatter": taken["reduce_scatter_bytes"]}, dict(ledger.bytes))


def compare(make, **kw):
    fsdp2, ours = train("fsdp2", make, **kw), train("ours", make, **kw)
    initial = [plain(p).detach() for p in shard("fsdp2", make()).parameters()]
    same = lambda a, b: all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    local = {"params_bitwise": same(fsdp2[0], ours[0]), "grads_bitwise": same(fsdp2[1], ours[1]),
             "params_moved": not same(initial, fsdp2[0]),
             "max_diff": max((x - y).abs().max().item() if x.numel() else 0.0 for x, y in zip(fsdp2[0], ours[0]))}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, local)
    return {"params_bitwise": all(r["params_bitwise"] for r in ranks),
            "grads_bitwise": all(r["grads_bitwise"] for r in ranks),
            "params_moved": all(r["params_moved"] for r in ranks),
            "max_diff": max(r["max_diff"] for r in ranks),
            "fsdp2_bytes": fsdp2[2], "ours_bytes": ours[2], "ours_ledger": ours[3]}


def raised(fn):
    try:
        fn()
        return None
    except Exception as e:
        return {"type": type(e).__name__, "lines": len(str(e).splitlines())}


def refusals():
    """One hook without the other, at fully_shard; an unevenly sharded weight's inputs returned
    unpadded, on a rank with padding, asked of each implementation's parameter directly (the ranks
    without padding would wait in the all-gather)."""
    def one_hook(impl):
        layer = nn.Linear(4, 4)
        layer.weight = nn.Parameter(PreOnly(layer.weight.detach().clone()))
        SHARD[impl](layer)

    def unpadded(impl):
        model = shard(impl, halves_model(HalvesUnpadded, dims=(4, 5)))
        if dist.get_rank() != dist.get_world_size() - 1:  # (5 rows: the last rank is padded at 2 and 3 ranks)
            return
        layer = model[0]
        if impl == "fsdp2":
            model._get_fsdp_state()._lazy_init()
            layer._get_fsdp_state()._fsdp_param_group.fsdp_params[0].all_gather_inputs  # noqa: B018
        else:
            ps = layer._fsdp_unit.params[0]
            ps.extension.inputs(ps, ps.sharded._local_tensor, torch.device("cpu"))

    out = {impl: {"one_hook": raised(lambda: one_hook(impl)), "unpadded": raised(lambda: unpadded(impl))}
           for impl in SHARD}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, out)
    return ranks[-1]


def report():
    cases = {
        "float8_zero3": lambda: compare(float8_model, float8=True),
        "float8_zero2": lambda: compare(float8_model, float8=True, reshard_after_forward=False),
        "float8_accumulation": lambda: compare(float8_model, float8=True, micro=2),
        "float8_bf16": lambda: compare(float8_model, float8=True, bf16=True),
        "halves": lambda: compare(halves_model),
        "halves_zero2_accumulation": lambda: compare(halves_model, reshard_after_forward=False, micro=2),
        "halves_mesh_only": lambda: compare(lambda: halves_model(HalvesMeshOnly, dims=(12, 12, 6))),
        "refusals": refusals,
    }
    result = {}
    only = os.environ.get("EXTENSION_CASES")  # (a comma-separated subset, to debug one)
    for name, run in cases.items():
        if only and name not in only.split(","):
            continue
        try:
            result[name] = run()
        except Exception:
            result[name] = {"error": traceback.format_exc()}
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counter = CommCounter()
    result = report()
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # FSDP2 on gloo sometimes aborts at interpreter exit otherwise
