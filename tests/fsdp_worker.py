"""
Run under torchrun (gloo, CPU): parity of fsdp_impl against PyTorch's FSDP2, plus memory,
communication and schedule checks read from fsdp_impl's own state.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=W tests/fsdp_worker.py OUT.json

In one launch every mode is run; for each mode an FSDP2 model and an fsdp_impl model are built
from identical init, fed identical (rank-dependent) data for a few AdamW steps, and compared on
losses, grad norms and final parameters. Rank 0 writes everything to OUT.json; tests/
test_fsdp_impl.py asserts on it. A mode that raises records its traceback instead of numbers,
so one broken mode does not hide the others.
"""
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
import weakref
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from fsdp_impl import MixedPrecisionPolicy as OurMixedPrecision  # noqa: E402
from fsdp_impl import fully_shard as our_fully_shard  # noqa: E402
from fsdp_impl.comm import ledger  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
warnings.filterwarnings("ignore", category=FutureWarning)

CFG = dict(block_size=16, vocab_size=67, n_layer=2, n_head=2, n_embd=32)
BATCH, SEQ = 4, 16
STEPS = 3
MICRO = 3  # micro-steps per optimizer step in the accumulation modes
LR = 1e-2
HUGE = 1e9  # clip_grad_norm_ max_norm that never clips: it only measures the norm

IMPLS = {
    "fsdp2": (fsdp2_fully_shard, FSDP2MixedPrecision),
    "ours": (our_fully_shard, OurMixedPrecision),
}


# ---- models -------------------------------------------------------------------------------
def build_gpt(impl, mesh, meta=False, mp=None, reshard_after_forward=None, grouped=False, **cfg_overrides):
    shard, mp_cls = IMPLS[impl]
    cfg = GPTConfig(**{**CFG, **cfg_overrides})
    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp_cls(**mp)
    if reshard_after_forward is not None:
        kw["reshard_after_forward"] = reshard_after_forward
    if meta:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
        model.init_weights(0)
    if grouped:  # every block in one unit: fully_shard([h0, h1, ...])
        shard(list(model.transformer.h), **kw)
    else:
        for block in model.transformer.h:
            shard(block, **kw)
    shard(model, **kw)
    if meta:
        model.to_empty(device="cpu")
        model.init_weights(0)
    return model


