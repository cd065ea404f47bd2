"""
Schedule: the root's view of a training step, shared by all units under one root (FSDP2's
FSDPState and its comm context, _fsdp_state.py).

- Prefetch, as FSDP2's: a unit starting its forward issues the all-gathers of the units in its
  forward list. Starting its backward, it issues those of its backward list; an empty list means
  the unit that runs backward next, in the post-forward order the first forward recorded, reversed.
- An autograd callback at the end of backward runs the post-backward of units whose gate did not
  fire (no input requires grad, as the root's token ids; a unit unused this step) and waits for
  every reduction in flight (reduce.Pending), so the sharded .grads are complete when backward()
  returns, unless set_is_last_backward(False) says another backward follows.
- Gathered parameters never outlive an optimizer step, which changes the shards they copy: a
  global hook drops a prefetch nobody used, or a unit left unsharded, before any step.
"""
import weakref

from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .reduce import Pending
from .unit import IDLE


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
        self.next_backward = {}
        self.pending = Pending()  # the collectives in flight, shared by the units' reductions
        self.end_of_backward_queued = False
        _schedules.add(self)
        if _step_hook is None:
            _step_hook = register_optimizer_step_pre_hook(_reshard_before_optimizer_step)

    def forward_started(self, unit):
        """unit's forward starts (recorded in the first forward) -> the units to prefetch beside it."""
        if self.recording and unit not in self.pre_forward_order:
            self.pre_forward_order.append(unit)
        return unit.forward_prefetch

    def forward_ended(self, unit):
        if not self.recording or unit in self.post_forward_order:
            return
        self.post_forward_order.append(unit)
        if len(self.post_forward_order) == len(self.pre_forward_order):  # the root's forward ended
            self.recording = False
            bwd = self.post_forward_order[::-1]
            self.next_backward = dict(zip(bwd, bwd[1:]))

    def backward_started(self, unit):
        """unit's backward starts: the end of backward is queued -> the units to prefetch beside it."""
        if not self.end_of_backward_queued:
            self.end_of_backward_queued = True
            Variable._execution_engine.queue_callback(self.end_of_backward)
        if not unit.prefetch_in_backward:
            return []
        if unit.backward_prefetch:
            return unit.backward_prefetch
        return [self.next_backward[unit]] if unit in self.next_backward else []

    def end_of_backward(self):
        for unit in self.units:
            unit.post_backward(end_of_backward=True)  # no-op for units whose gate ran it already
        if self.root.is_last_backward:  # (else another backward of this step follows: it finishes them)
            self.pending.finish_reductions()
            self.pending.release_read()
            self.pending.finish_all_reduces()
        for unit in self.units:
            unit.end_backward(last=self.root.is_last_backward)
        self.end_of_backward_queued = False

    def reset(self):
        """FSDPModule.reset_iter_state(): every unit sharded and idle, nothing pending."""
        for unit in self.units:
            unit.reset()
        self.pending.clear()
        self.end_of_backward_queued = False
