"""
Run under torchrun at 2 ranks (gloo, CPU): fsdp_impl against PyTorch's FSDP2 in unusual training
flows (several backward passes over one forward, reentrant checkpointing, requires_grad changes,
load_state_dict(assign=True), layer drop in a grouped unit, ...).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/flows_worker.py OUT.json

For each flow an fsdp_impl model and a reference are built from the same seed (every block
sharded, then the root), fed identical rank-dependent data for a few AdamW steps, and compared on
the final full parameters and the last step's full gradients. The reference is FSDP2, or, in the
flows where FSDP2 itself goes wrong (@flow(fsdp2_differs=...) says how), the plain model with its
grads averaged over the ranks. Rank 0 writes OUT.json; a flow that raises records the traceback,
so one broken flow does not hide the others. tests/test_flows.py asserts on the report: a test per
flow, and one per check (the functions main() runs after the flows).
"""
import copy
import faulthandler
import gc
import json
import contextlib
import math
import os
import signal
import sys
import traceback
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as FSDP2CPUOffload
from torch.distributed.fsdp import FSDPModule as FSDP2Module
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method as fsdp2_register
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_impl import CPUOffloadPolicy as OurCPUOffload  # noqa: E402
from fsdp_impl import FSDPModule as OurModule  # noqa: E402
from fsdp_impl import MixedPrecisionPolicy as OurMixedPrecision  # noqa: E402
from fsdp_impl import fully_shard as our_fully_shard  # noqa: E402
from fsdp_impl import register_fsdp_forward_method as our_register  # noqa: E402
from fsdp_impl.comm import ledger  # noqa: E402

warnings.filterwarnings("ignore")  # FSDP2's and checkpoint's advisory warnings would bury a traceback

def leave_unsharded(module, mesh):
    """The plain reference: nothing sharded; train() averages its grads over the ranks."""


SHARD = {"fsdp2": fsdp2_fully_shard, "ours": our_fully_shard, "plain": leave_unsharded}
BF16 = {"fsdp2": FSDP2MixedPrecision, "ours": OurMixedPrecision}  # param_dtype bf16, reduce_dtype float32
OFFLOAD = {"fsdp2": FSDP2CPUOffload, "ours": OurCPUOffload}
REGISTER = {"fsdp2": fsdp2_register, "ours": our_register}
D, STEPS, LR = 8, 3, 1e-2


# ---- model ------------------------------------------------------------------------------------
@dataclass
class Out:  # not a pytree node: an implementation has to look inside it for the tensors
    h: torch.Tensor


def reentrant(layer, x):
    return checkpoint(layer, x, use_reentrant=True)


# a block that applies its layer `a` twice, under reentrant checkpointing once or twice: then a's
# gradients arrive in two backward passes (the recomputation's nested one, and the outer one or
# another nested one), in either order
REUSES = {"outside_then_checkpointed": (lambda a, x: a(x), reentrant),
          "checkpointed_then_outside": (reentrant, lambda a, x: a(x)),
          "checkpointed_twice": (reentrant, reentrant)}


class Block(nn.Module):
    def __init__(self, dataclass_output=False, reuse=None):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.dataclass_output, self.reuse = dataclass_output, reuse

    def project(self, x):
        """The block's layers without its residual: a method other than forward that reads its weights."""
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x):
        x = x.h if isinstance(x, Out) else x
        if self.reuse:
            first, second = REUSES[self.reuse]
            h = x + self.b(torch.tanh(second(self.a, torch.tanh(first(self.a, x)))))
        else:  # (a frozen bf16 `a` takes its input in its dtype and gives it back in x's, as LoRA's base)
            h = x + self.b(torch.tanh(self.a(x.to(self.a.weight.dtype)).to(x.dtype)))
        return Out(h) if self.dataclass_output else h


class Net(nn.Module):
    """inp -> 3 residual blocks -> out; the loss is the sum of the outputs. `skip` holds the
    indices of blocks the forward leaves out (layer drop); `mute` those whose output it multiplies
    by 0 (the forward and grads of a skip, but the block runs and gets zero grads)."""

    def __init__(self, dataclass_output=False, dataclass_input=False, reentrant=False, reuse=None):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(dataclass_output, reuse) for _ in range(3)])
        self.out = nn.Linear(D, 1)
        self.dataclass_input, self.reentrant, self.skip, self.mute = dataclass_input, reentrant, (), ()
        self.twice = ()  # indices of blocks applied twice in a row (a unit called twice per forward)
        self.head_outside = False  # forward returns the hidden state: the loss calls `out` itself

    def forward(self, x):
        x = self.inp(x)  # x requires grad from here on, as reentrant checkpointing needs
        for i, block in enumerate(self.blocks):
            if i in self.skip:
                continue
            x = Out(x.float()) if self.dataclass_input else x  # (fp32: a bf16 unit must cast inside it)
            y = checkpoint(block, x, use_reentrant=True) if self.reentrant else block(x)
            y = y.h if isinstance(y, Out) else y
            if i in self.twice:
                y = block(y)
            x = x + 0 * (y - x) if i in self.mute else y
        if self.head_outside:
            return x
        return self.out(x.to(self.out.weight.dtype)).sum()  # (a no-op but under a block's output_dtype)

    def reset_iter_state(self):
        """The plain model keeps no state within a step (FSDP's class overrides this)."""

    def set_requires_all_reduce(self, requires_all_reduce):
        """The plain model's grads are averaged once, after the step's backward passes."""

    def set_requires_gradient_sync(self, requires_gradient_sync):
        """(As set_requires_all_reduce.)"""


