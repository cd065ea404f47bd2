"""
Schedule: the root's view of a training step, shared by all units under one root.

- The order in which units run is recorded during the first forward (pre-forward order for
  forward prefetch; post-forward order, reversed, is the backward order).
- Prefetch: when a unit starts its forward, the next unit's all-gather is issued, so it runs
  while this unit computes; in backward, the unit that runs backward next is gathered likewise.
  Explicit lists set with set_modules_to_{forward,backward}_prefetch override the recorded order.
- At most one reduce-scatter is in flight: a unit finishes the previous one before issuing its
  own, so it overlaps exactly one unit's backward and unsharded grads never pile up.
- An autograd callback at the end of backward runs the post-backward of units whose gate did
  not fire (no input that requires grad, such as the root's token ids; a unit unused in this
  step) and waits for every pending reduction, so the sharded .grads are complete when
  backward() returns.
- The buffer pool: unit-sized buffers reused across units and steps (CPU only).
- Under CPU offload, two CUDA streams that carry the shards to the GPU and the grads back, and
  the unsharded grads the copy-out stream reads, held until the compute stream waits for it.
- Gathered parameters never outlive an optimizer step, which changes the shards they copy: a
  prefetch nobody used, or a unit left unsharded, is dropped before any step (a global hook).
"""
import functools
import weakref

import torch
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .unit import GATHERING


class BufferPool:
    """Free buffers of the root's units, kept by (numel, dtype) for the next unit that needs one.

    Gathered parameters, all-gather outputs and reduce-scatter inputs of same-sized units are
    interchangeable, so a step needs only as many as are alive at once (five for the tests' GPT
    at 4 or 8 blocks), not a fresh allocation per unit and micro-step, and it keeps them from
    step to step. On CPU that matters: glibc serves such buffers from its heap and fragments
    it, or, above its mmap threshold (32 MB at most), maps each fresh one, hands it back when
    it is freed and page-faults it in again (13% of a step at 101M parameters, where a
    block is 50 MB). Kept buffers are memory the step needs again at once; the peak is in
    backward, where they are all in use. CUDA's caching allocator already does this job, so on
    CUDA buffers pass straight through.
    """
    REUSE = {"cpu": True}  # by device type (tests switch CPU's off: fsdp_worker.py's no_buffer_pool mode)

    def __init__(self, device):
        self.device = device
        self.reuse = self.REUSE.get(device.type, False)
        self.free = {}
        self.allocations = 0  # fresh buffers allocated, for tests

    def take(self, numel, dtype):
        free = self.free.get((numel, dtype))
        if free:
            return free.pop()
        self.allocations += 1
        with torch.inference_mode(False):  # pooled, so also used outside an inference-mode forward
            return torch.empty(numel, dtype=dtype, device=self.device)

    def give(self, buffer):
        if self.reuse:
            self.free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)

    def fill(self, tensor):
        """Give `tensor`'s empty storage memory: a pooled buffer's on CPU, a fresh block of the
        caching allocator's on CUDA (FSDP2's storage resize). The storage object stays the same,
        so views of it, and the tensors autograd saved from them, see the new memory. Returns
        what drain() needs back."""
        if not self.reuse:
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            return None
        buffer = self.take(tensor.numel(), tensor.dtype)
        tensor.untyped_storage()._swap_data_ptr_(buffer.untyped_storage())
        return buffer

    def drain(self, tensor, buffer):
        """Undo fill(): `tensor`'s storage is empty again; its memory goes back to the pool."""
        if buffer is None:
            tensor.untyped_storage().resize_(0)
            return
        tensor.untyped_storage()._swap_data_ptr_(buffer.untyped_storage())
        self.give(buffer)

    def clear(self):
        self.free.clear()


_schedules = weakref.WeakSet()  # every live schedule, for the optimizer-step hook
_step_hook = None


def _reshard_before_optimizer_step(optimizer, args, kwargs):
    for schedule in _schedules:
        for unit in schedule.units:
            if unit.training_state != "idle":
                continue  # mid-forward or mid-backward (an optimizer stepped in backward): still in use
            unit.reshard()  # nothing to do for a unit already sharded (the usual case)


class Schedule:
    def __init__(self, units, root):
        global _step_hook
        self.units, self.root = units, root
        self.buffers = BufferPool(root.compute_device)
        self.pre_forward_order, self.post_forward_order = [], []
        self.recording = True
        self.next_forward, self.next_backward = {}, {}
        self.pending_reductions = []
        self.read_by_copy_out = None  # (tensors, event): see hold_until_read
        self.end_of_backward_queued = False
        _schedules.add(self)
        if _step_hook is None:
            _step_hook = register_optimizer_step_pre_hook(_reshard_before_optimizer_step)

    @functools.cached_property
    def offload_streams(self):
        """CUDA streams (copy-in, copy-out) for offloaded units: the copies between CPU and GPU
        memory run beside the compute stream's kernels, so prefetch hides them."""
        return torch.cuda.Stream(), torch.cuda.Stream()

    def hold_until_read(self, tensors, event):
        """Keep `tensors`, which the copy-out stream reads until `event`, alive until the compute stream
        waits for it: at the next call (a unit later, so the wait seldom stalls) or the end of backward.
        Freed then, their memory is reused in the compute stream's order, after the read."""
        self.release_read()
        self.read_by_copy_out = (tensors, event)

    def release_read(self):
        if self.read_by_copy_out is not None:
            torch.cuda.current_stream().wait_event(self.read_by_copy_out[1])
            self.read_by_copy_out = None

    def record_pre_forward(self, unit):
        if self.recording and unit not in self.pre_forward_order:
            self.pre_forward_order.append(unit)

    def record_post_forward(self, unit):
        if not self.recording or unit in self.post_forward_order:
            return
        self.post_forward_order.append(unit)
        if len(self.post_forward_order) == len(self.pre_forward_order):  # the root's forward ended
            self.recording = False
            fwd, bwd = self.pre_forward_order, self.post_forward_order[::-1]
            self.next_forward = dict(zip(fwd, fwd[1:]))
            self.next_backward = dict(zip(bwd, bwd[1:]))

    def forward_prefetch(self, unit):
        if unit.forward_prefetch is not None:
            return unit.forward_prefetch
        return [self.next_forward[unit]] if unit in self.next_forward else []

    def backward_prefetch(self, unit):
        if unit.backward_prefetch is not None:
            return unit.backward_prefetch
        return [self.next_backward[unit]] if unit in self.next_backward else []

    def queue_end_of_backward(self):
        if not self.end_of_backward_queued:
            self.end_of_backward_queued = True
            Variable._execution_engine.queue_callback(self.end_of_backward)

    def finish_reductions(self):
        while self.pending_reductions:
            self.pending_reductions.pop(0).finish_reduction()

    def end_of_backward(self):
        for unit in self.units:
            unit.post_backward()  # no-op for units whose gate ran it already
        self.finish_reductions()
        self.release_read()
        for unit in self.units:
            unit.all_reduce_kept_sums()
            unit.wait_copy_out()  # the optimizer reads offloaded grads on the CPU, next
            unit.training_state = "idle"
            if unit.state == GATHERING:  # a prefetch nothing used (reentrant checkpointing's recompute)
                unit.reshard()
        self.end_of_backward_queued = False

    def reset(self):
        """FSDPModule.reset_iter_state(): every unit sharded and idle, nothing pending."""
        for unit in self.units:
            unit.reset()
        self.pending_reductions.clear()
        self.release_read()
        self.buffers.clear()
        self.end_of_backward_queued = False