class OddBlock(nn.Module):
    """Shapes that do not divide 2, 3 or 4; a tie, a frozen Linear, a 1-row parameter used twice."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 13)
        self.mix_a = nn.Linear(13, 13, bias=False)
        self.mix_b = nn.Linear(13, 13, bias=False)
        self.mix_b.weight = self.mix_a.weight  # tied inside one unit
        self.fc2 = nn.Linear(13, 5)
        self.gain = nn.Parameter(torch.empty(1, 5))  # one row: most ranks hold none of it
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.empty(2, 5))  # trainable, never used: no grad, no hook firing

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = torch.tanh(self.mix_b(self.mix_a(h)))
        h = self.fc2(h) * self.gain  # gain used twice in one forward
        h = h + self.frozen(h)
        return x + h * self.gain


class OddModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 5)
        self.blocks = nn.ModuleList([OddBlock(), OddBlock()])
        self.scale = nn.Parameter(torch.empty(3))  # 1-D, 3 rows: ranks 3.. hold nothing at W=4
        self.head = nn.Linear(5, 11)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        x = x * self.scale.sum()
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def odd_init_state():
    torch.manual_seed(1234)
    m = OddModel()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0.0, 0.3)
        for b in m.blocks:
            b.gain.fill_(1.0).add_(torch.randn(1, 5) * 0.1)
        m.scale.copy_(torch.tensor([0.5, 0.3, 0.2]))
    return {k: v.clone() for k, v in m.state_dict().items()}


def build_odd(impl, mesh):
    shard, _ = IMPLS[impl]
    m = OddModel()
    m.load_state_dict(ODD_STATE)
    for b in m.blocks:
        shard(b, mesh=mesh)
    shard(m, mesh=mesh)
    return m


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)


# ---- data ---------------------------------------------------------------------------------
def batch(mode, rank, step, micro, vocab=CFG["vocab_size"], seq=SEQ):
    g = torch.Generator().manual_seed(zlib.crc32(f"{mode}/{rank}/{step}/{micro}".encode()))
    x = torch.randint(0, vocab, (BATCH, seq), generator=g)
    y = torch.randint(0, vocab, (BATCH, seq), generator=g)
    return x, y


# ---- training -----------------------------------------------------------------------------
def fsdp_modules(model):
    return [m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]


def run_steps(model, opt, mode, steps, *, micro=1, max_norm=HUGE, micro_setup=None, eval_after_step=False,
              vocab=CFG["vocab_size"], seq=SEQ):
    """Optimizer steps of `micro` micro-steps each; returns (losses, grad norms)."""
    rank = dist.get_rank()
    params = [p for p in model.parameters() if p.requires_grad]
    losses, norms = [], []
    for step in steps:
        for k in range(micro):
            if micro_setup is not None:
                micro_setup(model, last=(k == micro - 1))
            x, y = batch(mode, rank, step, k, vocab, seq)
            _, loss = model(x, y)
            (loss / micro).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        if eval_after_step:  # as train.py's estimate_loss: a no_grad forward between steps
            model.eval()
            with torch.no_grad():
                x, y = batch(mode + "/eval", rank, step, 0, vocab, seq)
                losses.append(model(x, y)[1].item())
                losses.append(model(x)[0].float().sum().item())  # the inference path (last position only)
            model.train()
    return losses, norms


def train(model, mode, *, vocab=CFG["vocab_size"], seq=SEQ, **kw):
    """STEPS optimizer steps; returns (losses, grad norms, final params, whether all params moved)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, foreach=False)
    initial = [p.full_tensor().detach().clone() for p in params]
    losses, norms = run_steps(model, opt, mode, range(STEPS), vocab=vocab, seq=seq, **kw)
    return (losses, norms, *final_params(model, initial))


def final_params(model, initial):
    for m in fsdp_modules(model):  # an eval forward leaves the root gathered (both implementations)
        m.reshard()
    params = [p for p in model.parameters() if p.requires_grad]
    final = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    # every trainable parameter moved: the comparison is not between two untouched inits
    # ("unused" in the odd model gets no grad, so AdamW leaves it alone, in both implementations)
    moved = all(not torch.equal(a, p.full_tensor()) for a, p, n in zip(initial, params, trained_names(model))
                if not n.endswith("unused"))
    return final, moved


def trained_names(model):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def max_abs_diff(a, b):
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def param_diff(pa, pb):
    assert pa.keys() == pb.keys(), (sorted(pa), sorted(pb))
    diff = max(((pa[k].double() - pb[k].double()).abs().max().item() for k in pa), default=0.0)
    bitwise = all(torch.equal(pa[k], pb[k]) for k in pa)
    return diff, bitwise


