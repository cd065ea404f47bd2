"""
GradReduction: one unit's grads, from backward to the sharded .grads, in the order it runs
(FSDP2's foreach_reduce, _fsdp_collectives.py, which also takes its inputs as arguments):

    reduce()             each unsharded grad (a tensor parallel one's local part) plus a sum kept
        ▼                from micro-steps without sync; with sync off, kept again
    reduce-scatter       [W, S] rank-major (_chunk_cat pads each grad to its rows; dim d > 0: its
        ▼                chunks along d stacked first), issued; at most one in flight per root
    finish()             waited when the next unit issues its own, or at the end of backward
        ├── HSDP         all-reduced over replicas, waited at the end of backward; with the
        ▼                all-reduce off, kept and added to the next micro-step's sums
    into_sharded_grads() the hook, the division sums-only reductions leave, then each parameter's
                         rows become (or add to) its DTensor .grad (offloaded: in CPU memory)

With one rank and no replicas nothing is reduced: the grads are cast into place at once.
"""
import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch.distributed.tensor import DTensor

from . import comm
from .comm import ledger, on_stream, profiled


class Collective(NamedTuple):
    """A reduction in flight over `params` (flat `output`, in their order); the input is held until
    the wait, since the collective reads it. Sums kept for later have no work."""
    work: object
    input: torch.Tensor
    output: torch.Tensor
    params: list


@dataclass
class ReduceKnobs:
    """What the FSDPModule setters say about one unit's reduction."""
    requires_grad_sync: bool = True  # False: backward's grads are summed, not reduced (no_sync)
    requires_all_reduce: bool = True  # HSDP: False keeps the replica-local sums for a later micro-step
    gradient_divide_factor: Optional[float] = None  # None: average over the data-parallel ranks
    sums_only: bool = False  # set_force_sum_reduction_for_comms: SUM collectives, a division after
    all_reduce_hook: Optional[Callable] = None  # called on the reduced flat grads, in place


class ReadByCopyOut(NamedTuple):
    tensors: list
    event: object  # the copy-out stream's event after its last read of them


class Pending:
    """What a root's units share while collectives run: the reduce-scatter in flight (at most one),
    HSDP's all-reduces, the grads the copy-out stream still reads, and offload's two CUDA streams."""

    def __init__(self):
        self.reductions = []  # GradReductions whose reduce-scatter is in flight
        self.all_reduces = []  # HSDP: those whose all-reduce across replicas is in flight
        self.read_by_copy_out = None  # ReadByCopyOut: see hold_until_read

    @functools.cached_property
    def offload_streams(self):
        """CUDA streams (copy-in, copy-out) for offloaded units: the copies between CPU and GPU
        memory run beside the compute stream's kernels, so prefetch hides them."""
        return torch.cuda.Stream(), torch.cuda.Stream()

    def hold_until_read(self, tensors, event):
        """Keep `tensors`, which the copy-out stream reads until `event`, alive until the compute stream
        waits for it: a unit later (so the wait seldom stalls) or at the end of backward."""
        self.release_read()
        self.read_by_copy_out = ReadByCopyOut(tensors, event)

    def release_read(self):
        if self.read_by_copy_out is not None:
            torch.cuda.current_stream().wait_event(self.read_by_copy_out.event)
            self.read_by_copy_out = None

    def finish_reductions(self):
        while self.reductions:
            self.reductions.pop(0).finish()

    def finish_all_reduces(self):
        while self.all_reduces:
            self.all_reduces.pop(0).finish_all_reduce()

    def clear(self):
        self.reductions.clear()
        self.all_reduces.clear()
        self.release_read()