def build(impl, mesh, seed=0, meta=False, grouped=False, frozen=(), bf16=False, output_dtype=None,
          before_sharding=None, own_units=(), offload=None, root_kw=None, unit_kw=None, **net_kw):
    """Every block its own unit (grouped: blocks.0 alone, blocks.1 and .2 as one unit; "reversed":
    that unit listed as [blocks.2, blocks.1]), then the modules named in own_units, then the root.
    reshard_after_forward is left at its default: True for the blocks in both. root_kw(impl, model):
    more fully_shard arguments for the root; unit_kw: for every unit."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = Net(**net_kw)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    if before_sharding is not None:
        before_sharding(model)
    pair = [model.blocks[2], model.blocks[1]] if grouped == "reversed" else [model.blocks[1], model.blocks[2]]
    units = [model.blocks[0], pair] if grouped else list(model.blocks)
    if grouped == "with_out":  # the last block and the output layer as one unit
        units = [model.blocks[0], model.blocks[1], [model.blocks[2], model.out]]
    for unit in units + [model.get_submodule(name) for name in own_units] + [model]:
        mp = BF16[impl](param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=output_dtype) \
            if bf16 and impl != "plain" else None
        kwargs = {"mp_policy": mp} if mp else {}
        if offload and impl != "plain":
            kwargs["offload_policy"] = OFFLOAD[impl](pin_memory=False)
        if unit_kw and impl != "plain":
            kwargs.update(unit_kw)
        if root_kw and unit is model and impl != "plain":
            kwargs.update(root_kw(impl, model))
        SHARD[impl](unit, mesh=mesh, **kwargs)
    return model


# ---- training ---------------------------------------------------------------------------------
def data(step, k=0):
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + k)
    return torch.randn(4, D, generator=g)


def full(t):
    """t's whole tensor, gathered with the c10d all-gather FSDP itself calls, not through
    DTensor.full_tensor()'s functional collectives: the flows call this tens of thousands of times
    and test FSDP, not that path, whose wait on gloo can abort ("double free or corruption" inside
    wait_tensor). A buggy run may leave a plain tensor."""
    if not isinstance(t, DTensor):
        return t
    whole = t.to_local()
    for mesh_dim in reversed(range(t.device_mesh.ndim)):  # (the innermost split first)
        placement = t.placements[mesh_dim]
        if placement.is_partial():
            raise ValueError(f"full(): a {placement} DTensor holds no whole tensor")
        if placement.is_shard():
            whole = gather_dim(whole, placement.dim, t.device_mesh.get_group(mesh_dim))
    return whole


def gather_dim(local, dim, group):
    """The ranks' pieces of a tensor split on `dim`, in rank order; pieces may differ in length."""
    if group.size() == 1:
        return local
    lengths = torch.empty(group.size(), dtype=torch.int64)
    dist.all_gather_into_tensor(lengths, torch.tensor([local.shape[dim]]), group=group)
    longest, rows = int(lengths.max()), local.movedim(dim, 0)
    padded = torch.cat([rows, rows.new_zeros(longest - rows.shape[0], *rows.shape[1:])]).contiguous()
    out = padded.new_empty(group.size() * longest, *rows.shape[1:])
    dist.all_gather_into_tensor(out, padded, group=group)
    pieces = [out[i * longest:i * longest + n] for i, n in enumerate(lengths.tolist())]
    return torch.cat(pieces).movedim(0, dim)


def full_params(model):
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def plain_step(model, s):
    model(data(s)).backward()


def optimizer_step(opt):
    opt.step()
    opt.zero_grad()


def average_grads_over_ranks(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def train(model, fwd_bwd=plain_step):
    """STEPS AdamW steps over all parameters (those without a grad are skipped), fwd_bwd(model, s)
    making step s's grads. Returns (the last step's grads, final params, whether every parameter
    trainable at the end moved: the comparison is not between two untouched inits)."""
    initial = full_params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for s in range(STEPS):
        fwd_bwd(model, s)
        if not isinstance(model.inp.weight, DTensor):  # the plain reference
            average_grads_over_ranks(model)
        grads = {n: None if p.grad is None else full(p.grad).clone() for n, p in model.named_parameters()}
        optimizer_step(opt)
    final = full_params(model)
    moved = all(not torch.equal(initial[n], final[n]) for n, p in model.named_parameters() if p.requires_grad)
    return grads, final, moved


# ---- flows ------------------------------------------------------------------------------------
FLOWS = []  # in the order they run; tests/test_flows.py tests each by its name


def flow(run=None, *, fsdp2_differs=None, tolerance=0.0):
    """Registers run(impl, mesh), which returns train()'s result, as a flow: main() trains it under
    ours and under the reference and compares the two. The reference is FSDP2, or the plain model
    where fsdp2_differs says how FSDP2 computes something else than plain PyTorch. tolerance: how far
    ours may be from the reference where the two sum in other orders by design (0: bitwise)."""
    def register(run):
        run.reference, run.tolerance = "plain" if fsdp2_differs else "fsdp2", tolerance
        FLOWS.append(run)
        return run
    return register(run) if run else register


@flow
def retain_graph(impl, mesh):
    def fwd_bwd(model, s):
        loss = model(data(s))
        if s == 0:
            loss.backward(retain_graph=True)  # two backward passes over one forward: grads add up
        loss.backward()
    return train(build(impl, mesh), fwd_bwd)


@flow
def autograd_grad_then_backward(impl, mesh):
    def fwd_bwd(model, s):  # as an input-gradient penalty or a saliency map does
        x = data(s).requires_grad_()
        loss = model(x)
        torch.autograd.grad(loss, x, retain_graph=True)
        loss.backward()
    return train(build(impl, mesh), fwd_bwd)


@flow
def partial_no_grad_forward_before_step(impl, mesh, explicit_prefetch=False):
    def fwd_bwd(model, s):
        model(data(s)).backward()
        with torch.no_grad():  # a probe of blocks.0 only: its forward may prefetch blocks.1
            model.blocks[0](data(s, k=1))
    model = build(impl, mesh)
    if explicit_prefetch and impl != "plain":  # as train.py's backends set them
        for block, after in zip(model.blocks, model.blocks[1:]):
            block.set_modules_to_forward_prefetch([after])
    return train(model, fwd_bwd)


@flow(fsdp2_differs="hands the next forward the all-gather the probe issued, from before the optimizer step")
def partial_no_grad_forward_before_step_explicit_prefetch(impl, mesh):
    return partial_no_grad_forward_before_step(impl, mesh, explicit_prefetch=True)


@flow
def reentrant_checkpoint(impl, mesh):
    return train(build(impl, mesh, reentrant=True))


@flow
def requires_grad_toggle(impl, mesh):
    def fwd_bwd(model, s):
        if s == 1:  # freeze a trained parameter, unfreeze one frozen before fully_shard
            model.blocks[0].a.weight.requires_grad_(False)
            model.blocks[1].a.weight.requires_grad_(True)
        plain_step(model, s)
    return train(build(impl, mesh, frozen=["blocks.1.a.weight"]), fwd_bwd)


@flow
def load_state_dict_assign(impl, mesh, meta=False):
    donor = build(impl, mesh, seed=1)  # other values, sharded the same way
    state = {k: v.detach().clone() for k, v in donor.state_dict().items()}  # DTensors
    model = build(impl, mesh, meta=meta)
    model.load_state_dict(state, assign=True)
    return train(model)  # the optimizer is made after the load


@flow
def load_state_dict_assign_meta(impl, mesh):
    return load_state_dict_assign(impl, mesh, meta=True)


@flow
def load_state_dict_assign_into_a_submodule(impl, mesh, after_a_step=False):
    """blocks.0.a (inside the unit of blocks.0) takes another model's sharded values with
    load_state_dict(assign=True): its hooks, not only the unit's, must adopt them."""
    donor = build(impl, mesh, seed=1)
    state = {k: v.detach().clone() for k, v in donor.blocks[0].a.state_dict().items()}
    model = build(impl, mesh)
    if after_a_step:
        plain_step(model, 0)
        model.zero_grad()
    model.blocks[0].a.load_state_dict(state, assign=True)
    return train(model)


@flow
def load_state_dict_assign_into_a_submodule_after_a_step(impl, mesh):
    return load_state_dict_assign_into_a_submodule(impl, mesh, after_a_step=True)


@flow
def parameter_assigned_before_the_first_forward(impl, mesh):
    """model.blocks[0].a.weight = another model's sharded parameter: the first forward adopts it."""
    donor = build(impl, mesh, seed=1)
    model = build(impl, mesh)
    model.blocks[0].a.weight = nn.Parameter(donor.blocks[0].a.weight.detach().clone())
    return train(model)


@flow
def own_messages_inside_a_forward(impl, mesh):
    """blocks.1's forward sends rank 1 a message of its own (tag 1) while the all-gather of blocks.2
    is in flight: the user's messages and the unit's collectives must not take each other's bytes."""
    def exchange(module, args):
        t = torch.full((3,), float(dist.get_rank()))
        if dist.get_rank() == 0:
            dist.send(t, 1, tag=1)
        elif dist.get_rank() == 1:
            dist.recv(t, 0, tag=1)
    return train(build(impl, mesh, before_sharding=lambda m: m.blocks[1].register_forward_pre_hook(exchange)))


@flow
def grouped_unit_last_module_skipped(impl, mesh):
    def fwd_bwd(model, s):
        model.skip = (2,) if s == 1 else ()  # the unit [blocks.1, blocks.2] ends without its last module
        plain_step(model, s)
    return train(build(impl, mesh, grouped=True), fwd_bwd)


@flow
def grouped_unit_listed_out_of_order(impl, mesh):
    """fully_shard([blocks.2, blocks.1]): the unit's forward ends once both modules ran, not at the
    last one listed (which runs first), so it is gathered once and reduced once per micro-step; with
    accumulation, reducing it in two parts gave other bits than FSDP2's."""
    def fwd_bwd(model, s):
        for micro in range(2):  # sync off, then on
            model.set_requires_gradient_sync(micro == 1)
            ledger.reset()
            model(data(s, micro)).backward()
            if impl != "ours":
                continue
            # blocks.0, the pair, the root: one gather each in forward, the root's kept for backward
            expected = {"all_gather": 5, "reduce_scatter": 3 * micro, "all_reduce": 0}
            if ledger.counts != expected:
                raise AssertionError(f"collectives per micro-step {ledger.counts}, expected {expected}")
    return train(build(impl, mesh, grouped="reversed"), fwd_bwd)


@flow
def dataclass_output(impl, mesh):
    return train(build(impl, mesh, dataclass_output=True))


def fail_halfway_through_backward(model, x):
    """A forward and a backward that raises halfway: after blocks.2 and blocks.1, before blocks.0 and
    the root. Then FSDP2's documented recovery (reset_iter_state()), and the failed step's partial
    grads dropped (zero_grad): no update."""
    def fail(grad):
        raise RuntimeError("injected failure in backward")

    def arm(module, args, output):
        output.register_hook(fail)

    handle = model.blocks[0].register_forward_hook(arm)
    try:
        model(x).backward()
    except RuntimeError as e:
        if "injected failure" not in str(e):
            raise
    handle.remove()
    model.reset_iter_state()
    model.zero_grad(set_to_none=True)


@flow(fsdp2_differs="adds the failed step's head grads to the next step's: its root keeps the unsharded "
                     "grads it accumulated before the failure, which zero_grad() does not reach")
def reset_after_exception_in_backward(impl, mesh):
    def fwd_bwd(model, s):
        if s > 0:
            return plain_step(model, s)
        fail_halfway_through_backward(model, data(s))
    return train(build(impl, mesh), fwd_bwd)


@flow(fsdp2_differs="keeps its root's unsharded grads across the reset, as above")
def hsdp_reset_after_exception_with_kept_sums(impl, mesh):
    """HSDP (2 replicas of 1 shard): a micro-step with the all-reduce off keeps each unit's
    replica-local sums; the next, with it on, raises halfway through backward (blocks.0 and the root
    still hold their kept sums). reset_iter_state() drops them with the failed step's grads: the
    next steps train on their own grads only."""
    if impl == "ours":
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))

    def fwd_bwd(model, s):
        if s > 0:
            return plain_step(model, s)
        model.set_requires_all_reduce(False)
        model(data(s, 0)).backward()
        model.set_requires_all_reduce(True)
        fail_halfway_through_backward(model, data(s, 1))
    return train(build(impl, mesh), fwd_bwd)


