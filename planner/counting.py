"""
The plan's counting: a dispatch mode that sees every storage a step allocates, resizes and frees
(Allocations), what gloo allocates beside a CPU run's collectives (GlooBuffers), and which role
each live storage plays (parameters, gradients, optimizer state, gathered, communication, ...).
"""
import bisect
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from fsdp_impl.comm import collective_bytes

from . import timing


ROLES = ("parameters", "gradients", "optimizer_state", "gathered_parameters", "communication", "activations", "other")
STATE_ROLES = ("parameters", "gradients", "optimizer_state")  # ZeRO's model states: what CPU offload moves


@dataclass(slots=True)
class LiveStorage:
    """A storage the counter holds as allocated: its bytes now (a resize changes them), the weak
    reference whose callback frees it (None for a buffer no op returns), and its number, which
    names it in the trace."""
    nbytes: int
    ref: weakref.ref | None
    number: int


class Allocations(TorchDispatchMode):
    """Every storage allocation, resize and free under it, as the allocator sees them: an op's
    output on a storage not seen before is an allocation of its bytes; a storage seen before whose
    size changed (resize_) moves the count by the difference; a storage freed (weak reference
    callback) leaves it. Views share their base's storage and cost nothing.

    `where` names the moment (phase, micro-step, module) the caller sets; the peak records it and
    the live storages then, which `roles` sorts into parameters, gradients, ..."""

    def __init__(self):
        super().__init__()
        self.live = {}  # storage id -> LiveStorage
        self.allocated = self.peak = 0
        self.where = "setup"
        self.peak_where, self.peak_live = "setup", {}
        self.after_peak = False  # a new peak not yet snapshotted (taken at the next free: cheaper)
        self.roles = None  # () -> {storage id: role} of the storages the model and optimizer hold now
        self.peak_roles = {}
        self.steady = 0  # bytes between the two steps
        self.comm = {}  # collective kind -> bytes this rank sends or receives through it
        self.bus_bytes = 0  # what this rank's link carries for them (count_collective)
        self.comm_storages = set()  # storage ids a collective read or wrote
        self.groups = set()  # names of the process groups of 2 or more ranks used: NCCL's communicators
        self._orig_resize = self._orig_rng_state = None
        self.trace = []  # (storage number, its bytes now: 0 once freed), for the caching allocator's model
        self.marks = []  # (index in the trace, where): each phase's start
        self.peak_index = 0  # the trace's length at the peak
        self.storages_seen = 0  # (the next storage's number)
        self.host_numbers = set()  # storages of the state (STATE_ROLES), which CPU offload keeps in host memory
        self.collectives = []  # (index in the trace, kind, where): each collective as the step issues it
        self.units = []  # (index in the trace, where): a block's forward or backward begins
        self.role_of = {}  # storage number -> the first role in ROLES that roles() gave it while it lived
        self.sampling = False  # roles() at every mark and block too (for the timeline), not only at peaks
        self.ops = None  # [Op] of the step being timed (timing.py), once the run asks for them
        self.backward_end = ({}, {})  # hold_moment() at the second step's clip: the end of its backward

    def __enter__(self):
        # a storage resized in place (FSDP2's and fsdp_impl's free and refill of gathered
        # parameters) goes through no op: wrap the method for the duration
        self._orig_resize = torch.UntypedStorage.resize_
        counter = self

        def resize_(storage, nbytes):
            out = counter._orig_resize(storage, nbytes)
            counter._seen(storage, new=False)
            return out
        torch.UntypedStorage.resize_ = resize_
        # the generator state activation checkpointing keeps per block is made by no op either
        self._orig_rng_state = torch.get_rng_state

        def get_rng_state():
            state = counter._orig_rng_state()
            counter._seen(state.untyped_storage())
            return state
        torch.get_rng_state = get_rng_state
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        torch.get_rng_state = self._orig_rng_state
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # DTensor's dispatch then runs its local ops and collectives under this mode
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            self._collective(func, args, out)
        elif self.ops is not None:
            self.ops.append(timing.compute_op(func, args, kwargs, out, self.where))
        inputs = None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for inner in plain_tensors(t):
                    if inner.is_meta:  # (the model's meta tensors have a size, but no memory)
                        continue
                    storage = inner.untyped_storage()
                    if storage._cdata not in self.live:  # a view of an input is no allocation,
                        if inputs is None:  # even of one made before the counting began
                            inputs = {x.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0]
                                      if isinstance(a, torch.Tensor) for x in plain_tensors(a) if not x.is_meta}
                        if storage._cdata in inputs:
                            continue
                    self._seen(storage)
        return out

    def _seen(self, storage, new=True):
        """A storage an op returned (new=True) or one resized in place (new=False: only a storage
        already known counts; a meta tensor's is not)."""
        key, nbytes = storage._cdata, storage.nbytes()
        entry = self.live.get(key)
        if entry is None:
            if new:  # (also when empty: FSDP makes its gathered buffers empty, then resizes them)
                self._allocate(key, nbytes, weakref.ref(storage, lambda _, key=key: self._freed(key)))
        elif entry.nbytes != nbytes:
            self.trace.append((entry.number, nbytes))
            self._change(nbytes - entry.nbytes)
            entry.nbytes = nbytes

    def _allocate(self, key, nbytes, ref):
        entry = self.live[key] = LiveStorage(nbytes, ref, self.storages_seen)
        self.storages_seen += 1
        self.trace.append((entry.number, nbytes))
        self._change(nbytes)

    def hold(self, nbytes):
        """A buffer no op returns (gloo's, beside a collective), counted as communication from now
        until _freed(key) with the key returned."""
        key = ("held", self.storages_seen)
        self.comm_storages.add(key)
        self._note_role(self.storages_seen, "communication")
        self._allocate(key, nbytes, None)
        return key

    def _freed(self, key):
        self.snapshot_if_at_peak()  # (while the storage still counts among the live ones)
        entry = self.live.pop(key, None)
        self.comm_storages.discard(key)
        if entry is not None:
            self.trace.append((entry.number, 0))
            self._change(-entry.nbytes)

    def _change(self, delta):
        if delta < 0:
            self.snapshot_if_at_peak()
        self.allocated += delta
        if self.allocated > self.peak:
            self.peak, self.peak_where, self.after_peak = self.allocated, self.where, True
            self.peak_index = len(self.trace)

    def snapshot_if_at_peak(self):
        """Record what is live at the peak just reached (called before the first free after it)."""
        if self.after_peak:
            self.after_peak = False
            self.peak_live = {entry.number: entry.nbytes for entry in self.live.values()}  # (by storage number)
            self.peak_roles = self.note_roles()

    def note_roles(self):
        """{storage number: role} of the live storages roles() names now, each kept in role_of too."""
        now = {self.live[k].number: role for k, role in (self.roles() if self.roles else {}).items() if k in self.live}
        for number, role in now.items():
            self._note_role(number, role)
        return now

    def _note_role(self, number, role):
        old = self.role_of.get(number)
        if old is None or ROLES.index(role) < ROLES.index(old):
            self.role_of[number] = role

    def made_of(self, live=None, named=None):
        """The peak's bytes by role (or those of `live`, {number: bytes}, whose roles() were
        `named`): as roles() named them, else by lifetime_roles."""
        live, named = (self.peak_live, self.peak_roles) if live is None else (live, named)
        by_lifetime = self.lifetime_roles()
        made_of = dict.fromkeys(ROLES, 0)
        for number, nbytes in live.items():
            made_of[named.get(number) or by_lifetime[number]] += nbytes
        return made_of

    def hold_moment(self):
        """What is live now and the roles roles() names, for made_of later (a fixed moment's breakdown)."""
        return {entry.number: entry.nbytes for entry in self.live.values()}, self.note_roles()

    def lifetime_roles(self):
        """{storage number: role} by lifetime, for the storages no role names: a gradient if a
        backward made it and it outlived that backward (grads kept for accumulation, reduced ones on
        their way), an activation if forward made it or it died within its backward, else other."""
        born, died, marks = {}, {}, [index for index, _ in self.marks]
        for index, (number, nbytes) in enumerate(self.trace):
            born.setdefault(number, index)
            if nbytes == 0 and number not in died:
                died[number] = index
        roles = {}
        for number, first in born.items():
            phase = bisect.bisect_right(marks, first) - 1
            where = self.marks[phase][1] if phase >= 0 else "setup"
            end = marks[phase + 1] if phase + 1 < len(marks) else len(self.trace)
            roles[number] = ("activations" if " forward " in where or died.get(number, len(self.trace)) < end else
                             "gradients") if " forward " in where or " backward " in where else "other"
        return roles

    def timeline(self, exclude=(), points=3000):
        """The run's allocated bytes after each event of the trace, stacked by role (role_of, else
        lifetime_roles), at most `points` of them: in each stretch of events the one with the most
        bytes, so the peak is one. Storages in `exclude` (offload's host side) are left out."""
        role = self.lifetime_roles() | self.role_of
        slot = {r: i for i, r in enumerate(ROLES)}
        sizes, stack, rows = {}, [0] * len(ROLES), []
        for index, (number, nbytes) in enumerate(self.trace):
            if number not in exclude:
                stack[slot[role[number]]] += nbytes - sizes.get(number, 0)
                sizes[number] = nbytes
            rows.append([index, *stack])
        stride = -(-len(rows) // points) if rows else 1
        rows = [max(rows[i:i + stride], key=lambda r: sum(r[1:])) for i in range(0, len(rows), stride)]
        where_units = [index for index, _ in self.units]

        def unit_at(index):
            at = bisect.bisect_right(where_units, index) - 1
            return self.units[at][1] if at >= 0 else ""
        gathered = {n for n, r in self.role_of.items() if r == "gathered_parameters"}
        frees = [[index, unit_at(index)] for index, (number, nbytes) in enumerate(self.trace)
                 if nbytes == 0 and number in gathered]
        return {"roles": list(ROLES), "events": len(self.trace), "stacked": rows,
                "marks": [list(m) for m in self.marks], "units": [list(u) for u in self.units],
                "collectives": [list(c) for c in self.collectives], "gathered_freed": frees}

    def _collective(self, func, args, out):
        """Bytes through each collective: the larger of its input and output, what a rank sends or
        receives (nccl-tests' size). And the storages it touched, which count as communication buffers."""
        tensors = [t for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor)]
        name = func.__name__.split(".")[0].strip("_")
        group = next((a for a in args if isinstance(a, torch.ScriptObject)
                      and a._type().qualified_name().endswith("ProcessGroup")), None)
        named = args and isinstance(args[-1], str)  # a functional collective names its group last
        if not tensors or (group is None and not named):  # (wait_tensor, _wrap_tensor_autograd: no collective)
            return
        kind = ("all_gather" if "allgather" in name or "all_gather" in name else "reduce_scatter"
                if "reduce_scatter" in name else "all_reduce" if "allreduce" in name else name)
        group = (dist.distributed_c10d._resolve_process_group(args[-1]) if group is None
                 else dist.ProcessGroup.unbox(group))
        if group.size() > 1:
            self.groups.add(group.group_name)
        self.count_collective(kind, collective_bytes(tensors), group.size())
        if self.ops is not None:
            self.ops.append(timing.collective_op(kind, collective_bytes(tensors), group.size(), args, out, self.where))
        self.collectives.append((len(self.trace), kind, self.where))
        for t in tensors:
            key = t.untyped_storage()._cdata
            self.comm_storages.add(key)
            if key in self.live:
                self._note_role(self.live[key].number, "communication")

    def count_collective(self, kind, nbytes, group_size):
        """Its bytes, and its bus bytes: what each rank's link carries (nccl-tests' busbw is these
        over the time): (n-1)/n of the bytes for a gather or a reduce-scatter, twice that for an
        all-reduce, all of them for anything else."""
        self.comm[kind] = self.comm.get(kind, 0) + nbytes
        share = (group_size - 1) / group_size
        self.bus_bytes += nbytes * {"all_gather": share, "reduce_scatter": share, "all_reduce": 2 * share}.get(kind, 1)