def all_max(value):
    """Max over ranks (losses are rank-dependent; every rank compares its own)."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_true(flag):
    t = torch.tensor([0 if flag else 1], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0


def compare(name, run):
    """run(impl) -> (losses, norms, params, extra dict). Returns the mode's record."""
    out = {}
    res = {impl: run(impl) for impl in ("fsdp2", "ours")}
    (l2, n2, p2, m2, x2), (l1, n1, p1, m1, x1) = res["fsdp2"], res["ours"]
    out["params_moved"] = all_true(m1 and m2)
    assert len(l1) == len(l2) and len(n1) == len(n2), (len(l1), len(l2), len(n1), len(n2))
    out["n_losses"], out["n_norms"] = len(l1), len(n1)
    out["loss_diff"] = all_max(max_abs_diff(l1, l2))
    out["loss_bitwise"] = all_true(l1 == l2)
    out["gnorm_diff"] = all_max(max_abs_diff(n1, n2))
    out["gnorm_bitwise"] = all_true(n1 == n2)
    out["param_diff"], out["param_bitwise"] = param_diff(p1, p2)
    out["param_bitwise"] = all_true(out["param_bitwise"])
    out["param_diff"] = all_max(out["param_diff"])
    out["losses_finite"] = all_true(all(math.isfinite(v) for v in l1 + n1))
    out["min_gnorm"] = min(n1)
    extra = {**x2, **x1}
    if "ours_state_dict" in extra:  # compare here: tensors do not go to JSON
        a, b = extra.pop("ours_state_dict"), extra.pop("fsdp2_state_dict")
        extra["state_dict_keys_match"] = list(a) == list(b)
        extra["state_dict_bitwise"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out["extra"] = extra
    return out


def no_extra(fn):
    def run(impl):
        return (*fn(impl), {})
    return run


# ---- parity modes -------------------------------------------------------------------------
def parity_modes(world, mesh1d, mesh2d):
    modes = {}

    def default(impl):
        model = build_gpt(impl, mesh1d)
        r = train(model, "default")
        # state_dict(): same keys, same (sharded DTensor) values as FSDP2's
        sd = model.state_dict()
        return (*r, {f"{impl}_state_dict": {k: v.full_tensor() for k, v in sd.items()},
                     f"{impl}_state_dict_dtensor": all(isinstance(v, DTensor) for v in sd.values())})
    modes["default"] = default

    @no_extra
    def grouped_blocks(impl):  # fully_shard([h0, h1]): one unit for all blocks
        return train(build_gpt(impl, mesh1d, grouped=True), "grouped_blocks")
    modes["grouped_blocks"] = grouped_blocks

    @no_extra
    def zero2(impl):
        return train(build_gpt(impl, mesh1d, reshard_after_forward=False), "zero2")
    modes["zero2"] = zero2

    def sync_off(model, last):
        model.set_requires_gradient_sync(last)

    def sync_and_reshard_off(model, last):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)

    @no_extra
    def grad_accum(impl):
        return train(build_gpt(impl, mesh1d), "grad_accum", micro=MICRO, micro_setup=sync_off)
    modes["grad_accum"] = grad_accum

    @no_extra
    def grad_accum_sync_each(impl):  # sync on at every micro-step: sharded .grads accumulate
        return train(build_gpt(impl, mesh1d), "grad_accum_sync_each", micro=MICRO)
    modes["grad_accum_sync_each"] = grad_accum_sync_each

    @no_extra
    def no_reshard_after_backward(impl):
        return train(build_gpt(impl, mesh1d), "no_reshard_after_backward", micro=MICRO,
                     micro_setup=sync_and_reshard_off)
    modes["no_reshard_after_backward"] = no_reshard_after_backward

    @no_extra
    def no_reshard_after_backward_sync_on(impl):  # keep params gathered, still reduce each time
        def setup(model, last):
            model.set_reshard_after_backward(last)
        return train(build_gpt(impl, mesh1d), "no_reshard_after_backward_sync_on", micro=MICRO,
                     micro_setup=setup)
    modes["no_reshard_after_backward_sync_on"] = no_reshard_after_backward_sync_on

    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    @no_extra
    def bf16_mp(impl):
        return train(build_gpt(impl, mesh1d, mp=bf16), "bf16_mp")
    modes["bf16_mp"] = bf16_mp

    @no_extra
    def bf16_grad_accum(impl):  # the fp32 running sum of bf16 grads while sync is off
        return train(build_gpt(impl, mesh1d, mp=bf16), "bf16_grad_accum", micro=MICRO, micro_setup=sync_off)
    modes["bf16_grad_accum"] = bf16_grad_accum

    @no_extra
    def bf16_reduce_bf16(impl):  # reduce_dtype left out: the grads reduce in bf16 (param_dtype), into float32 .grads
        return train(build_gpt(impl, mesh1d, mp=dict(param_dtype=torch.bfloat16)), "bf16_reduce_bf16")
    modes["bf16_reduce_bf16"] = bf16_reduce_bf16

    if mesh2d is not None:
        @no_extra
        def hsdp_replicate_only_bf16(impl):
            """train.py's bf16 with replicate_degree = the world size: shard groups of one rank, whose
            reduce-scatter is a copy and cast to float32 (the grads are bf16), then the float32
            all-reduce alone averages. (No accumulation: its float32 sums would hide a missed cast.)"""
            mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
            return train(build_gpt(impl, mesh, mp=bf16), "hsdp_replicate_only_bf16")
        modes["hsdp_replicate_only_bf16"] = hsdp_replicate_only_bf16

        @no_extra
        def hsdp(impl):
            return train(build_gpt(impl, mesh2d), "hsdp")
        modes["hsdp"] = hsdp

        @no_extra
        def hsdp_all_reduce_off(impl):  # set_requires_all_reduce(False) on non-final micro-steps
            def setup(model, last):
                model.set_requires_all_reduce(last)
            return train(build_gpt(impl, mesh2d), "hsdp_all_reduce_off", micro=MICRO, micro_setup=setup)
        modes["hsdp_all_reduce_off"] = hsdp_all_reduce_off

    def meta_init(impl):
        # ours from the meta device; FSDP2 built normally (the reference for the numbers)
        model = build_gpt(impl, mesh1d, meta=(impl == "ours"))
        extra = {}
        # the tensors to_empty() made: the first forward copies them into flat shards, then frees them
        # (_local_tensor itself: to_local() of a parameter returns a fresh view)
        replaced = [weakref.ref(p._local_tensor) for p in model.parameters()] if impl == "ours" else []
        if impl == "ours":
            plain = GPT(GPTConfig(**CFG))
            plain.init_weights(0)
            ref = dict(plain.named_parameters())
            # copies, without a graph: an alias (W=1) or a graph through the parameters would
            # itself keep the replaced tensors alive
            with torch.no_grad():
                got = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
            extra["meta_names_match"] = sorted(ref) == sorted(got)
            extra["meta_init_diff"] = max((got[n] - ref[n]).abs().max().item() for n in got)
            extra["meta_init_bitwise"] = all(torch.equal(got[n], ref[n]) for n in got)
            extra["meta_on_cpu"] = all(p.device.type == "cpu" and p.to_local().device.type == "cpu"
                                       for p in model.parameters())
        r = train(model, "meta_init")
        if impl == "ours":
            gc.collect()
            extra["meta_replaced_alive"] = sum(ref() is not None for ref in replaced)
        return (*r, extra)
    modes["meta_init"] = meta_init

    @no_extra
    def eval_between_steps(impl):
        return train(build_gpt(impl, mesh1d), "eval_between_steps", eval_after_step=True)
    modes["eval_between_steps"] = eval_between_steps

    @no_extra
    def resume(impl):
        """Train a step, save with torch.distributed.checkpoint's state-dict API, load into a
        model with other weights and a fresh optimizer, train on (what checkpoint.py does)."""
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)
        first = build_gpt(impl, mesh1d)
        opt = torch.optim.AdamW(first.parameters(), lr=LR, foreach=False)
        initial = [p.full_tensor().detach().clone() for p in first.parameters()]
        losses, norms = run_steps(first, opt, "resume", range(1))
        msd, osd = get_model_state_dict(first), get_optimizer_state_dict(first, opt)
        msd = {k: v.full_tensor() for k, v in msd.items()}  # a full copy, as after a save and a load
        second = build_gpt(impl, mesh1d)
        second.init_weights(1)  # other weights: the load must overwrite them
        opt2 = torch.optim.AdamW(second.parameters(), lr=LR, foreach=False)
        set_model_state_dict(second, msd, options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(second, opt2, osd)
        l2, n2 = run_steps(second, opt2, "resume", range(1, STEPS))
        return (losses + l2, norms + n2, *final_params(second, initial))
    modes["resume"] = resume

    @no_extra
    def grad_clip(impl):
        return train(build_gpt(impl, mesh1d), "grad_clip", max_norm=0.5)
    modes["grad_clip"] = grad_clip

    @no_extra
    def activation_checkpointing(impl):
        return train(build_gpt(impl, mesh1d, activation_checkpointing=True), "activation_checkpointing")
    modes["activation_checkpointing"] = activation_checkpointing

    @no_extra
    def odd_model(impl):
        return train(build_odd(impl, mesh1d), "odd_model", vocab=11, seq=6)
    modes["odd_model"] = odd_model

    @no_extra
    def units_without_params(impl):
        """fully_shard on modules with no parameters of their own: each block (its four children are
        units) and a root wrapping the GPT. Nothing to gather for them (FSDP2 issues nothing)."""
        shard, _ = IMPLS[impl]
        gpt = GPT(GPTConfig(**CFG))
        gpt.init_weights(0)
        for block in gpt.transformer.h:
            for child in block.children():
                shard(child, mesh=mesh1d)
            shard(block, mesh=mesh1d)
        shard(gpt, mesh=mesh1d)
        return train(shard(Wrapper(gpt), mesh=mesh1d), "units_without_params")
    modes["units_without_params"] = units_without_params

    def odd_model_frozen_untouched(impl):
        m = build_odd(impl, mesh1d)
        before = {n: p.full_tensor().clone() for n, p in m.named_parameters() if not p.requires_grad}
        r = train(m, "odd_model_frozen", vocab=11, seq=6)
        after = {n: p.full_tensor() for n, p in m.named_parameters() if not p.requires_grad}
        grads_none = all(p.grad is None for p in m.parameters() if not p.requires_grad)
        return (*r, {f"{impl}_frozen_unchanged": all(torch.equal(before[n], after[n]) for n in before),
                     f"{impl}_frozen_grad_none": grads_none, f"{impl}_n_frozen": len(before)})
    modes["odd_model_frozen"] = odd_model_frozen_untouched
    return modes


# ---- memory -------------------------------------------------------------------------------
def units_of(model):
    return [m._fsdp_unit for m in model.modules() if hasattr(m, "_fsdp_unit")]


def expected_unit_numels(world):
    """Per unit (named by its path, "root" for the root): (padded shard numel, sum of row numels,
    full numel), from a plain GPT's shapes: each parameter is padded to ceil(dim0 / W) rows per rank."""
    plain = GPT(GPTConfig(**CFG))
    block_ids = set()
    out = {}
    for i, b in enumerate(plain.transformer.h):
        ps = list(b.parameters())
        block_ids |= {id(p) for p in ps}
        out[f"transformer.h.{i}"] = ps
    out["root"] = [p for p in plain.parameters() if id(p) not in block_ids]  # parameters() dedups ties

    def padded(p):
        return math.ceil(p.shape[0] / world) * math.prod(p.shape[1:])

    return {k: (sum(padded(p) for p in ps), sum(math.prod(p.shape[1:]) for p in ps), sum(p.numel() for p in ps))
            for k, ps in out.items()}


def memory_checks(world, mesh1d):
    rank = dist.get_rank()
    res = {}
    model = build_gpt("ours", mesh1d)
    during, after = {}, {}

    def probe(store):
        def hook(module, *args):
            u = module._fsdp_unit
            store[u.name] = u.flat_full.untyped_storage().nbytes()
        return hook

    for m in [model, *model.transformer.h]:
        # registered after fully_shard's hooks: the pre-hook sees the gathered unit, the post-hook the resharded one
        m.register_forward_pre_hook(probe(during))
        m.register_forward_hook(probe(after))

    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, foreach=False)
    res["after_backward_unsharded_grad_none"] = []
    res["after_backward_accumulated_grad_none"] = []
    res["after_backward_all_sharded"] = []
    res["after_backward_flat_full_freed"] = []
    res["after_backward_nothing_in_flight"] = []
    res["after_backward_module_holds_dtensors"] = []
    for step in range(2):
        x, y = batch("memory", rank, step, 0)
        _, loss = model(x, y)
        units = {u.name: u for u in units_of(model)}  # named at lazy init (first forward)
        loss.backward()
        us = units.values()
        res["after_backward_unsharded_grad_none"].append(all(ps.unsharded.param.grad is None for u in us for ps in u.params))
        res["after_backward_accumulated_grad_none"].append(
            all(ps.unsharded.accumulated_grad is None for u in us for ps in u.params))
        res["after_backward_all_sharded"].append(all(u.state == "sharded" for u in us))
        res["after_backward_flat_full_freed"].append(all(u.flat_full.untyped_storage().nbytes() == 0 for u in us))
        res["after_backward_nothing_in_flight"].append(
            all(u._gather is None and u.grads.in_flight is None for u in us) and not model._fsdp_unit.schedule.pending.reductions)
        res["after_backward_module_holds_dtensors"].append(all(isinstance(p, DTensor) for p in model.parameters()))
        opt.step()
        if step == 0:
            grad_bytes = sum(p.grad.to_local().numel() * p.grad.to_local().element_size() for p in params)
            grads_dtensor = all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in params)
        opt.zero_grad()
    res["flat_full_bytes_during_forward"] = during
    res["flat_full_bytes_after_forward"] = after
    res["full_bytes_expected"] = {n: u.world * u.layout.shard_numel * 4 for n, u in units.items()}
    exp = expected_unit_numels(world)
    res["expected_units"] = exp
    res["shard_numel"] = {n: u.layout.shard_numel for n, u in units.items()}
    res["flat_shard_numel"] = {n: u.flat_shard.numel() for n, u in units.items()}
    param_bytes = sum(u.flat_shard.numel() * u.flat_shard.element_size() for u in units.values())
    state_bytes = sum(t.to_local().numel() * t.to_local().element_size()
                      for st in opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    full_bytes = sum(p.numel() * 4 for p in GPT(GPTConfig(**CFG)).parameters())
    totals = torch.tensor([param_bytes, grad_bytes, state_bytes], dtype=torch.int64)
    dist.all_reduce(totals)
    res.update(param_bytes=param_bytes, grad_bytes=grad_bytes, state_bytes=state_bytes, full_bytes=full_bytes,
               sum_param_bytes=totals[0].item(), sum_grad_bytes=totals[1].item(), sum_state_bytes=totals[2].item(),
               grads_dtensor=grads_dtensor, n_units=len(units))
    # the unshard()/reshard() API
    h0 = model.transformer.h[0]
    h0.unshard()
    u0 = h0._fsdp_unit
    res["api_unshard_allocates"] = u0.flat_full.untyped_storage().nbytes() == u0.world * u0.layout.shard_numel * 4
    res["api_unshard_plain_params"] = all(not isinstance(p, DTensor) for p in h0.parameters())
    full_w = h0.attn.c_attn.weight.detach().clone()
    h0.reshard()
    res["api_unshard_values"] = torch.equal(full_w, h0.attn.c_attn.weight.full_tensor())
    res["api_reshard_frees"] = h0._fsdp_unit.flat_full.untyped_storage().nbytes() == 0
    res["api_reshard_dtensor_params"] = all(isinstance(p, DTensor) for p in h0.parameters())
    handle = h0.unshard(async_op=True)
    handle.wait()
    res["api_async_unshard"] = h0._fsdp_unit.state == "unsharded"
    h0.reshard()
    res["collective_traces"] = collective_traces(rank, mesh1d)
    return res


def profiled_events(fn):
    """The profiler's trace events (with CPU allocations and frees, '[memory]') while fn runs."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    path = os.path.join(tempfile.gettempdir(), f"fsdp_worker_trace_{os.getpid()}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    return events


def collective_traces(rank, mesh1d):
    """From the profiler, over a training step after the first (past its one-time allocations),
    per unit: the memory its reduce-scatter holds, beyond what it held when it began, once it has
    allocated its output (the sharded grads); and which of the operators that copy a whole unit
    its reduce-scatter and its all-gathers' waits ran, on the training thread."""
    model = build_gpt("ours", mesh1d)
    for step in range(2):
        x, y = batch("memory", rank, step, 0)

        def train_step():
            model(x, y)[1].backward()
        events = profiled_events(train_step) if step else train_step()
        model.zero_grad(set_to_none=True)

    def inside(range_name, event_name=None):
        ranges = [e for e in events if e.get("name") == range_name]
        return sorted((e for e in events if (event_name is None or e.get("name") == event_name) and any(
            e is not r and e.get("tid") == r["tid"] and r["ts"] <= e["ts"] <= r["ts"] + r["dur"] for r in ranges)),
            key=lambda e: e["ts"])

    copies = ("aten::_chunk_cat", "aten::_foreach_copy_", "aten::split_with_sizes_copy")
    report = {}
    for unit in units_of(model):
        shard_bytes, net, held = unit.layout.shard_numel * 4, 0, None
        for e in inside(f"fsdp::reduce_scatter {unit.name}", "[memory]"):
            net += e["args"]["Bytes"]
            if e["args"]["Bytes"] == shard_bytes:  # the output (its last allocation of that size)
                held = net
        full_bytes = sum(math.prod(ps.shape) for ps in unit.params) * 4
        report[unit.name] = {"held_at_output_bytes": held, "shard_bytes": shard_bytes, "full_bytes": full_bytes, "copies": {
            phase: sorted({e["name"] for e in inside(f"fsdp::{phase} {unit.name}") if e["name"] in copies})
            for phase in ("reduce_scatter", "all_gather_wait")}}
    return report


# ---- flat layout vs FSDP2 -----------------------------------------------------------------
def layout_checks(mesh1d):
    """Per unit, the order of the parameters in the flat shard and its padded size, for both.

    The bits of a reduce-scatter depend on where an element sits in the buffer (gloo sums the
    ranks' contributions in an order that depends on the offset), so matching FSDP2 bit for bit
    needs FSDP2's order, not only its padding.
    """
    out = {}
    for model_name, build in (("gpt", lambda impl: build_gpt(impl, mesh1d)), ("odd", lambda impl: build_odd(impl, mesh1d))):
        rec = {}
        for impl in ("fsdp2", "ours"):
            model = build(impl)
            names = {id(p): n for n, p in model.named_parameters()}
            units = {}
            for path, m in model.named_modules():
                if impl == "fsdp2":
                    state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
                    group = state._fsdp_param_group if state is not None else None
                    if group is None:
                        continue
                    units[path or "root"] = ([names[id(fp.sharded_param)] for fp in group.fsdp_params],
                                             sum(fp.padded_sharded_param_size.numel() for fp in group.fsdp_params))
                elif hasattr(m, "_fsdp_unit"):
                    u = m._fsdp_unit
                    units[path or "root"] = ([names[id(ps.sharded)] for ps in u.params], u.layout.shard_numel)
            rec[impl] = units
        out[model_name] = rec
    return out


# ---- communication and schedule -----------------------------------------------------------
def step_with_ledger(model, opt, tag, step, micro=1, setup=None):
    """One optimizer step; the ledger's counts after each forward and backward, and the events."""
    rank = dist.get_rank()
    ledger.reset(record_events=True)
    phases = []
    for k in range(micro):
        if setup is not None:
            setup(model, last=(k == micro - 1))
        x, y = batch(tag, rank, step, k)
        base_c, base_b = dict(ledger.counts), dict(ledger.bytes)
        _, loss = model(x, y)
        fwd_c, fwd_b = dict(ledger.counts), dict(ledger.bytes)
        (loss / micro).backward()
        end_c, end_b = dict(ledger.counts), dict(ledger.bytes)
        phases.append({
            "forward": {k2: fwd_c[k2] - base_c[k2] for k2 in fwd_c},
            "forward_bytes": {k2: fwd_b[k2] - base_b[k2] for k2 in fwd_b},
            "backward": {k2: end_c[k2] - fwd_c[k2] for k2 in end_c},
            "backward_bytes": {k2: end_b[k2] - fwd_b[k2] for k2 in end_b},
            "states_after": {u.name: u.state for u in units_of(model)},
        })
    opt.step()
    opt.zero_grad()
    events = [list(e) for e in ledger.events]
    ledger.reset()
    return phases, events


def comm_checks(world, mesh1d, mesh2d):
    out = {}

    def run(tag, build, steps=2, micro=1, setup=None, before=None):
        model = build()
        if before is not None:
            before(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        rec = []
        for step in range(steps):
            phases, events = step_with_ledger(model, opt, tag, step, micro, setup)
            rec.append({"phases": phases, "events": events})
        out[tag] = {"steps": rec, "shard_numel": {u.name: u.layout.shard_numel for u in units_of(model)},
                    "shard_world": units_of(model)[0].world}

    run("zero3", lambda: build_gpt("ours", mesh1d))
    run("zero2", lambda: build_gpt("ours", mesh1d, reshard_after_forward=False))
    run("bf16", lambda: build_gpt("ours", mesh1d, mp=dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)))

    def sync_off(model, last):
        model.set_requires_gradient_sync(last)

    def sync_and_reshard_off(model, last):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)

    run("grad_accum", lambda: build_gpt("ours", mesh1d), micro=MICRO, setup=sync_off)
    run("no_reshard_after_backward", lambda: build_gpt("ours", mesh1d), micro=MICRO, setup=sync_and_reshard_off)

    def empty_lists(model):  # (FSDP2's meaning: none in forward, the default in backward)
        for m in fsdp_modules(model):
            m.set_modules_to_forward_prefetch([])
            m.set_modules_to_backward_prefetch([])
    run("empty_lists", lambda: build_gpt("ours", mesh1d), before=empty_lists)

    def no_prefetch(model):
        empty_lists(model)
        model.set_backward_prefetch(False)
    run("no_prefetch", lambda: build_gpt("ours", mesh1d), before=no_prefetch)

    def next_unit(model):  # train.py's lists: in forward the next unit, in backward the one after
        units = [model, *model.transformer.h]
        for m, nxt in zip(units, units[1:] + [None]):
            m.set_modules_to_forward_prefetch([nxt] if nxt else [])
        backward = [model, *list(model.transformer.h)[::-1]]
        for m, nxt in zip(backward, backward[1:] + [None]):
            m.set_modules_to_backward_prefetch([nxt] if nxt else [])
    run("next_unit", lambda: build_gpt("ours", mesh1d), before=next_unit)

    def root_prefetches_all(model):  # explicit lists override the recorded order
        model.set_modules_to_forward_prefetch(list(model.transformer.h))
        for b in model.transformer.h:
            b.set_modules_to_forward_prefetch([])
    run("explicit_prefetch", lambda: build_gpt("ours", mesh1d), before=root_prefetches_all)

    if mesh2d is not None:
        run("hsdp", lambda: build_gpt("ours", mesh2d))

        def all_reduce_off(model, last):
            model.set_requires_all_reduce(last)
        run("hsdp_all_reduce_off", lambda: build_gpt("ours", mesh2d), micro=MICRO, setup=all_reduce_off)
    return out


