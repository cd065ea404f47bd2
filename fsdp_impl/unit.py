"""
ShardedUnit: the parameters of one fully_shard() call, which always communicate together.

Memory layout (W ranks in the shard group, rank r):

    flat_shard   [S]        this rank's chunk of every parameter (along dim 0, padded to
                            ceil(dim0/W) rows, or along the dim shard_placement_fn asks for),
                            back to back. Sharded parameters (DTensor, Shard(dim)) are views
                            into it, so the optimizer updates it in place and it is the all-gather
                            input with no copy (in fp32; one cast with mixed precision). Of a
                            unit with parameters of several dtypes (LoRA's), it holds bytes.
    all-gather   [W, S]     rank-major, as the collective writes it; copied out once into
    flat_full    [W * S]    parameter-major: parameter i's full (padded) tensor is contiguous, and
                            the unsharded parameters used by forward/backward are views into it.
                            (One sharded on dim d > 0 arrives as its chunks stacked on dim 0:
                            copied out into a temporary and concatenated along d, as in FSDP2.)
                            Its storage is resized to hold memory while the unit is unsharded
                            and to none otherwise (the views, and the tensors autograd saved,
                            stay valid and come back to life when it is refilled).

With one rank the shard already has the full layout: the all-gather is a copy straight into
flat_full and the reduce-scatter is the identity (its input becomes the sharded .grads).
Resharded after forward to groups of G consecutive ranks (reshard_after_forward=G, FSDP2's int
form), rank r keeps piece r % G of each parameter's padded full tensor in flat_full (and of each
alignment gap: `_group_shard`), and the next all-gather gathers those over its group into place.

Gradients go the other way (reduce.py): unsharded grads -> [W, S] -> one reduce-scatter (AVG) ->
[S], whose pieces become the sharded DTensor .grads. The layout and the collectives are exactly
FSDP2's, so with the same arithmetic the numbers are the same bits. A parameter's two forms are
in param.py.

Two state machines. Where the parameters are (`state`): SHARDED -> GATHERING (all-gather in
flight) -> UNSHARDED -> SHARDED. Where the unit is in a step (`training_state`): IDLE -> FORWARD
(pre-forward to post-forward) -> IDLE -> PRE_BACKWARD (its outputs' first grad to its
post-backward) -> IDLE. A forward not all of whose modules ran stays FORWARD until the end of
backward. Both are module constants, compared by name.
"""
import math
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from . import comm
from .comm import ledger, on_stream, profiled
from .param import ParamShard, UnshardedParam, local_tensor, same_storage
from .reduce import GradReduction

SHARDED, GATHERING, UNSHARDED = "sharded", "gathering", "unsharded"  # where the parameters are: `state`
IDLE, FORWARD, PRE_BACKWARD = "idle", "forward", "pre_backward"  # where the unit is in a step: `training_state`


class Gather(NamedTuple):
    """An all-gather in flight; its input is held until the wait, since the collective reads it."""
    work: object
    output: torch.Tensor
    input: torch.Tensor
    copied_in: object  # offload: the copy-in stream's event after the shard's copy, else None
    in_group: bool  # from `_group_shard`, over the smaller group (rank-major over it)


def typed_view(flat, start, numel, dtype):
    """`numel` elements of `dtype` from element `start` of a flat buffer: flat's own elements, or,
    for a parameter of another dtype in a byte buffer, its bytes viewed as that dtype."""
    if flat.dtype == dtype:
        return flat[start:start + numel]
    return flat[start:start + numel * dtype.itemsize].view(dtype)


