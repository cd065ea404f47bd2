"""
Schedule: the root's view of a training step, shared by all units under one root.

- The order in which units run is recorded during the first forward (pre-forward order for
  forward prefetch; post-forward order, reversed, is the backward order).
- Prefetch: when a unit starts its forward, the next unit's all-gather is issued, so it runs
  while this unit computes; in backward, the unit that runs backward next is gathered likewise.
  Explicit lists set with set_modules_to_{forward,backward}_prefetch override the recorded order.
- At most one reduce-scatter is in flight: a unit finishes the previous one before issuing its
  own, so it overlaps exactly one unit's backward and unsharded grads never pile up. Under HSDP
  each finished reduce-scatter issues an all-reduce across replicas, waited at the end of backward.
- An autograd callback at the end of backward runs the post-backward of units whose gate did
  not fire (no input that requires grad, such as the root's token ids; a unit unused in this
  step) and waits for every pending reduction, so the sharded .grads are complete when
  backward() returns (unless set_is_last_backward(False) says another backward follows).
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

from .unit import GATHERING, IDLE


_schedules = weakref.WeakSet()  # every live schedule, for the optimizer-step hook
_step_hook = None


def _reshard_before_optimizer_step(optimizer, args, kwargs):
    for schedule in _schedules:
        for unit in schedule.units:
            if unit.training_state != IDLE:
                continue  # mid-forward or mid-backward (an optimizer stepped in backward): still in use
            unit.reshard()  # nothing to do for a unit already sharded (the usual case)


class Schedule:
    def __init__(self, units, root):
        global _step_hook
        self.units, self.root = units, root
        self.pre_forward_order, self.post_forward_order = [], []
        self.recording = True
        self.next_forward, self.next_backward = {}, {}
        self.pending_reductions = []  # GradReductions whose reduce-scatter is in flight
        self.pending_all_reduces = []  # HSDP: those whose all-reduce across replicas is in flight
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
            self.pending_reductions.pop(0).finish()

    def end_of_backward(self):
        for unit in self.units:
            unit.post_backward(end_of_backward=True)  # no-op for units whose gate ran it already
        if not self.root.is_last_backward:  # another backward of this step follows: it finishes them
            for unit in self.units:
                unit.training_state = IDLE
                if unit.state == GATHERING:
                    unit.reshard()
            self.end_of_backward_queued = False
            return
        self.finish_reductions()
        self.release_read()
        while self.pending_all_reduces:
            self.pending_all_reduces.pop(0).finish_all_reduce()
        for unit in self.units:
            unit.grads.all_reduce_kept_sums()
            unit.grads.wait_copy_out()  # the optimizer reads offloaded grads on the CPU, next
            unit.training_state = IDLE
            if unit.state == GATHERING:  # a prefetch nothing used (reentrant checkpointing's recompute)
                unit.reshard()
        self.end_of_backward_queued = False

    def reset(self):
        """FSDPModule.reset_iter_state(): every unit sharded and idle, nothing pending."""
        for unit in self.units:
            unit.reset()
        self.pending_reductions.clear()
        self.pending_all_reduces.clear()
        self.release_read()
        self.end_of_backward_queued = False