@flow
def unit_skipped_in_the_sync_micro_step(impl, mesh):
    def fwd_bwd(model, s):
        for micro in range(2):  # sync off, then on; blocks.2 runs in the first only (layer drop)
            model.set_requires_gradient_sync(micro == 1)
            model.skip = (2,) if micro == 1 else ()
            model(data(s, micro)).backward()
    return train(build(impl, mesh), fwd_bwd)


@flow
def optimizer_step_in_backward(impl, mesh):
    """PyTorch's optimizer-in-backward pattern, for a parameter outside FSDP: a gate inside blocks.0
    (on blocks.0.a's output), stepped by its own optimizer as soon as its gradient is complete (lr 0:
    the numbers stay those of the other flows), while blocks.0.a's backward still needs its weight."""
    gate = nn.Parameter(torch.ones(D))
    gate_opt = torch.optim.SGD([gate], lr=0.0)

    def step_gate(p):
        gate_opt.step()
        gate_opt.zero_grad()
    gate.register_post_accumulate_grad_hook(step_gate)
    model = build(impl, mesh)
    model.blocks[0].a.register_forward_hook(lambda module, args, out: out * gate)
    return train(model)


# In a backward that recomputes a block twice, the plain model adds the block's gradients from the
# two recomputations before averaging over the ranks; ours reduces each recomputation's gradients as
# it finishes and adds the averages: the same sum in another order, so equal to rounding.
TWO_RECOMPUTATIONS_TOLERANCE = 1e-6
LOSES_A_RECOMPUTATIONS_SHARE = "is off by about 1: it loses one recomputation's share of the grads"


@flow(fsdp2_differs=LOSES_A_RECOMPUTATIONS_SHARE, tolerance=TWO_RECOMPUTATIONS_TOLERANCE)
def reentrant_checkpoint_two_forwards(impl, mesh):
    def fwd_bwd(model, s):  # each block's recomputation runs once per forward, inside one backward
        (model(data(s)) + model(data(s, k=1))).backward()
    return train(build(impl, mesh, reentrant=True), fwd_bwd)


@flow
def mixed_precision_dataclass_io(impl, mesh):
    return train(build(impl, mesh, bf16=True, dataclass_input=True, dataclass_output=True))


@flow
def bf16_first_grad_in_the_sync_micro_step(impl, mesh):
    """Under bf16 a unit keeps float32 sums for the parameters that got grads with sync off; one
    whose first grad comes with sync on brings it in bf16 (blocks.2, skipped in the first micro-step,
    in one unit with blocks.1). FSDP2 fails there (on the mixed dtypes; with a unit per block, on
    the unit that did not run), so its run mutes blocks.2 instead of skipping it: the same forward
    and grads, and zero grads for blocks.2, whose float32 sum is then the second micro-step's."""
    def fwd_bwd(model, s):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            setattr(model, "skip" if impl == "ours" else "mute", (2,) if micro == 0 else ())
            model(data(s, micro)).backward()
    return train(build(impl, mesh, bf16=True, grouped=True), fwd_bwd)


FAILS_ON_KEPT_SUMS = "fails on the shapes or drops the kept sums"