class GradReduction:
    """One unit's way from its unsharded grads to its sharded .grads. It is given what it reads:
    the unit's parameters, groups and dtypes (fixed from the first forward on), its knobs (which
    the setters change) and the root's Pending; it reads nothing else of the unit."""

    def __init__(self, name, params, shard_group, replicate_group, reduce_dtype, grad_dtype, device, knobs,
                 pending, offload=False, pin_memory=False):
        self.name, self.params, self.knobs, self.pending = name, params, knobs, pending
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.world = shard_group.size()
        self.replicas = replicate_group.size() if replicate_group is not None else 1
        self.reduce_dtype, self.grad_dtype, self.device = reduce_dtype, grad_dtype, device
        self.offload, self.pin_memory = offload, pin_memory
        self.on_other_dims = any(ps.dim for ps in params)  # some sharded on a dim other than 0
        self.in_flight = None  # Collective: the reduce-scatter, issued and not yet waited
        self.all_reduce = None  # Collective: HSDP, the all-reduce across replicas in flight
        self.kept_sums = None  # Collective without work: HSDP with the all-reduce off, replica-local sums
        self.copied_out = None  # offload: event of the grads' copy to CPU memory, while in flight
        self.holds_unreduced = False  # grads accumulated with gradient sync off, not yet reduce-scattered
        self.post_reduce_stream = None  # where the reduced grads are divided and hooked: see _reduce_scatter

    @torch.no_grad()
    def reduce(self):
        """Post-backward: reduce-scatter the unit's grads, or keep accumulating them."""
        for ps in self.params:  # a previous micro-step kept an upcast sum: add this backward's grad to it
            full = ps.unsharded
            if full.accumulated_grad is not None and full.param.grad is not None:
                full.accumulated_grad += full.local_grad()
                full.drop_grad()
        self.holds_unreduced = not self.knobs.requires_grad_sync
        if not self.knobs.requires_grad_sync:
            for ps in self.params:  # hold the running sum in reduce_dtype (FSDP2 does the same)
                full = ps.unsharded
                if full.param.grad is not None and full.param.grad.dtype != self.reduce_dtype:
                    full.accumulated_grad = full.local_grad().to(self.reduce_dtype)
                    full.drop_grad()
            return
        with_grad = [ps for ps in self.params if ps.unsharded.has_grad()]
        grads = [ps.unsharded.take_grad() for ps in with_grad]
        if len({g.dtype for g in grads}) > 1:  # float32 sums beside first grads that came in bf16 now
            grads = [g.to(self.reduce_dtype) for g in grads]
        if grads:
            self.pending.finish_reductions()  # at most one reduce-scatter in flight
            self._reduce_scatter(with_grad, grads)

    def ops(self):
        """How this unit's grads are averaged (comm.ReductionOps): FSDP2's."""
        return comm.reduction_ops(self.world, self.replicas, self.reduce_dtype, self.knobs.gradient_divide_factor,
                                  self.knobs.sums_only)

    def _reduce_scatter(self, params, grads):
        ops = self.ops()
        with profiled(f"fsdp::reduce_scatter {self.name}"):
            ledger.log("reduce_scatter", self.name)
            numel = sum(ps.padded_numel for ps in params)
            copy_out = None  # offloaded at one rank: the copy-out stream
            if self.world == 1:  # the reduction is the identity, so its input is its output (no copy)
                # offloaded (not HSDP), the copy-out stream casts the grads into memory of its own,
                # copies that to the CPU and frees it in its own order: no record_stream holds it back
                if self.offload and self.replicate_group is None:
                    copy_out = self.pending.offload_streams[1]
                    copy_out.wait_stream(torch.cuda.current_stream())
                with on_stream(copy_out):
                    rs_input = torch.empty(numel, dtype=self.reduce_dtype, device=self.device)
                    # no padding to add, so one multi-tensor copy (and cast) does it: on a GPU it is
                    # faster than CUDA's _chunk_cat kernel for large blocks, for a little more host time
                    torch._foreach_copy_(rs_input.split([ps.padded_numel for ps in params]),
                                         [grad.flatten() for grad in grads])
                if copy_out is not None:  # the grads stay alive until the copy-out stream has read them
                    self.pending.hold_until_read(list(grads), copy_out.record_event())
            else:
                if self.on_other_dims:  # a grad sharded on dim d > 0: its chunks along d as rows (FSDP2's copy)
                    grads[:] = [torch.cat(grad.chunk(self.world, ps.dim)) if ps.dim else grad
                                for ps, grad in zip(params, grads)]
                rs_input = torch.empty(self.world * numel, dtype=self.reduce_dtype, device=self.device)
                torch._chunk_cat(grads, dim=0, num_chunks=self.world, out=rs_input.view(self.world, -1))
            grads.clear()  # the unsharded gradients are freed here
            # what follows reads and writes rs_input on the stream that filled it: at one rank offloaded, the
            # copy-out stream, to the copy to the CPU (as FSDP2's foreach_reduce keeps to its reduce streams)
            self.post_reduce_stream = copy_out
            with on_stream(copy_out):
                if ops.divide_before is not None:
                    rs_input.div_(ops.divide_before)
                if self.world == 1 and self.knobs.gradient_divide_factor is not None:  # (FSDP2's, whatever the ops)
                    rs_input.div_(self.knobs.gradient_divide_factor)
            # the output, which outlives the step as the sharded grads, only now (FSDP2's order too):
            # allocated before, it was one shard more at the peak, beside the unsharded grads
            rs_output = rs_input.new_empty(numel) if self.world > 1 else rs_input
            work = comm.reduce_scatter(rs_output, rs_input, self.shard_group, ops.reduce_scatter)
            self.in_flight = Collective(work, rs_input, rs_output, params)
            if self.world == 1 and self.replicate_group is None:
                # nothing to reduce, here or across replicas: the sharded grads now, not a unit later
                # through the queue, whose bookkeeping costs host time on a host-bound GPU step
                self.finish()
            else:
                self.pending.reductions.append(self)

    @torch.no_grad()
    def finish(self):
        """Wait for the reduce-scatter and add its result into the sharded grads. Under HSDP, issue
        the all-reduce across replicas instead: the end of backward waits for it."""
        self.finish_all_reduce()  # (a unit reduced twice in one backward: the first one's grads first)
        work, _, output, params = self.in_flight
        self.in_flight = None
        with profiled(f"fsdp::reduce_scatter_wait {self.name}"):
            work.wait()
            ledger.log("reduce_scatter_wait", self.name)
            if self.replicate_group is None:
                self._into_sharded_grads(output, params)
                return
            if self.kept_sums is not None:
                output, params = self._add_kept_sums(output, params)
            if not self.knobs.requires_all_reduce:  # keep the replica-local sums for later
                self.kept_sums = Collective(None, None, output, params)
                return
            ledger.log("all_reduce", self.name)
            work = comm.all_reduce(output, self.replicate_group, self.ops().all_reduce)
            self.all_reduce = Collective(work, output, output, params)
            self.pending.all_reduces.append(self)

    def _add_kept_sums(self, output, params):
        """This micro-step's replica-local sums plus those kept from micro-steps without all-reduce,
        which may cover other parameters (a layer skipped in one of them) -> (sums, parameters)."""
        kept, kept_params = self.kept_sums.output, self.kept_sums.params
        self.kept_sums = None
        if kept_params == params:
            return output.add_(kept), params
        union = [ps for ps in self.params if ps in kept_params or ps in params]  # in the unit's order
        starts, offset = {}, 0
        for ps in union:
            starts[ps], offset = offset, offset + ps.padded_numel
        merged = torch.zeros(offset, dtype=output.dtype, device=output.device)
        for sums, over in ((output, params), (kept, kept_params)):  # new + kept, as add_ above
            offset = 0
            for ps in over:
                merged[starts[ps]:starts[ps] + ps.padded_numel] += sums[offset:offset + ps.padded_numel]
                offset += ps.padded_numel
        return merged, union

    @torch.no_grad()
    def finish_all_reduce(self):
        """HSDP: wait for the all-reduce across replicas; its averages become the sharded grads."""
        if self.all_reduce is None:
            return
        work, _, output, params = self.all_reduce
        self.all_reduce = None
        with profiled(f"fsdp::all_reduce_wait {self.name}"):
            work.wait()
            ledger.log("all_reduce_wait", self.name)
            self._into_sharded_grads(output, params)

    @torch.no_grad()
    def all_reduce_kept_sums(self):
        """HSDP, end of backward: sums kept with the all-reduce off, when the micro-step with it on
        did not run this unit (so no reduce-scatter brought them along)."""
        if self.kept_sums is not None and self.knobs.requires_all_reduce:
            _, _, output, params = self.kept_sums
            self.kept_sums = None
            comm.all_reduce(output, self.replicate_group, self.ops().all_reduce).wait()
            self._into_sharded_grads(output, params)

    def _into_sharded_grads(self, output, params):
        """The reduced flat `output` (over `params`), after set_all_reduce_hook's hook and the division
        sums-only reductions leave (both in place), added into the sharded grads."""
        with on_stream(self.post_reduce_stream):
            if self.knobs.all_reduce_hook is not None:
                self.knobs.all_reduce_hook(output)
            after = self.ops().divide_after
            if after is not None and after != 1:
                output.div_(after)
        if self.offload:
            output = self._copy_out(output, adding=any(ps.sharded.grad is not None for ps in params))
        else:
            output = output.to(self.grad_dtype)
        # each grad one as_strided view of the storage (not two ops), so the output must be contiguous
        assert output.is_contiguous()
        hooked = []
        offset = output.storage_offset()
        for ps in params:
            local = output.as_strided(ps.local_shape, ps.stride, offset)
            offset += ps.padded_numel
            if ps.sharded.grad is None:
                # (from_local() would add an autograd node and a new spec per parameter and step)
                ps.sharded.grad = DTensor.__new__(DTensor, local, ps.sharded._spec, requires_grad=False)
            else:
                ps.sharded.grad.to_local().add_(local)
            if ps.sharded._post_accumulate_grad_hooks:
                hooked.append(ps)
        if hooked and self.offload:
            self.wait_copy_out()  # (the hooks read the grads: an optimizer stepped in backward, say)
        for ps in hooked:  # the sharded gradient is ready: as on a plain parameter, its hooks run
            for hook in ps.sharded._post_accumulate_grad_hooks.values():
                hook(ps.sharded)

    def _copy_out(self, output, adding):
        """Offload: the reduced grads into (pinned) CPU memory; with none there to add to, on a stream of
        its own beside the backward still to come, ended by wait_copy_out() (FSDP2's too)."""
        host = torch.empty(output.numel(), dtype=self.grad_dtype, pin_memory=self.pin_memory)
        copy_out = self.pending.offload_streams[1]
        copy_out.wait_stream(torch.cuda.current_stream())
        if adding or not self.pin_memory:
            # the grads it is added to may be an earlier copy of this backward's still in flight
            # (a unit called twice): that one first, then a blocking copy, as the add reads it at once
            # (on the copy-out stream: at one rank that stream wrote `output`)
            self.wait_copy_out()
            with torch.cuda.stream(copy_out):
                return host.copy_(output)
        with torch.cuda.stream(copy_out):
            host.copy_(output, non_blocking=True)
        # freed now, not reused before the copy has read it (at one rank this stream allocated it)
        output.record_stream(copy_out)
        self.copied_out = copy_out.record_event()  # (replacing an earlier one: the stream runs in order)
        return host

    def wait_copy_out(self):
        """Block the host until the grads are in CPU memory (end of backward, reset)."""
        if self.copied_out is not None:
            self.copied_out.synchronize()
            self.copied_out = None

    def reset(self):
        """After an exception: collectives in flight complete (the peers posted them too); their
        results, kept sums and grads held for later are dropped."""
        for collective in (self.in_flight, self.all_reduce):
            if collective is not None:
                collective.work.wait()
        self.in_flight = self.all_reduce = self.kept_sums = None
        self.wait_copy_out()
        self.holds_unreduced = False
        for ps in self.params:
            if ps.unsharded is not None:
                ps.unsharded.take_grad()  # (dropped)
