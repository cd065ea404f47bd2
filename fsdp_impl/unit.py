"""
ShardedUnit: the parameters of one fully_shard() call, which always communicate together. It holds
the mesh, the FSDPModule knobs, the two flat buffers (their layout: layout.py) and two state
machines, ShardedState and TrainingState, as FSDP2's param group (_fsdp_param_group.py).
flat_full's storage holds memory while the unit is unsharded and none otherwise: the parameters
viewing it, and the tensors autograd saved, come back to life when it is refilled.
"""
from enum import StrEnum
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from . import comm
from .comm import ledger, on_stream, profiled
from .extension import ExtensionParam, has_extension
from .layout import Layout
from .param import ParamShard, UnshardedParam, local_tensor, same_storage
from .reduce import GradReduction, ReduceKnobs


class ShardedState(StrEnum):
    """Where a unit's parameters are (`state`)."""
    SHARDED = "sharded"  # each rank holds its shard in flat_shard; the modules hold the sharded DTensors
    SHARDED_POST_FORWARD = "sharded_post_forward"  # resharded to a smaller group: this rank keeps its piece there
    GATHERING = "gathering"  # the all-gather is in flight; wait_unshard() copies its output into flat_full
    UNSHARDED = "unsharded"  # flat_full holds the full parameters; the modules hold views into it


class TrainingState(StrEnum):
    """Where a unit is in a step (`training_state`). A forward not all of whose modules ran stays
    FORWARD until the end of backward."""
    IDLE = "idle"  # between a forward and its backward, and between steps
    FORWARD = "forward"  # from its pre-forward to its post-forward
    PRE_BACKWARD = "pre_backward"  # from its outputs' first grad to its post-backward


SHARDED, SHARDED_POST_FORWARD, GATHERING, UNSHARDED = ShardedState
IDLE, FORWARD, PRE_BACKWARD = TrainingState


class Gather(NamedTuple):
    """An all-gather in flight; its input is held until the wait, since the collective reads it."""
    work: object
    output: torch.Tensor
    input: torch.Tensor
    copied_in: object  # offload: the copy-in stream's event after the shard's copy, else None
    in_group: bool  # from `_group_shard`, over the smaller group (rank-major over it)
    extension_split: tuple = None  # with extension inputs: (their dtypes per parameter, the output's dtype)


def reshard_after_forward_flag(value, world):
    """FSDP2's reshard_after_forward -> (True, False or None: decided at lazy init; the smaller group
    size to reshard to, or None). An int divides `world`: 1 means False, `world` True."""
    if value is None or isinstance(value, bool):
        return value, None
    if not isinstance(value, int) or not 0 < value <= world or world % value:  # (FSDP2's exception type)
        raise ValueError(f"reshard_after_forward={value!r} over {world} ranks: use a bool, None or a factor of {world}")
    return value > 1, value if 1 < value < world else None