def hsdp_all_reduce_off(impl, mesh, skips):
    """HSDP (2 replicas of 1 shard), the all-reduce off in the first micro-step and on in the
    second, skipping the blocks in skips[micro] (blocks.1 and blocks.2 are one unit): the replica-
    local sums kept from the first cover other parameters than the second's, or the second does not
    run the unit at all."""
    if impl == "ours":
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))

    def fwd_bwd(model, s):
        for micro in range(2):
            model.set_requires_all_reduce(micro == 1)
            model.skip = skips[micro]
            model(data(s, micro)).backward()
    return train(build(impl, mesh, grouped=True), fwd_bwd)


@flow(fsdp2_differs=FAILS_ON_KEPT_SUMS)
def hsdp_kept_sums_lack_the_units_last_module(impl, mesh):
    return hsdp_all_reduce_off(impl, mesh, skips=((2,), ()))


@flow(fsdp2_differs=FAILS_ON_KEPT_SUMS)
def hsdp_kept_sums_lack_the_units_first_module(impl, mesh):
    return hsdp_all_reduce_off(impl, mesh, skips=((1,), ()))


@flow(fsdp2_differs=FAILS_ON_KEPT_SUMS)
def hsdp_all_reduce_micro_step_skips_a_module(impl, mesh):
    return hsdp_all_reduce_off(impl, mesh, skips=((), (1,)))


@flow(fsdp2_differs=FAILS_ON_KEPT_SUMS)
def hsdp_all_reduce_micro_step_skips_the_unit(impl, mesh):
    return hsdp_all_reduce_off(impl, mesh, skips=((), (1, 2)))


@flow
def hsdp_gradient_sync_switches_the_all_reduce_on(impl, mesh):
    """HSDP, the all-reduce off in the first micro-step; set_requires_gradient_sync(True) in the
    second switches it on again (FSDP2's does both), so the kept sums are averaged too. Against
    FSDP2 on the same mesh (2 replicas of 1 shard: only the all-reduce averages over the ranks;
    without it a rank's grads stay its own, or with the sums kept, none come out)."""
    if impl != "plain":
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))

    def fwd_bwd(model, s):
        model.set_requires_all_reduce(False)
        model(data(s, 0)).backward()
        model.set_requires_gradient_sync(True)
        model(data(s, 1)).backward()
    return train(build(impl, mesh), fwd_bwd)


@flow(fsdp2_differs="unfreezes inp.weight at the root's next gather and trains it in the last step")
def requires_grad_changed_while_gathered(impl, mesh):
    """After a no_grad forward the root stays gathered (reshard_after_forward is False for it):
    inp.weight is frozen through the module then (the unsharded parameter is registered), out.weight
    through the object the optimizer holds. Both stay frozen in the steps after."""
    def fwd_bwd(model, s):
        if s == 1:
            held = model.out.weight
            with torch.no_grad():
                model(data(s, k=1))
            model.inp.weight.requires_grad_(False)
            held.requires_grad_(False)
        plain_step(model, s)
    return train(build(impl, mesh), fwd_bwd)


@flow
def reused_layer_outside_then_checkpointed(impl, mesh):
    return train(build(impl, mesh, reuse="outside_then_checkpointed"))


@flow
def reused_layer_checkpointed_then_outside(impl, mesh):
    return train(build(impl, mesh, reuse="checkpointed_then_outside"))


@flow
def reused_layer_checkpointed_twice(impl, mesh):
    return train(build(impl, mesh, reuse="checkpointed_twice"))


@flow
def reused_layer_retain_graph(impl, mesh):
    def fwd_bwd(model, s):  # the second pass over the graph brings its grads in two passes again
        loss = model(data(s))
        loss.backward(retain_graph=True)
        loss.backward()
    return train(build(impl, mesh, reuse="checkpointed_then_outside"), fwd_bwd)


@flow(fsdp2_differs=LOSES_A_RECOMPUTATIONS_SHARE, tolerance=TWO_RECOMPUTATIONS_TOLERANCE)
def reused_layer_whole_block_checkpointed_two_forwards(impl, mesh):
    def fwd_bwd(model, s):  # the blocks' second recomputations run after their post-backward
        (model(data(s)) + model(data(s, k=1))).backward()
    return train(build(impl, mesh, reentrant=True, reuse="outside_then_checkpointed"), fwd_bwd)


@flow
def unit_called_twice_per_forward(impl, mesh):
    # each call's backward reduces its unit (the first call's in a gather made again), as FSDP2 does
    model = build(impl, mesh)
    model.twice = (1,)
    return train(model)


FAILS_INITIALIZING_UNDER_INFERENCE_MODE = "fails in its lazy initialization under inference_mode"


def inference_mode_forward(impl, mesh, first_step_too):
    def fwd_bwd(model, s):  # an evaluation under inference_mode, then training goes on
        if s > 0 or first_step_too:
            with torch.inference_mode():
                model(data(s, k=1))
        plain_step(model, s)
    return train(build(impl, mesh), fwd_bwd)


@flow
def inference_mode_forward_between_steps(impl, mesh):
    return inference_mode_forward(impl, mesh, first_step_too=False)


@flow(fsdp2_differs=FAILS_INITIALIZING_UNDER_INFERENCE_MODE)
def inference_mode_first_forward(impl, mesh):
    # the model's first forward (its lazy initialization) under inference_mode
    return inference_mode_forward(impl, mesh, first_step_too=True)


@flow
def dtype_changed_after_fully_shard(impl, mesh):
    model = build(impl, mesh).double()  # before the first forward: the model trains in float64

    def fwd_bwd(model, s):
        model(data(s).double()).backward()
    return train(model, fwd_bwd)


@flow
def unshard_before_each_forward(impl, mesh, inference_mode=False):
    def fwd_bwd(model, s):  # a hand prefetch of the first block, from the very first step on
        if impl != "plain":
            with torch.inference_mode(inference_mode):
                handle = model.blocks[0].unshard(async_op=True)
            handle.wait()
        plain_step(model, s)
    return train(build(impl, mesh), fwd_bwd)


@flow(fsdp2_differs=FAILS_INITIALIZING_UNDER_INFERENCE_MODE)
def unshard_under_inference_mode_before_each_forward(impl, mesh):
    # the model's lazy initialization then runs under inference_mode
    return unshard_before_each_forward(impl, mesh, inference_mode=True)


@flow
def forward_pre_hook_registered_before_fully_shard(impl, mesh):
    def penalize(model):  # a hook that reads the weights: it must see them gathered
        model.blocks[0].register_forward_pre_hook(lambda module, args: (args[0] + 0.01 * module.a.weight.sum(),))
    return train(build(impl, mesh, before_sharding=penalize))


@flow
def chunked_loss_calls_a_grouped_units_head_alone(impl, mesh):
    """fully_shard([blocks.2, out]): the forward stops before `out`, and the loss calls `out` alone on
    each of two chunks of the hidden state (a chunked loss), so the unit's modules run separately."""
    model = build(impl, mesh, grouped="with_out")
    model.head_outside = True

    def fwd_bwd(model, s):
        hidden = model(data(s))
        sum(model.out(chunk.to(model.out.weight.dtype)).sum() for chunk in hidden.chunk(2)).backward()
    return train(model, fwd_bwd)