class GlooBuffers:
    """What gloo allocates beside a CPU run's collectives (ProcessGroupGloo.cpp), counted at its
    worst. A gather's flat output, the gathered size: gloo's thread allocates it when the transfer
    starts and frees it as it ends, so it may live from the call to the wait. A reduce-scatter's copy
    of its input, on the calling thread: gloo all-reduces the copy, which lives until the caller
    drops the handle. All-reduces run in place. The process group's collectives are wrapped for the
    run (FSDP2 and fsdp_impl call them through torch.distributed's Python API)."""
    NAMES = {"all_gather_into_tensor": True, "all_gather_single": True,  # name -> freed at the wait
             "reduce_scatter_tensor": False, "reduce_scatter_single": False}

    def __init__(self, counter):
        self.counter, self.originals = counter, {}

    def __enter__(self):
        for name, at_wait in self.NAMES.items():
            if hasattr(dist, name):  # (the *_single names are torch 2.13's)
                self.originals[name] = getattr(dist, name)
                setattr(dist, name, self._with_buffer(self.originals[name], at_wait))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    def _with_buffer(self, collective, at_wait):
        counter = self.counter

        def issue(*args, **kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            work = collective(*args, **kwargs)
            group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            if (group or dist.group.WORLD).size() == 1:
                return work
            key = counter.hold(collective_bytes(tensors))  # (the gathered output, or the input it copies)
            if work is None:  # (synchronous: done before the call returned)
                counter._freed(key)
                return work
            return HeldWork(work, lambda: counter._freed(key), at_wait)
        return issue


class HeldWork(dist.distributed_c10d.Work):
    """A collective's handle that frees a buffer gloo keeps for it: at the wait, or when the caller
    drops the handle (release runs once)."""

    def __init__(self, work, release, at_wait):
        super().__init__()
        self.work, self.at_wait = work, at_wait
        self.finalizer = weakref.finalize(self, release)

    def wait(self, timeout=None):
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        if self.at_wait:
            self.finalizer()
        return done

    def is_completed(self):
        return self.work.is_completed()


def plain_tensors(t):
    """The tensors holding `t`'s memory: itself, or a wrapper's inner tensors (a DTensor's local
    tensor), whose storage the wrapper's own only mirrors in size."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    try:
        inner = [getattr(t, attr) for attr in t.__tensor_flatten__()[0]]
    except DataDependentOutputException:  # (torchao's float8 weight asks a tensor's truth: fake ones cannot say)
        inner = list(vars(t).values())  # its tensors are its attributes
    return [x for t in inner if isinstance(t, torch.Tensor) for x in plain_tensors(t)]


def storage_id(t):
    if hasattr(t, "_local_tensor"):  # a DTensor: its local tensor's storage
        t = t._local_tensor
    return t.untyped_storage()._cdata


def roles(model, optimizer, comm_storages):
    """Storage id -> role, for the storages the model and optimizer hold now. A parameter registered
    in a module but not held by the optimizer is a gathered (unsharded) one."""
    role = {}
    held = {p for group in optimizer.param_groups for p in group["params"]}
    for p in held:
        role.setdefault(storage_id(p), "parameters")
        if p.grad is not None:
            role.setdefault(storage_id(p.grad), "gradients")
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                role.setdefault(storage_id(v), "optimizer_state")
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and p not in held:
                role.setdefault(storage_id(p), "gathered_parameters")
                if p.grad is not None:
                    role.setdefault(storage_id(p.grad), "gradients")
    for bucket, _ in getattr(model, "_planned_ddp_buckets", ()):  # DDP's buckets: copies its all-reduce reads
        role.setdefault(storage_id(bucket), "communication")
    for key in comm_storages:
        role.setdefault(key, "communication")
    return role