class ShardedUnit:
    def __init__(self, modules, mesh, reshard_after_forward, mp_policy, offload_policy, ignored_params=(),
                 shard_placement_fn=None):
        self.modules = modules  # usually one; several consecutive blocks for size-based wrapping
        self.ignored_params = set(ignored_params)  # left as they are: not sharded, their grads not reduced
        self.shard_placement_fn = shard_placement_fn  # the dim each parameter is sharded on (None: 0)
        self.name = type(modules[0]).__name__  # the root renames units by their path at lazy init
        self.parent = None  # the unit of the next fully_shard() call that contains this one's modules
        self.mesh = mesh
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.placements = (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
        self.world = self.shard_group.size()
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.reshard_after_forward, self.post_forward_size = reshard_after_forward_flag(reshard_after_forward,
                                                                                       self.world)
        self.mp = mp_policy
        self.offload = offload_policy is not None
        self.pin_memory = self.offload and offload_policy.pin_memory
        self.compute_device = (torch.device("cuda", torch.cuda.current_device())
                               if mesh.device_type == "cuda" else torch.device("cpu"))
        # knobs of the FSDPModule API
        self.knobs = ReduceKnobs()  # those of the reduction
        self.reshard_after_backward = True
        self.is_last_backward = True  # the root's: False leaves the reductions in flight at the end of backward
        self.unshard_in_backward = True  # False: backward needs none of its parameters (an embedding's)
        self.post_optim_event = None  # the root's: set_post_optim_event's, waited by its next forward
        # prefetch, as FSDP2's: in forward only the units listed; in backward the units listed, or
        # with no list the unit that runs backward next (an empty list means no list)
        self.forward_prefetch = []
        self.backward_prefetch = []
        self.prefetch_in_backward = True  # fsdp_impl's own switch: False prefetches nothing in backward
        # per-step state
        self.state = SHARDED
        self.schedule = None
        self.training_state = IDLE
        self.modules_to_run = set()  # of a forward under way: a grouped unit's ends once all of them ran
        self.needs_post_backward = False  # a forward with grad ran: its backward will bring grads
        self._gather = None  # Gather, while GATHERING
        self._group_shard = None  # after forward with post_forward_size: this rank's piece over that group
        self.grads = None  # GradReduction, from lazy init: the gradients' way to the sharded .grads
        self._phase_range = comm.NOTHING  # profiler range of this unit's forward or backward, while open
        self._shard()
        self._move_buffers()
        if self.post_forward_size:
            self._init_post_forward_group()

    # ---- construction --------------------------------------------------------------------
    def _managed_params(self):
        """Parameters under our modules not owned by a nested unit, with every registration, in FSDP2's
        order (children first): gloo's sums depend on an element's position, so the bits do too."""
        def post_order(module, seen):
            seen.add(module)
            for child in module.children():
                if child not in seen:
                    yield from post_order(child, seen)
            yield module

        nested = {param for module in self.modules for sub in module.modules() if hasattr(sub, "_fsdp_unit")
                  for ps in sub._fsdp_unit.params
                  for param in (ps.sharded, ps.unsharded and ps.unsharded.param)}
        found, seen = {}, set()
        for module in self.modules:
            for sub in post_order(module, seen):
                for name, p in sub._parameters.items():
                    if p is None or p in nested or p in self.ignored_params:
                        continue
                    found.setdefault(p, []).append((sub, name))
        if any(hasattr(p, "_fsdp_sharded") for p in found):  # marked below by a nested unit
            raise ValueError(f"a parameter of {self.name} is tied to one inside a nested "
                             "fully_shard unit: keep tied modules in the same unit")
        for p in found:
            p._fsdp_sharded = True
        return found

    def _shard(self):
        found = self._managed_params()
        self.params, extended = [], []
        for p, regs in found.items():
            if p.dim() == 0:
                raise ValueError(f"fully_shard({self.name}): 0-dim parameter {regs[0][1]} is not supported")
            if not local_tensor(p).is_contiguous():  # (FSDP2 refuses them too)
                raise NotImplementedError(f"fully_shard({self.name}): {regs[0][1]} is not contiguous (channels_last, "
                                          "say): sharding would lose its memory format; make it contiguous first")
            dim = self._shard_dim(p, regs[0][1])
            self.params.append(ParamShard(regs, p, self.world, self.rank, *self._sharded_placement(p, dim), dim))
            if has_extension(local_tensor(p)):
                self._check_extension(self.params[-1], regs[0][1])
                extended.append(self.params[-1])
        self.layout = Layout([ps for ps in self.params if ps not in extended], self.world, self.post_forward_size)
        on_meta = any(p.is_meta for p in found)
        self.flat_shard = self._new_flat_shard(torch.device("meta") if on_meta else self.compute_device)
        shard_mesh = self.mesh if self.mesh.ndim == 1 else self.mesh[self.mesh.mesh_dim_names[-1]]
        for ps, p in zip(self.params, found):
            if ps in extended:  # a shard of its own, of its own subclass
                ps.extension = ExtensionParam(ps, ps.chunk_of(local_tensor(p).detach()), ps.registrations[0][0],
                                              shard_mesh, self.mp, self.offload, self.pin_memory)
                local = ps.extension.local(ps)
            else:
                local = self.layout.local_view(self.flat_shard, ps)
                if not on_meta:
                    local.copy_(ps.chunk_of(local_tensor(p).detach()))
            ps.sharded = nn.Parameter(ps.as_sharded(local), requires_grad=p.requires_grad)
        self.extended = extended  # parameters with the all-gather extension (extension.py)
        self._register(unsharded=False)

    def _check_extension(self, ps, name):
        """What fsdp_impl's extension path leaves out, refused (FSDP2's type where FSDP2 refuses it too)."""
        where = f"fully_shard({self.name}): {name} has the all-gather extension (fsdp_pre_all_gather)"
        if self.post_forward_size:  # (FSDP2 refuses it at the next all-gather)
            raise NotImplementedError(f"{where}: reshard_after_forward={self.post_forward_size} is not supported "
                                      "with it; use True or False")
        if ps.tp_spec is not None or ps.dim:
            raise NotImplementedError(f"{where}: fsdp_impl shards such a parameter on dim 0 and without tensor "
                                      "parallelism only")

    def _shard_dim(self, param, name):
        """The dim shard_placement_fn asks for (None: 0; of a tensor parallel parameter, of its local
        tensor), as FSDP2's: a dim other than 0 must split evenly over the shard group."""
        placement = self.shard_placement_fn(param) if self.shard_placement_fn else None
        if placement is None:
            return 0
        where = f"fully_shard({self.name}): shard_placement_fn asks {placement} for {name} {tuple(param.shape)}"
        if not isinstance(placement, Shard):
            raise NotImplementedError(f"{where}; fsdp_impl takes Shard(dim) or None")
        dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
        if not 0 <= dim < param.dim():  # (FSDP2's exception type)
            raise AssertionError(f"{where}: no such dim")
        if dim > 0 and local_tensor(param).shape[dim] % self.world:  # (FSDP2's exception type)
            raise NotImplementedError(f"{where}: uneven sharding on dim {dim} over {self.world} ranks")
        return dim

    def _sharded_placement(self, param, dim):
        """(mesh, placements) of a parameter's sharded DTensor; of a tensor parallel one, the dp dims then
        the tp dims, _StridedShard where tp shards `dim` too (FSDP2's spec, so state dicts agree)."""
        if not isinstance(param, DTensor):
            return self.mesh, self.placements[:-1] + (Shard(dim),)
        spec = param._spec
        if self.mesh.mesh_dim_names is None or spec.mesh.mesh_dim_names is None:
            raise ValueError(f"fully_shard({self.name}): a tensor parallel parameter needs named mesh dims "
                             "(init_device_mesh(..., mesh_dim_names=...)), to name its combined mesh")
        split = spec.num_shards_map[dim]
        shard = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        return (DeviceMesh._concatenate([self.mesh, spec.mesh]),
                self.placements[:-1] + (shard,) + tuple(spec.placements))

    def _init_post_forward_group(self):
        """reshard_after_forward as a smaller group size: FSDP2's groups of that many consecutive
        ranks of the mesh, over which the first all-gather after forward runs."""
        size = self.post_forward_size
        if any(ps.tp_spec is not None or ps.dim for ps in self.params):  # (FSDP2 refuses the one, fails on the other)
            raise NotImplementedError(f"fully_shard({self.name}): reshard_after_forward={size} with a tensor "
                                      "parallel parameter or one sharded on dim > 0")
        self.post_forward_group = DeviceMesh(self.mesh.device_type, self.mesh.mesh.view(-1, size)).get_group(1)
        self.post_forward_rank = self.rank % size

    def _move_buffers(self):
        """Buffers (masks, running statistics) go where forward runs, as FSDP2 moves them; meta ones
        stay for a later to_empty()."""
        for module in self.modules:
            for sub in module.modules():
                for name, buffer in sub._buffers.items():
                    if buffer is not None and not buffer.is_meta and buffer.device != self.compute_device:
                        sub._buffers[name] = buffer.to(self.compute_device)

    def _new_flat_shard(self, device):
        """Where this rank's shards live: on the compute device, or in (pinned) CPU memory when offloaded."""
        on_host = self.offload and device.type != "meta"
        flat = torch.zeros(self.layout.shard_numel, dtype=self.layout.dtype, device="cpu" if on_host else device)
        return flat.pin_memory() if on_host and self.pin_memory else flat

    def lazy_init(self, schedule, is_root):
        """Called once by the root before the first forward, on the final device."""
        self.schedule = schedule
        if self.reshard_after_forward is None:
            # the root's parameters would be gathered again at once for backward: keep them
            self.reshard_after_forward = not is_root
        self.adopt_assigned_params()
        if any(ps.sharded.is_meta for ps in self.params):
            raise RuntimeError(f"fully_shard: parameters of {self.name} are still on the meta device at the first "
                               "forward: materialize them first (to_empty() and an init, or load_state_dict(assign=True))")
        self._init_dtypes()
        self.flat_full = torch.empty(self.world * self.layout.gather_numel, dtype=self.layout.gather_dtype,
                                     device=self.compute_device)
        for ps, view in zip(self.layout.params, self.layout.views_of(self.flat_full)):
            ps.unsharded = UnshardedParam(view, ps)
        self._full_bytes = self.flat_full.untyped_storage().nbytes()
        self.flat_full.untyped_storage().resize_(0)
        self._sync_requires_grad()
        self.grads = GradReduction(self.name, self.params, self.shard_group, self.replicate_group, self.reduce_dtype,
                                   self.grad_dtype, self.compute_device, self.knobs, schedule.pending,
                                   self.offload, self.pin_memory)

    def _init_dtypes(self):
        """The dtypes of the all-gather (Layout.lay_out_gather), of compute and of the reductions, as
        FSDP2 picks them."""
        self.layout.lay_out_gather(self.mp.param_dtype)
        trainable = {ps.dtype for ps in self.params if ps.requires_grad}
        if len(trainable) > 1:  # (FSDP2's exception type: its unit-level gradient dtype is one)
            raise AssertionError(f"fully_shard({self.name}): parameters that require grad must share a dtype, "
                                 f"got {trainable}")
        self.grad_dtype = trainable.pop() if trainable else self.params[0].dtype if self.params else torch.float32
        self.reduce_dtype = self.mp.reduce_dtype or self.mp.param_dtype or self.grad_dtype

    @torch.no_grad()  # (with grad on, the copy would record a graph back to the replaced tensors, keeping them)
    def _adopt_materialized_params(self):
        """After module.to_empty() or module.to(dtype), parameters hold fresh tensors: copy them back
        into a flat shard (of their dtype)."""
        if any(ps.sharded.is_meta for ps in self.params):
            return  # a load into a meta model under way: the hook of its last module adopts them all
        for ps in self.extended:  # padded again, as FSDP2 pads a new local tensor
            if ps.sharded._local_tensor is not ps.extension.held:
                self._swap_in(ps, ps.extension.adopt(ps, ps.sharded._local_tensor, self.offload, self.pin_memory))
        plain = self.layout.params
        if not plain or all(same_storage(ps.sharded.to_local(), self.flat_shard) for ps in plain):
            return
        self.layout.lay_out_shard([ps.sharded.dtype for ps in plain])  # module.to(dtype) may change it
        flat = self._new_flat_shard(plain[0].sharded.device)
        for ps in plain:
            local = self.layout.local_view(flat, ps)
            local.copy_(ps.sharded.to_local())
            self._swap_in(ps, local)
        self.flat_shard = flat

    @staticmethod
    def _swap_in(ps, local):
        """The sharded parameter's local tensor becomes `local`; the object the optimizer holds stays."""
        torch.utils.swap_tensors(ps.sharded, nn.Parameter(ps.as_sharded(local), requires_grad=ps.sharded.requires_grad))

    def adopt_assigned_params(self):
        """After load_state_dict(assign=True), or a parameter assigned before the first forward, the
        modules hold new parameters, which an optimizer built afterwards updates: they view a flat shard."""
        adopted = False
        for ps in self.params:
            module, name = ps.registrations[0]
            loaded = module._parameters[name]
            if loaded is ps.sharded:
                continue
            if (not isinstance(loaded, DTensor) or loaded.shape != ps.global_shape
                    or loaded.placements != ps.placements):
                raise ValueError(f"a parameter assigned in {self.name} (load_state_dict(assign=True), say): {name} "
                                 f"must be a DTensor of shape {tuple(ps.global_shape)} placed {ps.placements} (as "
                                 "in a sharded state dict)")
            ps.sharded = loaded
            adopted = True
        if adopted:
            self._register(unsharded=False)  # the other registrations of a tied parameter
        self._adopt_materialized_params()

    # ---- all-gather ----------------------------------------------------------------------
    def unshard(self):
        """Issue the all-gather (asynchronous); wait_unshard() makes the parameters usable."""
        if self.state not in (SHARDED, SHARDED_POST_FORWARD):
            return
        if not self.params:  # no parameters of its own (all in nested units): nothing to gather, as in FSDP2
            self.state = UNSHARDED
            return
        copy_in = self.grads.pending.offload_streams[0] if self.offload else None
        if copy_in is not None:
            # the memory it fills was last read by kernels queued on the compute stream
            copy_in.wait_stream(torch.cuda.current_stream())
        # (no torch.no_grad(): nothing here requires grad, and the switch costs host time per unit)
        with profiled(f"fsdp::all_gather {self.name}"), on_stream(copy_in):
            if self.state == SHARDED_POST_FORWARD:  # gathered over the smaller group it resharded to
                shard, group, self._group_shard = self._group_shard, self.post_forward_group, None
            else:
                shard, group = self.layout.gather_input(self.flat_shard, self.compute_device), self.shard_group
            split = None
            if self.extended:
                shard, split = self._with_extension_inputs(shard)
            ledger.log("all_gather" if group is self.shard_group else "all_gather_in_smaller_group", self.name)
            if self.world == 1 and not self.extended:
                # one rank: the "all-gather" copies (and casts) the shard straight into flat_full
                self._fill_flat_full()
                output = self.flat_full
            else:
                numel, dtype = (shard.numel(), shard.dtype) if split else (self.layout.gather_numel,
                                                                           self.layout.gather_dtype)
                output = torch.empty(self.world * numel, dtype=dtype, device=self.compute_device)
            # a write into the unsharded parameters bumps their version counter; autograd saved them
            # in forward and must not see an in-place change (the copy-out is guarded the same way)
            with torch.autograd._unsafe_preserve_version_counter(self.flat_full):
                work = comm.all_gather(output, shard, group)
            self._gather = Gather(work, output, shard, copy_in.record_event() if copy_in is not None else None,
                                  group is not self.shard_group, split)
        self.state = GATHERING

    def _with_extension_inputs(self, plain):
        """One all-gather input: flat_shard's (`plain`), then each hooked parameter's inputs, in one
        dtype, or all as bytes if they differ (FSDP2's rule) -> (input, (dtypes per parameter, dtype))."""
        inputs = [plain] if self.layout.params else []
        per_param = []
        for ps in self.extended:
            ours = ps.extension.inputs(ps, ps.sharded._local_tensor, self.compute_device)
            per_param.append([t.dtype for t in ours])
            inputs += ours
        dtypes = {t.dtype for t in inputs}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
        if dtype == torch.uint8:
            inputs = [t.view(torch.uint8) for t in inputs]
        sizes = [t.numel() for t in inputs]
        shard = torch.empty(sum(sizes), dtype=dtype, device=self.compute_device)
        torch._foreach_copy_(shard.split(sizes), inputs)
        return shard, (per_param, dtype)

    def wait_unshard(self):
        self.unshard()  # (nothing to do unless sharded)
        if self.state == GATHERING:
            self._finish_gather()

    def _finish_gather(self):
        work, output, _, copied_in, in_group, split = self._gather
        with profiled(f"fsdp::all_gather_wait {self.name}"):  # (no graph to keep from, as in unshard)
            work.wait()  # (if it raises, the gather stays pending: a later wait raises the same error)
            if copied_in is not None:
                torch.cuda.current_stream().wait_event(copied_in)
            self._gather = None
            ledger.log("all_gather_wait", self.name)
            if output is not self.flat_full:  # (one rank gathers into flat_full itself)
                self._fill_flat_full()
                sizes, outs = self._extension_outputs(*split) if split else ((), ())
                with torch.autograd._unsafe_preserve_version_counter((self.flat_full, *outs)):
                    self.layout.copy_out(output, in_group, sizes, outs)
            if split:
                self._post_all_gather()
        self._register(unsharded=True)
        self.state = UNSHARDED

    def _extension_outputs(self, per_param, dtype):
        """Where the copy-out puts the hooked parameters' gathered inputs: [W, size] each, in `dtype`."""
        outs = []
        for ps, dtypes in zip(self.extended, per_param):
            outs += ps.extension.output_views(self.world, dtypes, self.compute_device)
        if dtype == torch.uint8:
            outs = [o.view(torch.uint8) for o in outs]
        return [o.shape[1] for o in outs], outs

    def _post_all_gather(self):
        """fsdp_post_all_gather: the first gather builds each hooked parameter's unsharded form; later
        ones refill it in place (out=), as the copy-out refills flat_full."""
        for ps in self.extended:
            built = ps.extension.unsharded(ps, self.mp.param_dtype, ps.unsharded and ps.unsharded.param)
            if built is not None:
                ps.unsharded = UnshardedParam(built, ps)

    def _fill_flat_full(self):
        """Give flat_full's storage memory again (FSDP2's storage resize): the storage object stays
        the same, so the parameters viewing it, and the tensors autograd saved, see the new memory."""
        self.flat_full.untyped_storage().resize_(self._full_bytes)

    def _register(self, unsharded):
        """Register the unsharded parameters, or the sharded ones, in the modules (every registration of a
        tied one), in `_parameters` directly: nn.Module.__setattr__'s checks cost more than the swap."""
        for ps in self.params:
            param = ps.unsharded.param if unsharded else ps.sharded
            for module, name in ps.registrations:
                module._parameters[name] = param

    def reshard(self, to_group=False):
        """Free the unsharded parameters; the module holds its sharded DTensors again. to_group: this rank
        keeps its piece over the smaller group for the next gather; any other reshard drops it."""
        if self.state == GATHERING:
            self._finish_gather()
        self._group_shard = (self.layout.group_piece(self.post_forward_rank)
                             if to_group and self.state == UNSHARDED and self.params else None)
        if self.state == SHARDED_POST_FORWARD:  # (its piece dropped above)
            self.state = SHARDED
        if self.state != UNSHARDED:
            return
        self._sync_requires_grad()  # a freeze of the unsharded parameters outlives them
        self._register(unsharded=False)
        self.flat_full.untyped_storage().resize_(0)
        for ps in self.extended:
            ps.extension.free()
        ledger.log("free", self.name)
        self.state = SHARDED if self._group_shard is None else SHARDED_POST_FORWARD

    def end_backward(self, last):
        """The root's backward is over (the schedule's end-of-backward callback): idle again. With
        `last` (no other backward of this step follows) the grads are complete first."""
        if last:
            self.grads.all_reduce_kept_sums()
            self.grads.wait_copy_out()  # the optimizer reads offloaded grads on the CPU, next
        self.training_state = IDLE
        if self.state == GATHERING:  # a prefetch nothing used (reentrant checkpointing's recompute)
            self.reshard()

    def reset(self):
        """Back to SHARDED and idle after an exception in forward or backward; collectives in
        flight complete (the peers posted them too) and their gradients are dropped."""
        self.grads.reset()
        self.reshard()
        self._end_phase_range()
        self.training_state = IDLE
        self.needs_post_backward = False

    # ---- hooks' bodies (called from api.py) ----------------------------------------------
    def pre_forward(self, grad_enabled):
        """Gather for forward. True if this forward needs its own post-backward (api.py gates its inputs):
        the first module starts, or a recomputation runs after the unit's post-backward."""
        if self.training_state == PRE_BACKWARD and not self.needs_post_backward:
            self.wait_unshard()
            self.needs_post_backward = True
            self.modules_to_run = set(self.modules)
            return True
        if self.training_state != IDLE:
            # FORWARD: a later module of a grouped unit; PRE_BACKWARD: activation
            # checkpointing recomputes inside backward. Either way the unit is already gathered.
            return False
        self.training_state = FORWARD
        self.modules_to_run = set(self.modules)
        # with grad, its backward brings grads even if some of its modules never run and so its
        # post-forward never comes (a grouped unit's head called alone by a chunked loss)
        self.needs_post_backward = self.needs_post_backward or grad_enabled
        self._sync_requires_grad()
        prefetch = self.schedule.forward_started(self)
        self.wait_unshard()
        for unit in prefetch:
            unit.unshard()
        ledger.log("forward", self.name)
        self._phase_range = comm.begin_range(f"fsdp::forward {self.name}")
        return True

    def module_ran(self, module):
        """One of the unit's modules ended its forward: True once every one has, in whatever order
        they ran (as FSDP2 ends a group's forward)."""
        self.modules_to_run.discard(module)
        return not self.modules_to_run

    def _sync_requires_grad(self):
        """requires_grad_() may be called on the sharded parameter (the optimizer's) or the unsharded one
        (registered while gathered): the one that changed since the last look sets both."""
        for ps in self.params:
            if ps.unsharded is None:  # a hooked parameter before its first gather
                continue
            sharded, unsharded = ps.sharded.requires_grad, ps.unsharded.param.requires_grad
            if sharded == unsharded == ps.requires_grad:
                continue
            ps.requires_grad = sharded if sharded != ps.requires_grad else unsharded
            ps.sharded.requires_grad_(ps.requires_grad)
            ps.unsharded.param.requires_grad_(ps.requires_grad)

    def post_forward(self, grad_enabled):
        if self.training_state == PRE_BACKWARD:
            return
        ledger.log("forward_end", self.name)
        self._end_phase_range()
        self.schedule.forward_ended(self)
        if self.reshard_after_forward:
            self.reshard(to_group=self.post_forward_size is not None)
        self.training_state = IDLE
        if grad_enabled:
            self.needs_post_backward = True

    def pre_backward(self):
        if self.training_state == PRE_BACKWARD and self.needs_post_backward:
            return  # another output of the same forward
        # (after this unit's post-backward: a unit called twice in forward, and this is the other call's backward)
        self.training_state = PRE_BACKWARD
        self.needs_post_backward = True  # also when an earlier backward through this graph took the grads
        prefetch = self.schedule.backward_started(self)
        if self.unshard_in_backward:
            self.wait_unshard()
        for unit in prefetch:
            if unit.unshard_in_backward:
                unit.unshard()
        ledger.log("backward", self.name)
        self._phase_range = comm.begin_range(f"fsdp::backward {self.name}")

    def _end_phase_range(self):
        self._phase_range.__exit__(None, None, None)
        self._phase_range = comm.NOTHING

    def post_backward(self, end_of_backward=False):
        """A forward's backward is over (api.py's gate), or the whole backward is (the callback, for
        every unit): reshard, then hand the grads to the reduction. A forward that never ended (not
        every module ran) may still bring grads: the end of backward reduces them, as FSDP2's."""
        if self.training_state == FORWARD and not end_of_backward:
            return
        if not (self.needs_post_backward or (self.knobs.requires_grad_sync and self.grads.holds_unreduced)):
            return
        self.needs_post_backward = False
        ledger.log("backward_end", self.name)
        self._end_phase_range()
        if self.reshard_after_backward:
            self.reshard()  # (the unsharded grads are tensors of their own: they stay)
        self.grads.reduce()