@flow
def chunked_loss_with_the_units_other_module_skipped(impl, mesh):
    """As chunked_loss_calls_a_grouped_units_head_alone, with blocks.2 left out of the forward (layer
    drop): the unit's only module to run is `out`, called alone after the model's forward. (blocks.2
    is frozen: it never trains here, and the comparison asks every trainable parameter to move.)"""
    model = build(impl, mesh, grouped="with_out", frozen=[f"blocks.2.{n}" for n in ("a.weight", "a.bias",
                                                                                    "b.weight", "b.bias")])
    model.head_outside, model.skip = True, (2,)

    def fwd_bwd(model, s):
        hidden = model(data(s))
        sum(model.out(chunk).sum() for chunk in hidden.chunk(2)).backward()
    return train(model, fwd_bwd)


@flow
def grouped_units_member_run_alone_first(impl, mesh):
    """fully_shard([blocks.2, out]): each step first runs `out` alone on the input (a probe that
    trains too), then the whole model."""
    model = build(impl, mesh, grouped="with_out")

    def fwd_bwd(model, s):
        (model(data(s)) + model.out(data(s, 1)).sum()).backward()
    return train(model, fwd_bwd)


@flow
def meta_init_with_a_unit_empty_on_a_rank(impl, mesh):
    """`out` (a 1-row weight, a 1-element bias) as a unit of its own, on the meta device: at 2 ranks
    rank 1 holds none of it. to_empty(), a load of another model's values, then training."""
    donor = build(impl, mesh, seed=1, own_units=("out",))
    state = {k: v.detach().clone() for k, v in donor.state_dict().items()}
    model = build(impl, mesh, meta=True, own_units=("out",))
    model.to_empty(device="cpu")
    model.load_state_dict(state)
    return train(model)


@flow
def optimizer_in_backward_on_sharded_params(impl, mesh):
    """Each parameter stepped by an optimizer of its own from its post-accumulate-grad hook, as soon
    as its (sharded) gradient is complete: PyTorch's optimizer-in-backward pattern under FSDP."""
    model = build(impl, mesh)
    initial = full_params(model)
    optimizers = {p: torch.optim.AdamW([p], lr=LR, foreach=False) for p in model.parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: optimizer_step(optimizers[p]))
    for s in range(STEPS):
        plain_step(model, s)
    final = full_params(model)
    grads = {n: None if p.grad is None else full(p.grad) for n, p in model.named_parameters()}  # (zeroed)
    return grads, final, all(not torch.equal(initial[n], final[n]) for n in final)


@flow
def cpu_offload_policy_on_a_cpu_mesh(impl, mesh):
    """CPUOffloadPolicy on a CPU mesh: the shards already live in CPU memory, so training is as without it."""
    return train(build(impl, mesh, offload=True))


def every_fsdp_module(model):
    return [*model.blocks, model]


@flow
def gradient_divide_factor_with_sum_reductions(impl, mesh):
    """set_gradient_divide_factor(4) with set_force_sum_reduction_for_comms(True) on every sharded
    module (gloo has no PREMUL_SUM): the grads summed over the ranks, then divided by 4."""
    model = build(impl, mesh)
    for module in every_fsdp_module(model):
        module.set_gradient_divide_factor(4.0)
        module.set_force_sum_reduction_for_comms(True)
    return train(model)


@flow
def sum_reductions_only(impl, mesh):
    """set_force_sum_reduction_for_comms(True) alone: SUM collectives, then a division by W."""
    model = build(impl, mesh)
    for module in every_fsdp_module(model):
        module.set_force_sum_reduction_for_comms(True)
    return train(model)


@flow
def gradient_divide_factor_on_the_root_only(impl, mesh):
    """The factor set on the root module only: FSDP2's setter is not recursive, so the blocks
    still average."""
    model = build(impl, mesh)
    model.set_gradient_divide_factor(2.0 * dist.get_world_size())
    model.set_force_sum_reduction_for_comms(True)
    return train(model)


@flow
def forward_method_registered(impl, mesh):
    """register_fsdp_forward_method(blocks.1, "project"): each step's loss adds the block's project()
    of other data, which gathers the block's parameters as its forward does."""
    model = build(impl, mesh)
    if impl != "plain":
        REGISTER[impl](model.blocks[1], "project")

    def fwd_bwd(model, s):
        (model(data(s)) + model.blocks[1].project(data(s, 1)).sum()).backward()
    return train(model, fwd_bwd)


@flow
def all_reduce_hook_halves_the_grads(impl, mesh):
    """set_all_reduce_hook on every sharded module: a hook that halves the reduced flat grads in
    place (where a user would add a reduction of their own)."""
    model = build(impl, mesh)
    for module in every_fsdp_module(model):
        module.set_all_reduce_hook(lambda reduced: reduced.mul_(0.5))
    return train(model)


@flow
def two_backwards_per_step_the_first_not_last(impl, mesh):
    """Two backwards per step, the first after set_is_last_backward(False) (as a pipeline schedule's
    microbatches): the second completes both one's reductions."""
    def fwd_bwd(model, s):
        if impl != "plain":
            model.set_is_last_backward(False)
        model(data(s, 0)).backward()
        if impl != "plain":
            model.set_is_last_backward(True)
        model(data(s, 1)).backward()
    return train(build(impl, mesh), fwd_bwd)


@flow
def input_layer_not_gathered_for_backward(impl, mesh):
    """`inp` as a unit of its own with set_unshard_in_backward(False): its backward needs only its
    input and its output's grad, not its weight, so it is not gathered again (FSDP2's); and
    _set_unshard_async_op(True) on the root, which both take."""
    model = build(impl, mesh, own_units=("inp",))
    if impl != "plain":
        model.inp.set_unshard_in_backward(False)
        model._set_unshard_async_op(True)
    return train(model)


@flow
def float16_reduction(impl, mesh):
    """MixedPrecisionPolicy(reduce_dtype=float16) on the root (float32 parameters): the grads
    reduced in float16, divided before and after the sum against overflow, as FSDP2 divides them."""
    return train(build(impl, mesh, root_kw=lambda impl, model: {"mp_policy": BF16[impl](reduce_dtype=torch.float16)}))


@flow
def bf16_without_casting_forward_inputs(impl, mesh):
    """bf16 parameters everywhere, the root's MixedPrecisionPolicy with cast_forward_inputs=False:
    the root takes its input as given (bf16 here), the blocks still cast theirs."""
    model = build(impl, mesh, bf16=True, root_kw=lambda impl, model: {
        "mp_policy": BF16[impl](param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)})

    def fwd_bwd(model, s):
        model(data(s).bfloat16()).float().backward()
    return train(model, fwd_bwd)


def root_input_dtype_seen(impl, mesh):
    """The dtype the root's forward receives for a float32 input, with cast_forward_inputs True and
    False (bf16 parameters): a hook registered after fully_shard's records it, then casts."""
    seen = {}
    for cast in (True, False):
        model = build(impl, mesh, bf16=True, root_kw=lambda impl, model, cast=cast: {"mp_policy": BF16[impl](
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=cast)})
        model.register_forward_pre_hook(lambda module, args, cast=cast: (
            seen.__setitem__(f"cast_forward_inputs={cast}", str(args[0].dtype)), (args[0].bfloat16(),))[1])
        model(data(0)).float().backward()
    return seen