# ---- main ---------------------------------------------------------------------------------
ODD_STATE = None


def main():
    global ODD_STATE
    out_path = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ODD_STATE = odd_init_state()
    mesh1d = init_device_mesh("cpu", (world,))
    mesh2d = (init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if world == 4 else None)
    result = {"world": world, "parity": {}, "timings": {}}
    t_all = time.perf_counter()
    for name, fn in parity_modes(world, mesh1d, mesh2d).items():
        t0 = time.perf_counter()
        try:
            result["parity"][name] = compare(name, fn)
        except Exception:
            result["parity"][name] = {"error": traceback.format_exc()}
        result["timings"][name] = time.perf_counter() - t0
    for key, fn in (("layout", lambda: layout_checks(mesh1d)),
                    ("memory", lambda: memory_checks(world, mesh1d)),
                    ("comm", lambda: comm_checks(world, mesh1d, mesh2d))):
        t0 = time.perf_counter()
        try:
            result[key] = fn()
        except Exception:
            result[key] = {"error": traceback.format_exc()}
        result["timings"][key] = time.perf_counter() - t0
    result["timings"]["total"] = time.perf_counter() - t_all
    if rank == 0:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, out_path)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # FSDP2 on gloo at 4 processes sometimes aborts at interpreter exit otherwise


if __name__ == "__main__":
    main()