def reshard_after_forward_flag(value, world):
    """FSDP2's reshard_after_forward over `world` ranks -> (True, False or None (decided at lazy init),
    the size of the smaller group to reshard to after forward, or None). Its ints are group sizes
    that divide `world`: 1 means False, `world` True."""
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
        self.requires_grad_sync = True
        self.reshard_after_backward = True
        self.requires_all_reduce = True
        self.gradient_divide_factor = None  # None: average over the data-parallel ranks
        self.sums_only = False  # set_force_sum_reduction_for_comms: SUM collectives, a division after
        self.all_reduce_hook = None  # called on the reduced flat grads, in place
        self.is_last_backward = True  # the root's: False leaves the reductions in flight at the end of backward
        self.unshard_in_backward = True  # False: backward needs none of its parameters (an embedding's)
        self.forward_prefetch = None  # None: the next unit in forward order; [] switches it off
        self.backward_prefetch = None
        # per-step state
        self.state = SHARDED
        self.schedule = None
        self.training_state = IDLE
        self.modules_to_run = set()  # of a forward under way: a grouped unit's ends once all of them ran
        self.needs_post_backward = False  # a forward with grad ran: its backward will bring grads
        self._gather = None  # Gather, while GATHERING
        self._group_shard = None  # after forward with post_forward_size: this rank's piece over that group
        self.grads = GradReduction(self)  # the gradients' way to the sharded .grads
        self._phase_range = None  # profiler range of this unit's forward or backward, while open
        self._shard()
        self._move_buffers()
        if self.post_forward_size:
            self._init_post_forward_group()

    # ---- construction --------------------------------------------------------------------
    def _managed_params(self):
        """Parameters under our modules not already owned by a nested unit, with every registration.

        In FSDP2's order (children before a module's own parameters): gloo's reduction order
        depends on an element's position in the buffer, so the same layout gives the same bits.
        """
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
        self.params = []
        for p, regs in found.items():
            if p.dim() == 0:
                raise ValueError(f"fully_shard({self.name}): 0-dim parameter {regs[0][1]} is not supported")
            if not local_tensor(p).is_contiguous():  # (FSDP2 refuses them too)
                raise NotImplementedError(f"fully_shard({self.name}): {regs[0][1]} is not contiguous (channels_last, "
                                          "say): sharding would lose its memory format; make it contiguous first")
            dim = self._shard_dim(p, regs[0][1])
            self.params.append(ParamShard(regs, p, self.world, self.rank, *self._sharded_placement(p, dim), dim))
        self.on_other_dims = any(ps.dim for ps in self.params)  # some sharded on a dim other than 0
        self._lay_out([p.dtype for p in found])
        on_meta = any(p.is_meta for p in found)
        self.flat_shard = self._new_flat_shard(torch.device("meta") if on_meta else self.compute_device)
        for ps, p in zip(self.params, found):
            if not on_meta:
                self._local_view(ps).copy_(ps.chunk_of(local_tensor(p).detach()))
            ps.sharded = nn.Parameter(ps.as_sharded(self._local_view(ps)), requires_grad=p.requires_grad)
        self._register(unsharded=False)

    def _lay_out(self, dtypes):
        """Each parameter's place in flat_shard (`offset`, `slot`: in flat_shard's elements). One dtype:
        its elements, back to back. Several (a frozen bf16 base beside fp32 adapters, as in LoRA):
        bytes, each place starting 16-byte aligned, so that it views as its own dtype."""
        self.mixed = mixed = len(set(dtypes)) > 1
        self.dtype = torch.uint8 if mixed else dtypes[0] if dtypes else torch.float32
        offset = 0
        for ps, dtype in zip(self.params, dtypes):
            ps.dtype, ps.offset = dtype, -(-offset // 16) * 16 if mixed else offset
            ps.slot = ps.padded_numel * dtype.itemsize if mixed else ps.padded_numel
            offset = ps.offset + ps.slot
        self.shard_numel = offset

    def _shard_dim(self, param, name):
        """The dim shard_placement_fn asks for (Shard(dim) or None: 0), negative ones counted from the
        end; of a tensor parallel parameter, a dim of its tp-local tensor (FSDP2's). As FSDP2, a dim
        other than 0 must split evenly over the shard group."""
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
        """(mesh, placements) of a parameter's sharded DTensor. A tensor parallel parameter's mesh is
        the dp mesh's dims then the tp mesh's; its dp dim shards the tp-local tensor along `dim`, which
        DTensor spells _StridedShard when tp shards that dim too (FSDP2's spec, so state dicts agree)."""
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
        if self.offload and device.type != "meta":
            flat = torch.zeros(self.shard_numel, dtype=self.dtype, device="cpu")
            return flat.pin_memory() if self.pin_memory else flat
        return torch.zeros(self.shard_numel, dtype=self.dtype, device=device)

    def _local_view(self, ps, flat=None):
        flat = self.flat_shard if flat is None else flat
        return typed_view(flat, ps.offset, ps.local_numel, ps.dtype).view(ps.local_shape)

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
        self.flat_full = torch.empty(self.world * self.gather_numel, dtype=self.gather_dtype,
                                     device=self.compute_device)
        for ps in self.params:
            view = typed_view(self.flat_full, ps.gather_offset * self.world, math.prod(ps.shape), ps.gather_dtype)
            ps.unsharded = UnshardedParam(view.view(ps.shape), ps)
        # each parameter's padded full tensor as [W, its slot], and the alignment gaps of a byte buffer
        # between them: where the copy out of the rank-major all-gather output puts its pieces
        self._slots, self._full_slots, cursor = [], [], 0
        self._cat_slots = []  # (index in _slots, parameter) of those sharded on dim > 0
        for ps in self.params:
            gap = ((cursor, ps.gather_offset - cursor),) if ps.gather_offset > cursor else ()
            for start, size in gap + ((ps.gather_offset, ps.gather_slot),):
                self._slots.append(size)
                full = self.flat_full[start * self.world:(start + size) * self.world]
                self._full_slots.append(full.view(self.world, -1))
            if ps.dim:
                self._cat_slots.append((len(self._slots) - 1, ps))
            cursor = ps.gather_offset + ps.gather_slot
        if self.post_forward_size:  # each of them cut in that many pieces: a rank keeps one after forward
            self._group_slots = [slot * self.world // self.post_forward_size for slot in self._slots]
            self._group_full_slots = [full.view(self.post_forward_size, -1) for full in self._full_slots]
        self._full_bytes = self.flat_full.untyped_storage().nbytes()
        self.flat_full.untyped_storage().resize_(0)
        self._sync_requires_grad()

    def _init_dtypes(self):
        """The dtypes of the all-gather, of compute and of the reductions, as FSDP2 picks them.

        Each parameter is gathered in param_dtype if it is floating point, else its own. One gather
        dtype over a flat shard of several (LoRA's, with mixed precision): the gather packs their
        casts into a buffer of its own (`repack`). Several: the gather moves flat_shard's bytes."""
        for ps in self.params:
            floating = self.mp.param_dtype is not None and ps.dtype.is_floating_point
            ps.gather_dtype = self.mp.param_dtype if floating else ps.dtype
        gather_dtypes = {ps.gather_dtype for ps in self.params}
        self.repack = self.mixed and len(gather_dtypes) == 1
        self.gather_dtype = gather_dtypes.pop() if len(gather_dtypes) == 1 else torch.uint8
        self.gather_numel = 0
        for ps in self.params:
            ps.gather_offset, ps.gather_slot = ((self.gather_numel, ps.padded_numel) if self.repack
                                                else (ps.offset, ps.slot))
            self.gather_numel = ps.gather_offset + ps.gather_slot
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
        if not self.params or all(same_storage(ps.sharded.to_local(), self.flat_shard) for ps in self.params):
            return
        if any(ps.sharded.is_meta for ps in self.params):
            return  # a load into a meta model under way: the hook of its last module adopts them all
        self._lay_out([ps.sharded.dtype for ps in self.params])  # module.to(dtype) may change it
        flat = self._new_flat_shard(self.params[0].sharded.device)
        for ps in self.params:
            local = self._local_view(ps, flat)
            local.copy_(ps.sharded.to_local())
            fresh = nn.Parameter(ps.as_sharded(local), requires_grad=ps.sharded.requires_grad)
            torch.utils.swap_tensors(ps.sharded, fresh)  # keeps the object the optimizer holds
        self.flat_shard = flat

    def adopt_assigned_params(self):
        """After load_state_dict(assign=True), or a parameter assigned before the first forward, the
        modules hold new parameter objects, which an optimizer built afterwards will update: make
        those ours, viewing a flat shard."""
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
        if self.state != SHARDED:
            return
        if not self.params:  # no parameters of its own (all in nested units): nothing to gather, as in FSDP2
            self.state = UNSHARDED
            return
        copy_in = self.schedule.offload_streams[0] if self.offload else None
        if copy_in is not None:
            # the memory it fills was last read by kernels queued on the compute stream
            copy_in.wait_stream(torch.cuda.current_stream())
        # (no torch.no_grad(): nothing here requires grad, neither the flat shard nor flat_full, so
        # nothing records a graph; the switch would cost host time twice per unit and step)
        with profiled(f"fsdp::all_gather {self.name}"), on_stream(copy_in):
            shard, group = self.flat_shard, self.shard_group
            if self._group_shard is not None:  # resharded to the smaller group after forward: gathered there
                shard, group, self._group_shard = self._group_shard, self.post_forward_group, None
            elif self.repack:  # each parameter's shard cast into its place (the padding is never read)
                shard = torch.empty(self.gather_numel, dtype=self.gather_dtype, device=self.compute_device)
                torch._foreach_copy_([shard[ps.gather_offset:ps.gather_offset + ps.local_numel] for ps in self.params],
                                     [ps.sharded._local_tensor.view(-1) for ps in self.params], non_blocking=True)
            elif self.world > 1 and (shard.dtype != self.gather_dtype or shard.device != self.compute_device):
                shard = shard.to(self.compute_device, self.gather_dtype, non_blocking=True)
            ledger.log("all_gather" if group is self.shard_group else "all_gather_in_smaller_group", self.name)
            if self.world == 1:
                # one rank: the shard already has the full layout, so the "all-gather" copies
                # (and casts) it straight into the unsharded parameters, with no copy-out
                self._fill_flat_full()
                output = self.flat_full
            else:
                output = torch.empty(self.world * self.gather_numel, dtype=self.gather_dtype,
                                     device=self.compute_device)
            # writing into the unsharded parameters bumps their version counter; autograd saved
            # these same tensors in forward and must not see that as an in-place change (the
            # copy-out below is guarded the same way)
            with torch.autograd._unsafe_preserve_version_counter(self.flat_full):
                work = comm.all_gather(output, shard, group)
            self._gather = Gather(work, output, shard, copy_in.record_event() if copy_in is not None else None,
                                  group is not self.shard_group)
        self.state = GATHERING

    def wait_unshard(self):
        if self.state == SHARDED:
            self.unshard()
        if self.state == GATHERING:
            self._finish_gather()

    def _finish_gather(self):
        work, output, _, copied_in, in_group = self._gather
        with profiled(f"fsdp::all_gather_wait {self.name}"):  # (no graph to keep from, as in unshard)
            work.wait()  # (if it raises, the gather stays pending: a later wait raises the same error)
            if copied_in is not None:
                torch.cuda.current_stream().wait_event(copied_in)
            self._gather = None
            ledger.log("all_gather_wait", self.name)
            if in_group:  # rank-major over the group: each piece into its place
                self._fill_flat_full()
                with torch.autograd._unsafe_preserve_version_counter(self.flat_full):
                    torch.split_with_sizes_copy(output.view(self.post_forward_group.size(), -1), self._group_slots,
                                                dim=1, out=self._group_full_slots)
            elif output is not self.flat_full:  # copy out of the rank-major all-gather buffer
                self._fill_flat_full()
                # a parameter sharded on dim d > 0 arrives as its chunks, one per rank: into a temporary,
                # then concatenated along d into its place
                out = self._full_slots
                if self._cat_slots:
                    out = list(out)
                    for i, _ in self._cat_slots:
                        out[i] = torch.empty_like(out[i])
                with torch.autograd._unsafe_preserve_version_counter(self.flat_full):
                    torch.split_with_sizes_copy(output.view(self.world, self.gather_numel), self._slots,
                                                dim=1, out=out)
                    for i, ps in self._cat_slots:
                        chunks = out[i].view(ps.gather_dtype).view(self.world, *ps.local_shape).unbind()
                        torch.cat(chunks, dim=ps.dim, out=self._full_slots[i].view(ps.gather_dtype).view(ps.shape))
        self._register(unsharded=True)
        self.state = UNSHARDED

    def _fill_flat_full(self):
        """Give flat_full's storage memory again (FSDP2's storage resize): the storage object stays
        the same, so the parameters viewing it, and the tensors autograd saved, see the new memory."""
        self.flat_full.untyped_storage().resize_(self._full_bytes)

    def _register(self, unsharded):
        """Put the unsharded parameters, or the sharded ones, where the modules look them up (every
        registration of a tied one). Into `_parameters` directly: nn.Module.__setattr__'s checks
        cost more than the rest of a unit's swap."""
        for ps in self.params:
            param = ps.unsharded.param if unsharded else ps.sharded
            for module, name in ps.registrations:
                module._parameters[name] = param

    def reshard(self, to_group=False):
        """Free the unsharded parameters; the module holds its sharded DTensors again. to_group (after
        forward, with post_forward_size): this rank keeps its piece of them over the smaller group, which
        the next all-gather gathers from; any other reshard drops it (FSDP2's states too)."""
        if self.state == GATHERING:
            self._finish_gather()
        self._group_shard = (torch.cat([full[self.post_forward_rank] for full in self._group_full_slots])
                             if to_group and self.state == UNSHARDED and self.params else None)
        if self.state != UNSHARDED:
            return
        self._sync_requires_grad()  # a freeze of the unsharded parameters outlives them
        self._register(unsharded=False)
        self.flat_full.untyped_storage().resize_(0)
        ledger.log("free", self.name)
        self.state = SHARDED

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
        """Gather for forward. True if this forward will need its own post-backward (api.py then
        gates its inputs): the unit's first module starts, or a recomputation runs after the
        unit's post-backward (reentrant checkpointing, several forwards before one backward)."""
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
        self.schedule.record_pre_forward(self)
        self.wait_unshard()
        for unit in self.schedule.forward_prefetch(self):
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
        """requires_grad_() may be called on either parameter object: the sharded one (registered
        between steps, held by the optimizer) or the unsharded one (registered while the unit is
        gathered, as the root is after a no_grad forward). The one that changed since the last
        look sets both."""
        for ps in self.params:
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
        self.schedule.record_post_forward(self)
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
        self.schedule.queue_end_of_backward()
        if self.unshard_in_backward:
            self.wait_unshard()
        for unit in self.schedule.backward_prefetch(self):
            if unit.unshard_in_backward:
                unit.unshard()
        ledger.log("backward", self.name)
        self._phase_range = comm.begin_range(f"fsdp::backward {self.name}")

    def _end_phase_range(self):
        comm.end_range(self._phase_range)
        self._phase_range = None

    def post_backward(self, end_of_backward=False):
        """A forward's backward is over (its inputs' grads are computed: api.py's gate), or the whole
        backward is (the end-of-backward callback, which calls every unit): reshard, then hand the
        grads to the reduction (reduce.py). A forward that never ended (not every module of the unit
        ran, and the root's forward did not end it) may still bring grads from its other calls: the
        end of backward reduces them, as FSDP2's."""
        if self.training_state == FORWARD and not end_of_backward:
            return
        if not (self.needs_post_backward or (self.requires_grad_sync and self.grads.holds_unreduced)):
            return
        self.needs_post_backward = False
        ledger.log("backward_end", self.name)
        self._end_phase_range()
        if self.reshard_after_backward:
            self.reshard()  # (the unsharded grads are tensors of their own: they stay)
        self.grads.reduce()
