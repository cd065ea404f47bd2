"""
The user-facing API, named like FSDP2's so code written for one runs on the other:

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)            # the root: what no nested call took (embeddings, ln_f, lm_head)

fully_shard() shards the module's parameters, makes its class derive from FSDPModule too, and
registers thin forward hooks that call into the module's ShardedUnit.
"""
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.utils import _apply_to_tensors

from . import comm
from .schedule import Schedule
from .unit import FORWARD, GATHERING, ShardedUnit


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: Optional[torch.dtype] = None  # all-gather and compute in this dtype (None: the params' own)
    reduce_dtype: Optional[torch.dtype] = None  # reduce-scatter gradients in this dtype (None: param_dtype)
    output_dtype: Optional[torch.dtype] = None  # cast floating-point outputs of the module's forward
    cast_forward_inputs: bool = True  # cast floating-point inputs to param_dtype


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: FSDP2's base policy and the default."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients (and so optimizer state) in CPU memory, pinned by default.
    On a CPU mesh they are there already: nothing moves."""
    pin_memory: bool = True


_default_mesh = None  # (the default process group, the 1-D mesh over it)


def _mesh_for(mesh):
    """`mesh`, or one over the default process group on the accelerator if there is one (as FSDP2's
    default). A process group made anew after a destroy gets a mesh of its own."""
    global _default_mesh
    if mesh is not None:
        return mesh
    group = dist.distributed_c10d._get_default_group()
    if _default_mesh is None or _default_mesh[0] is not group:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        _default_mesh = group, init_device_mesh(accelerator.type if accelerator else "cpu", (group.size(),))
    return _default_mesh[1]


def _check(modules, mesh):
    """Refuse at once what FSDP2 refuses, with its exception types."""
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard: a {mesh.ndim}-D mesh; use a 1-D mesh (shard) or a 2-D one (replicate, shard)")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:  # (FSDP2 raises AssertionError here too)
        raise AssertionError("fully_shard: a 2-D mesh without mesh_dim_names; name its dims (replicate, shard)")
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(f"fully_shard: {type(m).__name__} has no forward of its own; shard the modules it "
                             "holds, or a module that runs them")
        if hasattr(m, "_fsdp_unit"):  # (FSDP2 raises AssertionError here too)
            raise AssertionError(f"fully_shard: this {type(m).__name__} was sharded already (once per module)")


def fully_shard(module: Union[nn.Module, list[nn.Module]], *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: Union[bool, int, None] = None,
                shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(), ignored_params: Optional[set] = None,
                dp_mesh_dims=None) -> nn.Module:
    """Shard `module`'s parameters (those no nested fully_shard took) over `mesh`'s last dim; a 2-D
    mesh (replicate, shard) gives HSDP. As FSDP2's (_fully_shard.py), it moves the modules' buffers
    to the mesh's device, and on CUDA the root's forward moves its inputs there.

    reshard_after_forward: True frees the gathered parameters after forward (ZeRO-3), False keeps
    them until after backward (ZeRO-2); None means True, except for the root. An int G, a factor of
    the shard group's size, keeps each rank's piece over its group of G ranks for backward's gather.
    offload_policy: CPUOffloadPolicy (ours or torch's) keeps the shards in CPU memory.
    ignored_params: not sharded, not moved, their gradients not reduced.
    shard_placement_fn(param) -> Shard(dim) or None (dim 0); a dim other than 0 must split evenly.
    """
    if dp_mesh_dims is not None:
        raise NotImplementedError("fully_shard(dp_mesh_dims=...): fsdp_impl takes the data-parallel mesh itself "
                                  "(1-D, or 2-D for HSDP), with tensor parallel parameters on a mesh of their own")
    mesh = _mesh_for(mesh)
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _check(modules, mesh)
    if not hasattr(offload_policy, "pin_memory") or mesh.device_type == "cpu":  # (CPUOffloadPolicy's, ours or torch's)
        offload_policy = None  # nothing to move: no policy, the base one, or a CPU mesh
    unit = ShardedUnit(modules, mesh, reshard_after_forward, mp_policy, offload_policy, ignored_params or (),
                       shard_placement_fn)
    for m in modules:
        for sub in m.modules():  # units sharded before this one, inside it: this is their parent
            if hasattr(sub, "_fsdp_unit") and sub._fsdp_unit.parent is None:
                sub._fsdp_unit.parent = unit
    for m in modules:
        m._fsdp_unit = unit
        # first, so that hooks the module already had see its gathered parameters (as under FSDP2)
        m.register_forward_pre_hook(_pre_forward, with_kwargs=True, prepend=True)
        m.register_forward_hook(_post_forward)
        cls = m.__class__
        m.__class__ = _fsdp_classes.setdefault(cls, type(f"FSDP{cls.__name__}", (FSDPModule, cls), {}))
    # state_dict() and load_state_dict() see the sharded DTensors, also on a submodule holding some
    # of the unit's parameters (FSDP2 hooks each too). A load with assign=True into a materialized
    # unit rebuilds its flat shard once per such module; into a meta model, once, after its last
    for owner in dict.fromkeys(modules + [owner for ps in unit.params for owner, _ in ps.registrations]):
        owner.register_state_dict_pre_hook(lambda *_: unit.reshard())
        owner._register_load_state_dict_pre_hook(lambda *_: unit.reshard())
        owner.register_load_state_dict_post_hook(lambda *_: unit.adopt_assigned_params())
    return module


_fsdp_classes = {}
fully_shard.state = lambda module: module._fsdp_unit  # (fsdp_impl's ShardedUnit, not FSDP2's state object)


@torch.inference_mode(False)  # (a first forward may run under it: these tensors outlive it)
def _lazy_init(root_module):
    """The first unit to run forward is the root: it gathers every unit below into one schedule."""
    root = root_module._fsdp_unit
    if len(root.modules) > 1:  # (FSDP2 refuses it too: which module's subtree would the step be?)
        raise RuntimeError(f"fully_shard: the root unit holds {len(root.modules)} modules; run the first "
                           "forward through one module that holds them all, itself fully_shard-ed")
    units = {}  # unit -> its first module's path, in module order
    for path, m in root_module.named_modules():
        if hasattr(m, "_fsdp_unit"):
            if m._fsdp_unit.schedule is not None:
                raise RuntimeError(f"fully_shard: {path} ran forward before the root module did: "
                                   "run the first forward through the root")
            units.setdefault(m._fsdp_unit, path or "root")
    schedule = Schedule(list(units), root)
    try:
        with _outside_func_transforms():
            for unit, path in units.items():
                unit.name = path
                unit.lazy_init(schedule, is_root=unit is root)
    except Exception:  # (parameters still on meta): once that is mended, the next forward starts afresh
        for unit in units:
            unit.schedule = None
        raise


def _outside_func_transforms():
    """Inside a torch.func transform (jvp, say) the units' own bookkeeping runs outside it, on the
    tensors themselves, as FSDP2's does. (Outside one, the check is far cheaper than the switch.)"""
    return torch._C._DisableFuncTorch() if torch._C._are_functorch_transforms_active() else comm.NOTHING


def _map_tensors(fn, tree):
    """fn over the tensors in a module's inputs or outputs: a tensor or a tuple of them directly, else
    through torch's walk (FSDP2's too), which opens dataclasses but is slow on the host's time."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if type(tree) is tuple and all(isinstance(t, torch.Tensor) for t in tree):
        return tuple(fn(t) for t in tree)
    return _apply_to_tensors(fn, tree)


def _cast(tree, dtype):
    return _map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _to_device(tree, device):
    return _map_tensors(lambda t: t.to(device), tree) if tree else tree


# The hooks stay out of any graph torch.compile makes of a module's call (module.compile()): traced,
# they broke it into pieces and recompiled on their counters (as FSDP2, which disables its hooks too)
@torch._dynamo.disable(recursive=True)
def _pre_forward(module, args, kwargs):
    unit = module._fsdp_unit
    if unit.schedule is None:
        _lazy_init(module)
    if unit is unit.schedule.root:
        if unit.post_optim_event is not None:  # the shards the gathers read are updated once it is done
            event, unit.post_optim_event = unit.post_optim_event, None
            event.wait()  # (the current stream waits: fsdp_impl's all-gathers are issued from it)
        if unit.compute_device.type == "cuda":  # (as FSDP2's root, and DDP)
            args, kwargs = _to_device(args, unit.compute_device), _to_device(kwargs, unit.compute_device)
    with _outside_func_transforms():
        needs_gate = unit.pre_forward(torch.is_grad_enabled())
    if unit.mp.param_dtype is not None and unit.mp.cast_forward_inputs:
        args, kwargs = _cast(args, unit.mp.param_dtype), _cast(kwargs, unit.mp.param_dtype) if kwargs else kwargs
    if needs_gate and torch.is_grad_enabled():
        args, kwargs = _gate_inputs(unit, args, kwargs)
    return args, kwargs


class _InputGradGate(torch.autograd.Function):
    """Identity on a unit's forward inputs. Its backward runs once their grads are computed, that
    is once this forward's backward is over: it runs the unit's post-backward (as FSDP2's)."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.unit.state == GATHERING:  # the backward just read parameters that were still arriving
            raise RuntimeError(
                f"fully_shard({ctx.unit.name}): its backward ran before its parameters were gathered, because the "
                "hook on its output did not run; an in-place op on an output that is a view removes that hook: "
                "change such an output out of place, or clone it first")
        ctx.unit.post_backward()
        return (None, *grads)


def _gate_inputs(unit, args, kwargs):
    """The inputs that require grad, through one _InputGradGate: positional and keyword tensors, else
    those inside containers (rebuilt, as the cast rebuilds them). None (the root's token ids): no
    gate, and the end of backward runs its post-backward."""
    def needs_grad(v):
        return isinstance(v, torch.Tensor) and v.requires_grad

    tensors = [v for v in (*args, *kwargs.values()) if needs_grad(v)]
    if tensors:
        gated = iter(_InputGradGate.apply(unit, *tensors))
        return (tuple(next(gated) if needs_grad(v) else v for v in args),
                {k: next(gated) if needs_grad(v) else v for k, v in kwargs.items()})
    inner = []
    _map_tensors(lambda t: inner.append(t) if needs_grad(t) else None, (args, kwargs))  # (collects only)
    if not inner:
        return args, kwargs
    gated = iter(_InputGradGate.apply(unit, *inner))
    return _map_tensors(lambda t: next(gated) if needs_grad(t) else t, (args, kwargs))


@torch._dynamo.disable(recursive=True)
def _post_forward(module, args, output):
    unit = module._fsdp_unit
    if unit.mp.output_dtype is not None:  # every module's output, in a grouped unit too (as FSDP2)
        output = _cast(output, unit.mp.output_dtype)
    if not unit.module_ran(module):
        return output  # a grouped unit ends once each of its modules ran...
    ending = [unit]
    if unit is unit.schedule.root:  # ...or, if one of them did not run (a skipped layer), with the root
        ending += [u for u in unit.schedule.units if u is not unit and u.training_state == FORWARD]
    grad_enabled = torch.is_grad_enabled()
    with _outside_func_transforms():
        for u in ending:
            u.post_forward(grad_enabled)
    if grad_enabled:
        _map_tensors(lambda t: _register_pre_backward(t, ending), output)
    return output


def _register_pre_backward(tensor, units):
    """Start each unit's backward when the gradient of `tensor`, one of their outputs, arrives."""
    if tensor.requires_grad:
        for unit in units:
            tensor.register_hook(lambda grad, unit=unit: unit.pre_backward())  # (None: the grad unchanged)
    return tensor


class FSDPModule:
    """Methods every fully_shard-ed module gains. Setters apply to all units below by default."""

    def _units(self, recurse=True):
        if not recurse:
            return [self._fsdp_unit]
        units = self.__dict__.get("_fsdp_units_below")
        if units is None:
            units = list({m._fsdp_unit: None for m in self.modules() if hasattr(m, "_fsdp_unit")})
            if self._fsdp_unit.schedule is not None:  # after lazy init the tree is final: keep the list
                self.__dict__["_fsdp_units_below"] = units
        return units

    def __new__(cls, *args, **kwargs):
        """A module built from a sharded one's class (slicing an nn.Sequential builds `type(self)(...)`)
        is of the original class: only fully_shard makes FSDP modules (as in FSDP2)."""
        original = cls.__mro__[2]  # (FSDP<name>, FSDPModule, the original class, ...)
        module = original.__new__(original, *args, **kwargs)
        module.__init__(*args, **kwargs)
        return module

    def __deepcopy__(self, memo):
        raise AssertionError(f"copy.deepcopy of a fully_shard-ed {type(self).__name__}: each rank holds only its "
                             "shards (FSDP2 refuses it too); load its state_dict() into a model of its own")

    def unshard(self, async_op: bool = False) -> Optional["_UnshardHandle"]:
        """Gather this unit's parameters now; with async_op, a handle whose wait() finishes it."""
        unit = self._fsdp_unit
        if unit.schedule is None:  # before the first forward: set up from the root, as forward will
            root = unit
            while root.parent is not None:
                root = root.parent
            _lazy_init(root.modules[0])
        unit.unshard()
        if not async_op:
            unit.wait_unshard()
            return None
        return _UnshardHandle(unit)

    def reshard(self) -> None:
        self._fsdp_unit.reshard()

    def reset_iter_state(self) -> None:
        """After catching an exception raised in forward or backward: reshard every unit and drop
        the failed step's pending gradients, so the next step runs normally (as FSDP2's)."""
        if self._fsdp_unit.schedule is not None:
            self._fsdp_unit.schedule.reset()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward sums the grads locally, unreduced (no_sync); the next backward with it on
        reduces the sum. Under HSDP this switches the all-reduce across replicas too, as FSDP2's does."""
        for unit in self._units(recurse):
            unit.knobs.requires_grad_sync = requires_gradient_sync
            unit.knobs.requires_all_reduce = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: units stay gathered after their backward (between micro-steps that do not sync,
        say); the next forward then needs no all-gather. A reshard or an optimizer step frees them."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):  # (FSDP2's: None and group sizes are fully_shard's)
            raise ValueError(f"set_reshard_after_forward({reshard_after_forward!r}): pass True or False")
        for unit in self._units(recurse):
            unit.reshard_after_forward, unit.post_forward_size = reshard_after_forward, None

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False keeps each replica's reduce-scattered sums, unreduced across replicas, and adds
        them to the next micro-step's; the micro-step with it on all-reduces the total."""
        for unit in self._units(recurse):
            unit.knobs.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by `factor` instead of averaging them over the ranks, for this
        module's unit only (FSDP2's: PREMUL_SUM, or SUM and a division with sums forced)."""
        for unit in self._units(recurse=False):
            unit.knobs.gradient_divide_factor = factor

    set_reduce_scatter_divide_factor = set_gradient_divide_factor  # (its older name, as in FSDP2)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM only, dividing before or after the collectives (NCCL's zero-copy
        collectives need SUM). For this module's unit only, as FSDP2's."""
        for unit in self._units(recurse=False):
            unit.knobs.sums_only = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """Call hook(reduced flat grads) in place after this unit's reduce-scatter, or after HSDP's
        all-reduce, before they become the sharded grads (FSDP2's). A stream of its own is not taken."""
        if stream is not None:
            raise NotImplementedError("set_all_reduce_hook(stream=...): fsdp_impl runs the hook where the "
                                      "reduction finishes; leave stream unset")
        self._fsdp_unit.knobs.all_reduce_hook = hook

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward is not the step's last (microbatches of a pipeline), so its end
        leaves the gradient reductions in flight; the last backward completes them (FSDP2's)."""
        for unit in self._units():
            unit.is_last_backward = is_last_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's backward needs none of its parameters (an embedding's, say), so it is
        not gathered for backward, nor prefetched (FSDP2's)."""
        self._fsdp_unit.unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event) -> None:
        """The root's next forward waits for `event` (recorded after an optimizer step that ran on a
        stream of its own, say) before its first all-gather, once, as FSDP2's root does."""
        self._fsdp_unit.post_optim_event = event

    def _set_unshard_async_op(self, async_op):
        """Accepted, with nothing to do: fsdp_impl's gathers are asynchronous collectives already."""

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Starting its forward, this unit issues these units' all-gathers (none by default, as FSDP2's)."""
        self._fsdp_unit.forward_prefetch = [m._fsdp_unit for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Starting its backward, this unit issues these units' all-gathers. An empty list restores the
        default, the unit that runs backward next, as FSDP2's: set_backward_prefetch(False) switches it off."""
        self._fsdp_unit.backward_prefetch = [m._fsdp_unit for m in modules]

    def set_backward_prefetch(self, enabled: bool, *, recurse: bool = True) -> None:
        """fsdp_impl's own, which FSDP2 lacks: False, and no unit under this module prefetches in
        backward, whatever its list; each gathers at its own pre-backward."""
        for unit in self._units(recurse):
            unit.prefetch_in_backward = enabled


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` run as its forward does, between the unit's pre- and post-forward
    (gathered before, resharded after), as FSDP2's. A module that is not sharded is left as it is."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def as_forward(self, *args, **kwargs):
        args, kwargs = _pre_forward(self, args, kwargs)
        return _post_forward(self, args, method(*args, **kwargs))
    setattr(module, method_name, as_forward.__get__(module, type(module)))


def _not_supported(name, why):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"FSDPModule.{name}: not supported by fsdp_impl ({why})")
    refuse.__name__ = name
    return refuse


for _name, _why in {
        "set_custom_all_gather": "its collectives are its own",
        "set_custom_reduce_scatter": "its collectives are its own",
        "set_allocate_memory_from_process_group_for_comm": "buffers come from the caching allocator",
        "set_symm_mem_for_comm": "no symmetric memory",
        "set_separate_reduce_scatter_group": "one process group per mesh dim",
        "set_reduce_scatter_max_input_buffers": "one reduce-scatter in flight, by design",
        "set_reduce_scatter_unused_params": "unused parameters' grads are not reduce-scattered"}.items():
    setattr(FSDPModule, _name, _not_supported(_name, _why))


class _UnshardHandle:
    def __init__(self, unit):
        self.unit = unit

    def wait(self):
        """Finish the all-gather unshard() issued; nothing once a forward has waited for it (as FSDP2's)."""
        if self.unit is not None and self.unit.state == GATHERING:
            self.unit.wait_unshard()
        self.unit = None