@flow
def ignored_parameter_stays_local(impl, mesh):
    """fully_shard(model, ignored_params={out.bias}): that bias stays a plain parameter of this rank's,
    trained on this rank's grads alone (rank 0's is compared)."""
    return train(build(impl, mesh, root_kw=lambda impl, model: {"ignored_params": {model.out.bias}}))


@flow
def shard_placement_fn_dim_0(impl, mesh):
    """shard_placement_fn asking Shard(0) for the matrices and None (the default) for the rest: the
    same sharding as without it."""
    return train(build(impl, mesh, root_kw=lambda impl, model: {
        "shard_placement_fn": lambda p: Shard(0) if p.dim() == 2 else None}))


def frozen_bf16_base(model):
    """LoRA's layout in every block: `a` a frozen bf16 base, `b` a float32 adapter, in one unit."""
    for block in model.blocks:
        block.a.to(torch.bfloat16).requires_grad_(False)


@flow
def lora_frozen_bf16_base(impl, mesh):
    """Each unit holds bf16 and float32 parameters (only the float32 ones train), no mixed precision:
    FSDP2 all-gathers their bytes."""
    return train(build(impl, mesh, before_sharding=frozen_bf16_base))


@flow
def lora_frozen_bf16_base_under_bf16(impl, mesh):
    """The same units under param_dtype bf16, reduce_dtype float32: one bf16 all-gather of both."""
    return train(build(impl, mesh, bf16=True, before_sharding=frozen_bf16_base))


SHARD_MATRICES_ON_DIM_1 = {"shard_placement_fn": lambda p: Shard(1) if p.dim() == 2 else None}


@flow
def shard_placement_fn_dim_1(impl, mesh):
    """Every unit's matrices sharded on dim 1 (D = 8 columns, 4 per rank; out.weight's single row
    too), the vectors on dim 0: each gather concatenates a matrix's chunks along dim 1."""
    return train(build(impl, mesh, unit_kw=SHARD_MATRICES_ON_DIM_1))


@flow
def shard_placement_fn_dim_1_under_bf16(impl, mesh):
    """The same under param_dtype bf16, reduce_dtype float32, asked as Shard(-1) (dim 1 of a matrix)."""
    last_dim = {"shard_placement_fn": lambda p: Shard(-1) if p.dim() == 2 else None}
    return train(build(impl, mesh, bf16=True, unit_kw=last_dim))


@flow
def shard_placement_fn_dim_1_lora_frozen_bf16_base(impl, mesh):
    """Dim 1 in units of bf16 and float32 parameters (LoRA's): the chunks arrive in a byte all-gather."""
    return train(build(impl, mesh, before_sharding=frozen_bf16_base, unit_kw=SHARD_MATRICES_ON_DIM_1))


@flow
def hsdp_shard_placement_fn_dim_1(impl, mesh):
    """HSDP (2 replicas of 1 shard) with the matrices on dim 1: one chunk, the whole matrix."""
    if impl != "plain":
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    return train(build(impl, mesh, unit_kw=SHARD_MATRICES_ON_DIM_1))


class Mark(torch.autograd.Function):
    """The identity; its backward logs that the gradient has reached `name`'s own computation, after
    the hooks on its output (a unit's pre-backward) have run."""
    @staticmethod
    def forward(ctx, x, name, log):
        ctx.name, ctx.log = name, log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(f"grad:{ctx.name}")
        return grad, None, None


COLLECTIVES = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
               "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
               "all_reduce": "all_reduce"}


@contextlib.contextmanager
def collectives_logged(log):
    """Each collective torch.distributed is handed, as "<kind>:<its largest tensor's numel>", into log."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def logged(name, fn):
        def call(*args, **kwargs):
            numel = max(a.numel() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            log.append(f"{COLLECTIVES[name]}:{numel}")
            return fn(*args, **kwargs)
        return call
    for name, fn in originals.items():
        setattr(dist, name, logged(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def prefetch_orders(impl, mesh):
    """Each prefetch setting's second step (the first records the order) as one rank sees it: every
    collective issued, each unit's forward starting (after its pre-forward) and the gradient reaching
    each unit's computation (after its pre-backward). Settings: none given; every list empty (FSDP2:
    no forward prefetch, and its default in backward); the lists train.py's backends set."""
    orders = {}
    for setting in ("default", "empty_lists", "explicit_lists"):
        log = []

        def marks(model):
            for name, module in [("root", model)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]:
                module.register_forward_pre_hook(lambda m, args, name=name: log.append(f"forward:{name}"))
                module.register_forward_hook(lambda m, args, out, name=name: Mark.apply(out, name, log))
        model = build(impl, mesh, before_sharding=marks)
        units, blocks = [model, *model.blocks], list(model.blocks)
        if setting == "empty_lists":
            for unit in units:
                unit.set_modules_to_forward_prefetch([])
                unit.set_modules_to_backward_prefetch([])
        if setting == "explicit_lists":
            for unit, nxt in zip(units, blocks + [None]):
                unit.set_modules_to_forward_prefetch([nxt] if nxt else [])
            backward = [model] + blocks[::-1]
            for unit, nxt in zip(backward, backward[1:] + [None]):
                unit.set_modules_to_backward_prefetch([nxt] if nxt else [])
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        for s in range(2):
            if s == 1:
                log.clear()
                with collectives_logged(log):
                    plain_step(model, s)
            else:
                plain_step(model, s)
            optimizer_step(opt)
        orders[setting] = list(log)
    return orders


def non_root_forward_first(impl, mesh):
    """A block runs (a no_grad probe) before the root's first forward, then a training step; per
    probed block, what was raised (FSDP2: a RuntimeError from the root's forward, "... requires
    running forward through the root module first")."""
    rec = {}
    for i in (0, 1):
        model = build(impl, mesh)
        try:
            with torch.no_grad():
                model.blocks[i](data(0))
            model(data(0)).backward()
            rec[f"blocks.{i}"] = {"raised": None}
        except Exception as e:
            rec[f"blocks.{i}"] = {"raised": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    return rec


def grouped_unit_output_dtypes(impl, mesh):
    """The dtype of each block's output under output_dtype=float32 (bf16 parameters), with blocks.1
    and blocks.2 in one unit: FSDP2 casts every module's output, not only the unit's last."""
    model = build(impl, mesh, grouped=True, bf16=True, output_dtype=torch.float32)
    seen = {}
    for i, block in enumerate(model.blocks):  # (registered after fully_shard's hook: sees its output)
        block.register_forward_hook(lambda module, args, out, i=i: seen.__setitem__(f"blocks.{i}", str(out.dtype)))
    model(data(0)).backward()
    return seen


def memory_report_of_uneven_shards(impl, mesh):
    """observe.Observer.memory (train.py's memory rows) after a step of a Linear(3, 5) sharded by rows,
    which leaves rank 0 three rows of 5 and rank 1 two, where rank 0 has dropped its grads and rank 1
    has touched 128 MB more (so each rank holds the most of something): the row, and every rank's
    own bytes of parameters, gradients and AdamW state and its own peak RSS before and after it."""
    import observe
    torch.manual_seed(0)
    model = nn.Linear(3, 5)
    SHARD[impl](model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    model(data(0)[:, :3]).sum().backward()
    opt.step()
    if dist.get_rank() == 0:
        opt.zero_grad(set_to_none=True)
    peak = torch.ones(32 * 2**20) if dist.get_rank() == 1 else None  # noqa: F841 (alive through the report)

    def nbytes(tensors):
        return sum(t.to_local().numel() * t.element_size() if isinstance(t, DTensor) else t.numel() * t.element_size()
                   for t in tensors) / 2**20
    own = {"params_mb": nbytes(model.parameters()),
           "grads_mb": nbytes(p.grad for p in model.parameters() if p.grad is not None),
           "optim_mb": nbytes(v for st in opt.state.values() for v in st.values())}
    rss_before = observe.rss_mb()
    row = observe.Observer("unused", impl, dist.get_rank(), "cpu", profile=False, memory_snapshot=False).memory(
        "after first step", model, opt)
    own["rss_before"], own["rss_after"] = rss_before, observe.rss_mb()
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, own)
    return {"row": row, "ranks": ranks}


def freed_after_del(impl, mesh):
    """Whether a model that trained a step is freed once its last reference is dropped."""
    model = build(impl, mesh)
    plain_step(model, 0)
    alive = weakref.ref(model)
    del model
    gc.collect()
    return alive() is None


def list_argument_and_dropped_forward(impl, mesh):
    """A unit given (x, a list it appends to): how many entries the caller's own list got (the gate
    must not hand the module a copy). Then, ours only (the ledger): after a forward with grad whose
    output is dropped, the order of each unit's backward start and end in the next training step."""
    class Collecting(Block):
        def forward(self, x, found):
            found.append(len(found))
            return super().forward(x)
    torch.manual_seed(0)
    probe = Collecting()
    SHARD[impl](probe, mesh=mesh)
    found = []
    probe(torch.randn(2, D, requires_grad=True), found).sum().backward()
    rec = {"list_entries": len(found)}
    if impl == "ours":
        model = build(impl, mesh)
        model(data(0))  # grad on, no backward: dropped
        ledger.reset(record_events=True)
        model(data(1)).backward()
        rec["order"] = [f"{e}:{u}" for e, u in ledger.events if e in ("backward", "backward_end")]
        ledger.reset()
    return rec


def late_unshard_handle_wait(impl, mesh):
    """A handle from blocks.0's unshard(async_op=True), waited only after the forward has used and
    resharded the block: whether blocks.0 still holds its sharded DTensor parameters then."""
    model = build(impl, mesh)
    plain_step(model, 0)
    handle = model.blocks[0].unshard(async_op=True)
    loss = model(data(1))
    handle.wait()
    sharded_after = isinstance(model.blocks[0].a.weight, DTensor)
    loss.backward()
    return {"sharded_after_wait": sharded_after}


def fully_shard_twice(impl, mesh):
    """fully_shard() again on a block already sharded: what is raised, and whether the model still
    trains a step afterwards (nothing was changed before the error)."""
    model = build(impl, mesh)
    return raised_then_trains(model, lambda: SHARD[impl](model.blocks[0], mesh=mesh))


def submodule_state_dict_while_gathered(impl, mesh):
    """After a no_grad forward the root stays gathered: whether out.state_dict() (a submodule
    holding root parameters) returns sharded DTensors, and whether loading them back works."""
    model = build(impl, mesh)
    plain_step(model, 0)
    with torch.no_grad():
        model(data(1))
    state = model.out.state_dict()
    rec = {"dtensors": all(isinstance(v, DTensor) for v in state.values())}
    with torch.no_grad():
        model(data(1))
    try:
        model.out.load_state_dict({k: v.detach().clone() for k, v in state.items()})
        rec["loaded"] = True
    except Exception as e:
        rec["loaded"] = f"{type(e).__name__}: {e}"
    return rec


def graphs_of_compiled_blocks(impl, mesh):
    """block.compile() before sharding (the module's whole call, hooks included, as torch.compile
    sees it; dynamo's eager backend, so nothing is built): how many graphs three steps and an
    evaluation make. Traced, our hooks split each block's call and recompiled on their counters."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = build(impl, mesh, before_sharding=lambda m: [b.compile(backend="eager") for b in m.blocks])
    for s in range(3):
        plain_step(model, s)
        with torch.no_grad():
            model(data(s, k=1))
    return counters["stats"]["unique_graphs"]


def sharded_layouts_on_dim_1(impl, mesh):
    """After a step with the matrices on dim 1: each sharded parameter's and grad's placements, local
    shape and local stride."""
    model = build(impl, mesh, unit_kw=SHARD_MATRICES_ON_DIM_1)
    plain_step(model, 0)
    return {n: [[str(t.placements), list(t.to_local().shape), list(t.to_local().stride())] for t in (p, p.grad)]
            for n, p in model.named_parameters()}


def meta_model_first_forward(impl, mesh):
    """A model built on the meta device and never materialized: what its first forward raises."""
    model = build(impl, mesh, meta=True)
    try:
        plain_step(model, 0)
        return {"raised": None}
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e)}


def deepcopy_of_a_sharded_model(impl, mesh):
    """copy.deepcopy of a sharded model (a teacher for distillation, say): what is raised."""
    model = build(impl, mesh)
    return raised_then_trains(model, lambda: copy.deepcopy(model))


def what_is_refused(impl, mesh):
    """What fully_shard raises for what FSDP2 refuses: a container with no forward of its own, a 3-D
    mesh, a 2-D mesh whose dims have no names, parameters of two dtypes that both train, a dim other
    than 0 that does not split evenly (3 columns over 2 ranks), a channels_last (non-contiguous) weight."""
    def raised(attempt):
        try:
            attempt()
            return None
        except Exception as e:
            return {"type": type(e).__name__, "lines": len(str(e).splitlines())}
    mesh_3d = init_device_mesh("cpu", (1, 1, dist.get_world_size()))
    unnamed_2d = init_device_mesh("cpu", (1, dist.get_world_size()))  # which dim replicates?
    def train_two_dtypes():  # both train: a unit reduces its grads in one dtype (a frozen one may differ)
        model = nn.Linear(2, 2)
        model.bias.data = model.bias.data.double()
        SHARD[impl](model, mesh=mesh)
        model(torch.randn(4, 2)).sum().backward()
    return {"module_list": raised(lambda: SHARD[impl](nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh)),
            "trainable_params_of_two_dtypes": raised(train_two_dtypes),
            "module_dict": raised(lambda: SHARD[impl](nn.ModuleDict({"a": nn.Linear(2, 2)}), mesh=mesh)),
            "mesh_3d": raised(lambda: SHARD[impl](nn.Linear(2, 2), mesh=mesh_3d)),
            "unnamed_2d_mesh": raised(lambda: SHARD[impl](nn.Linear(2, 2), mesh=unnamed_2d)),
            "channels_last_parameter": raised(lambda: SHARD[impl](nn.Conv2d(2, 4, 3).to(
                memory_format=torch.channels_last), mesh=mesh)),
            "uneven_shard_on_dim_1": raised(lambda: SHARD[impl](nn.Linear(3, 3), mesh=mesh, **SHARD_MATRICES_ON_DIM_1))}


def refused_arguments(impl, mesh):
    """fully_shard with what fsdp_impl does not do: dp_mesh_dims. FSDP2: whether it trains;
    fsdp_impl: what it raises."""
    from torch.distributed.fsdp import DataParallelMeshDims
    cases = {"dp_mesh_dims": dict(mesh=init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",)),
                                  dp_mesh_dims=DataParallelMeshDims(shard="dp"))}
    res = {}
    for case, kw in cases.items():
        try:
            model = nn.Linear(2 * D, 2 * D)
            SHARD[impl](model, **{"mesh": mesh, **kw})
            model(torch.randn(4, 2 * D)).sum().backward()
            res[case] = "trained"
        except Exception as e:
            res[case] = {"type": type(e).__name__, "lines": len(str(e).splitlines())}
    return res


REFUSED_API = ["set_custom_all_gather", "set_custom_reduce_scatter", "set_allocate_memory_from_process_group_for_comm",
               "set_symm_mem_for_comm", "set_separate_reduce_scatter_group", "set_reduce_scatter_max_input_buffers",
               "set_reduce_scatter_unused_params"]


def refused_api(impl, mesh):
    """What each FSDPModule method fsdp_impl does not support raises (FSDP2: whether it has it)."""
    model = build(impl, mesh)
    if impl == "fsdp2":
        return {name: callable(getattr(model, name, None)) for name in REFUSED_API}
    res = {}
    for name in REFUSED_API:
        try:
            getattr(model, name)(None)
            res[name] = None
        except Exception as e:
            res[name] = {"type": type(e).__name__, "lines": len(str(e).splitlines())}
    return res


def slice_of_a_sharded_sequential(impl, mesh):
    """model[:2] of a sharded nn.Sequential: a plain Sequential of the same layers, not an FSDP module
    without FSDP state."""
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1))
    SHARD[impl](model, mesh=mesh)
    head = model[:2]
    return {"class": type(head).__name__, "fsdp": isinstance(head, (FSDP2Module, OurModule)),
            "same_layers": list(head) == list(model)[:2]}


def jvp_through_a_sharded_model(impl, mesh):
    """torch.func.jvp of the sharded model (a forward-mode derivative, as in some second-order
    methods): its output and tangent, then whether a training step still runs."""
    model = build(impl, mesh)
    out, tangent = torch.func.jvp(model, (data(0),), (data(0, 1),))
    rec = {"out": out.tolist(), "tangent": tangent.tolist()}
    return rec | raised_then_trains(model, lambda: None)


def raised_then_trains(model, attempt, recover=lambda: None):
    """What attempt() raised, and whether, after recover(), the model trains a step."""
    try:
        attempt()
        rec = {"raised": None}
    except Exception as e:
        rec = {"raised": type(e).__name__, "message": str(e)}
    recover()
    try:
        plain_step(model, 1)
        rec["trains_after"] = True
    except Exception:
        rec["trains_after"], rec["traceback"] = False, traceback.format_exc()
    return rec


def inplace_on_a_view_output(impl, mesh):
    """blocks.0 returns a view, which a forward hook then changes in place: that replaces the view's
    autograd history, and with it the hook that gathers the unit for its backward, whose gather
    blocks.1's backward has prefetched. What is raised (FSDP2: a RuntimeError, as its parameters'
    storage is empty), and whether, after reset_iter_state(), the model trains a step."""
    model = build(impl, mesh)
    block = model.blocks[0]
    block.forward = lambda x, forward=block.forward: forward(x).view(-1, D)
    hook = block.register_forward_hook(lambda module, args, out: out.mul_(1.5))

    def recover():
        model.reset_iter_state()
        hook.remove()
    return raised_then_trains(model, lambda: plain_step(model, 0), recover)


# ---- comparison -------------------------------------------------------------------------------
def diff(a, b):
    """(max |a - b| over the dicts' tensors, bitwise equal); inf where one is None or shapes differ."""
    if a.keys() != b.keys():
        return math.inf, False
    d, equal = 0.0, True
    for k in a:
        x, y = a[k], b[k]
        if x is None and y is None:
            continue
        if x is None or y is None or x.shape != y.shape:
            return math.inf, False
        d = max(d, (x.double() - y.double()).abs().max().item())
        equal = equal and torch.equal(x, y)
    return d, equal


def compare(run, mesh):
    rec, res = {"reference": run.reference, "tolerance": run.tolerance}, {}
    for impl in ("ours", rec["reference"]):
        try:
            res[impl] = run(impl, mesh)
        except Exception:
            print(f"rank {dist.get_rank()}: {impl} raised in {run.__name__}", file=sys.stderr, flush=True)
            rec[f"{impl}_error"] = traceback.format_exc()
    if len(res) == 2:
        (g1, p1, m1), (g2, p2, m2) = res["ours"], res[rec["reference"]]
        rec["param_diff"], rec["param_bitwise"] = diff(p1, p2)
        rec["grad_diff"], rec["grad_bitwise"] = diff(g1, g2)
        rec["params_moved"] = {"ours": m1, "reference": m2}
    return rec


def checked(check, impl, mesh):
    """check(impl, mesh), or the traceback it raised: one check that cannot run leaves the rest."""
    try:
        return check(impl, mesh)
    except Exception:
        print(f"rank {dist.get_rank()}: {impl} raised in {check.__name__}", file=sys.stderr, flush=True)
        return {"error": traceback.format_exc()}


def write(result, out_path):
    if dist.get_rank() == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(out_path + ".tmp", out_path)
    dist.barrier()  # on disk before any rank goes on (and maybe crashes)


def main():
    out_path = sys.argv[1]
    faulthandler.register(signal.SIGTERM, chain=True)  # a rank stopped at the test's timeout says where it was
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {run.__name__: compare(run, mesh) for run in FLOWS}
    for check in (grouped_unit_output_dtypes, memory_report_of_uneven_shards, freed_after_del, fully_shard_twice,
                  list_argument_and_dropped_forward, inplace_on_a_view_output, late_unshard_handle_wait, deepcopy_of_a_sharded_model,
                  submodule_state_dict_while_gathered, meta_model_first_forward, graphs_of_compiled_blocks,
                  what_is_refused, slice_of_a_sharded_sequential, jvp_through_a_sharded_model, refused_api,
                  refused_arguments, root_input_dtype_seen, sharded_layouts_on_dim_1, prefetch_orders):
        impls = ("fsdp2", "ours", "plain") if check is jvp_through_a_sharded_model else ("fsdp2", "ours")
        result[check.__name__] = {impl: checked(check, impl, mesh) for impl in impls}
    # The last flow can kill the process (fsdp_impl segfaulted there). The other flows' results are
    # written first, then again with this flow's record: after a crash the report lacks it (and the
    # exit code is nonzero), which the test reports as the crash, the other tests unaffected.
    write(result, out_path)
    result["non_root_forward_first"] = {impl: non_root_forward_first(impl, mesh) for impl in ("fsdp2", "ours")}
    write(result, out_path)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # FSDP2 on gloo sometimes aborts at interpreter exit otherwise


if __name__ == "__main__":
    main()
