"""
Will it fit? Each rank's memory for a train.py run, planned on one CPU, before anything launches.

    python plan.py config/train_gpt2.py --nproc=8,64
    python plan.py config/train_gpt2.py --dist_backend=custom_fsdp --nproc=2,4 --json=plan.json

It takes train.py's config files and --key=value settings, plus its own: --nproc (world sizes,
comma-separated), --rank (default: rank 0, whose shards are the largest), --gpu (a100, h100, h200)
or --gpu_mem_gib (whether it fits, and the largest batch that does), --busbw_gbps (the bus bandwidth
the communication time is projected at), --json (one row per backend and world size) and --png
(peak per rank against W). --dist_backend plans one backend; without it, all three.

For each backend and world size W it runs the real code: the model built on the meta device and
wrapped through backends.py as train.py wraps it, then two whole training steps of train.py's own
(training.train_step: every micro-step of this rank, clipping, the optimizer step, zero_grad), as
rank r of W in this one process. The process group is fake (collectives move nothing) and so
are the tensors (they hold no memory), but every shape, shard, padding, gathered buffer and
activation is the real one. A dispatch mode counts each storage as the allocator would:
allocated when an op makes it, resized when a storage is resized (FSDP's gathers), freed when
the last tensor on it dies.

The counts are CPU tensors', as on --device=cpu: the figures a CPU run allocates, to the byte (the
tests hold the plan to the CPU allocator's own count). Given --device=cpu, the run is over gloo,
whose buffers count too, at their worst (GlooBuffers): real runs peak at or below that plan. The GPU's reserve is CUDA's caching
allocator replayed over them and cuBLAS's workspaces; whether it fits adds the CUDA context and
NCCL's buffers, named figures (CUBLAS_WORKSPACE_BYTES and the rest) that scripts/plan_check.py
measures on a GPU. Not modelled yet: CUDA's kernels and their scratch, autocast on CUDA, several
streams. --float8=True is planned as a GPU runs it: a CPU emulates each float8 matmul with float32
copies of its operands inside the one op, which the plan leaves out. cpu_offload is planned as the run without it, less the state that offload keeps in host
memory (device_side).

Communication is counted in the same run, per collective kind; its time is a projection over a
bus bandwidth (busbw), NCCL's measured figures by default.
"""
import bisect
import os
import sys
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

import configurator
import training
from backends import BACKENDS, BackendError, DDPBackend, make_backend
from fsdp_impl.comm import collective_bytes
from model import GPT, GPTConfig

PLAN_FLAGS = {"nproc": "1,2,4,8", "rank": 0, "json": "", "png": "", "gpu": "", "gpu_mem_gib": "", "busbw_gbps": "",
              "timeline": "", "timeline_json": ""}  # plan.py's own settings, beside train.py's
PLAN_FLAG_HELP = {
    "nproc": "world sizes to plan, comma-separated",
    "rank": "the rank planned (rank 0's shards are the largest; past a world size, rank 0 there)",
    "json": "write the rows to this JSON file",
    "png": "draw the peak per rank against the world size to this PNG",
    "gpu": "a100, h100 or h200: whether each row fits, its headroom and the largest batch that does",
    "gpu_mem_gib": "the GPU's memory in GiB, in place of --gpu",
    "busbw_gbps": "the bus bandwidth the communication time is projected at (default: NCCL's on H100s by W)",
    "timeline": "draw each row's memory through the step to this PNG",
    "timeline_json": "write each row's memory through the step to this JSON file",
}
ROLES = ("parameters", "gradients", "optimizer_state", "gathered_parameters", "communication", "activations", "other")
STATE_ROLES = ("parameters", "gradients", "optimizer_state")  # ZeRO's model states: what CPU offload moves
# What a CUDA process holds beside the step's tensors: not counted, but named (sources in
# IMPLEMENTATION.md; scripts/plan_check.py measures each on a GPU). cuBLAS's workspace comes from the
# caching allocator, one per thread that multiplies: the forward's and autograd's (Hopper's size)
CUBLAS_WORKSPACES = 2
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
# outside the allocator: the CUDA context (lazy module loading), NCCL's buffers per communicator
CUDA_CONTEXT_BYTES = 500 * 2**20
NCCL_COMMUNICATOR_BYTES = 700 * 2**20
ROWS_AT_ONCE = 2  # rows planned side by side: each plan runs on one core


def print_help():
    """plan.py's own flags, then train.py's settings as a plan takes them (bfloat16 unless given)."""
    print("usage: plan.py [config files] [--key=value ...]; plan.py's own flags and their defaults:")
    for key, value in PLAN_FLAGS.items():
        print(f"  {f'--{key}={value!r}':<20} {PLAN_FLAG_HELP[key]}")
    print("train.py's settings, as plan.py plans them (--dist_backend given: that backend only, else all three):")
    for key, value in dict(training.defaults(), dtype="bfloat16").items():
        print(f"  --{key}={value!r}" if isinstance(value, str) else f"  --{key}={value}")


def split_argv(argv):
    """(plan.py's own settings, the arguments for train.py's configurator)."""
    if "-h" in argv or "--help" in argv:
        print_help()
        raise SystemExit(0)
    own, rest = dict(PLAN_FLAGS), []
    for arg in argv:
        key = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if key in PLAN_FLAGS:
            if "=" not in arg:  # (--json plan.json would read plan.json as a config file)
                configurator.fail(f"{arg} takes its value after '=': {arg}=VALUE")
            own[key] = arg.partition("=")[2]
        else:
            rest.append(arg)
    try:
        own["nproc"] = [int(w) for w in own["nproc"].split(",")]
        own["rank"] = int(own["rank"])
    except ValueError:
        configurator.fail(f"--nproc takes world sizes such as 1,8,64 and --rank an int; got {own['nproc']!r}, "
                          f"{own['rank']!r}")
    for flag, example in (("gpu_mem_gib", "the GPU's memory in GiB, such as 80"),
                          ("busbw_gbps", "a bus bandwidth in GB/s, such as 360")):
        if own[flag]:
            try:
                if float(own[flag]) <= 0:
                    raise ValueError
            except ValueError:
                configurator.fail(f"--{flag}={own[flag]}: give {example}")
    if own["rank"] < 0:
        configurator.fail(f"--rank={own['rank']} must be 0 or more (a rank past a world size plans rank 0 there)")
    if not all(1 <= w <= 1 << 20 for w in own["nproc"]):
        configurator.fail(f"--nproc={','.join(map(str, own['nproc']))}: each world size must be at least 1")
    return own, rest


# ---- counting ---------------------------------------------------------------------------------
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

    def made_of(self):
        """The peak's bytes by role: as roles() named them at the peak, else by lifetime_roles."""
        by_lifetime = self.lifetime_roles()
        made_of = dict.fromkeys(ROLES, 0)
        for number, nbytes in self.peak_live.items():
            made_of[self.peak_roles.get(number) or by_lifetime[number]] += nbytes
        return made_of

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


@dataclass(slots=True, eq=False)
class Block:
    """A block of the caching allocator's model: bytes `size` at `offset` in segment `segment`, of
    the small pool or the large one. (Compared by identity: blocks of a pool never overlap.)"""
    segment: int
    offset: int
    size: int
    small: bool


class CachingAllocatorModel:
    """CUDA's caching allocator (c10/cuda/CUDACachingAllocator.cpp, its defaults) replayed over a
    plan's allocations, on one stream: sizes rounded up to 512 bytes; requests up to 1 MiB served
    from 2 MiB segments, larger ones from 20 MiB segments below 10 MiB, else from a segment of their
    size rounded up to 2 MiB; the smallest cached free block that fits is taken and split when
    what is left is worth keeping (512 bytes in the small pool, over 1 MiB in the large); freed
    blocks merge with free neighbours of their segment; segments are never returned. A storage
    resized in place is a new block, then the old one freed (a copy)."""
    SMALL, MIN_BLOCK, SMALL_SEGMENT, LARGE_SEGMENT, MIN_LARGE, ROUND_LARGE = (
        2**20, 512, 2 * 2**20, 20 * 2**20, 10 * 2**20, 2 * 2**20)

    def __init__(self):
        self.free = {True: [], False: []}  # small pool?: its free blocks
        self.blocks = {}  # storage number -> its block
        self.allocated = self.reserved = self.peak_allocated = 0
        self.segments = 0

    def replay(self, trace):
        for number, nbytes in trace:
            old = self.blocks.pop(number, None)
            if nbytes:
                self.blocks[number] = self._malloc(nbytes)
            if old is not None:
                self._release(old)
        return self

    def _malloc(self, nbytes):
        size = max(self.MIN_BLOCK, -(-nbytes // self.MIN_BLOCK) * self.MIN_BLOCK)
        small = size <= self.SMALL
        fits = [b for b in self.free[small] if b.size >= size]
        if fits:
            block = min(fits, key=lambda b: (b.size, b.segment, b.offset))
            self.free[small].remove(block)
        else:
            segment = self.SMALL_SEGMENT if small else (
                self.LARGE_SEGMENT if size < self.MIN_LARGE else -(-size // self.ROUND_LARGE) * self.ROUND_LARGE)
            self.reserved += segment
            self.segments += 1
            block = Block(self.segments, 0, segment, small)
        rest = block.size - size
        if rest >= self.MIN_BLOCK if small else rest > self.SMALL:
            self.free[small].append(Block(block.segment, block.offset + size, rest, small))
            block = Block(block.segment, block.offset, size, small)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def _release(self, block):
        segment, offset, size, small = block.segment, block.offset, block.size, block.small
        self.allocated -= size
        pool = self.free[small]
        for other in [b for b in pool if b.segment == segment
                      and (b.offset + b.size == offset or offset + size == b.offset)]:
            pool.remove(other)
            offset, size = min(offset, other.offset), size + other.size
        pool.append(Block(segment, offset, size, small))


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
    for bucket in getattr(model, "_planned_ddp_buckets", ()):  # DDP's gradient buckets
        role.setdefault(storage_id(bucket), "gradients")
    for key in comm_storages:
        role.setdefault(key, "communication")
    return role


# ---- the step ----------------------------------------------------------------------------------
def per_rank_micro_steps(settings, world):
    """This rank's micro-steps per optimizer step; a W that does not divide the global count is
    planned with one (memory per rank depends on the micro-batch, not on how many)."""
    accum = settings["gradient_accumulation_steps"]
    return accum // world if accum % world == 0 else 1


def random_batch(settings):
    """batch(iter_num, k) of the planned run: random token ids of the batch's shape (the key is
    for train.py's data)."""
    def batch(*key):
        shape = (settings["batch_size"], settings["block_size"])
        return (torch.randint(settings["vocab_size"], shape, device=settings["device"]),
                torch.randint(settings["vocab_size"], shape, device=settings["device"]))
    return batch


@contextmanager
def fake_process_group(world, rank, backend="fake"):
    """Rank `rank` of `world` in this one process, in a group whose collectives move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def block_marks(model, counter):
    """Name the module at work: a block's forward, and its backward (when its output's grad comes).
    The hooks run before FSDP's, so what a block's hooks issue (its gather, the next one's
    prefetch) is named after it."""
    gpt = getattr(model, "module", model)

    def at_work(i):
        counter.where = f"{counter.where.split(' @ ')[0]} @ h.{i}"
        counter.units.append((len(counter.trace), counter.where))

    def left(module, args, output, i):
        if counter.sampling:  # (its gathered parameters are live until FSDP's hook that follows)
            counter.note_roles()
        if output.requires_grad:
            output.register_hook(lambda grad: at_work(i))
    for i, block in enumerate(gpt.transformer.h):
        block.register_forward_pre_hook(lambda module, args, i=i: at_work(i), prepend=True)
        block.register_forward_hook(lambda module, args, output, i=i: left(module, args, output, i), prepend=True)


def run(settings, backend_name, world, rank, fake=True, measured=nullcontext, group=None, sampling=False,
        gloo=False):
    """Build the model and take two training steps as rank `rank` of `world`, under a fake process
    group, counting storages from the model's creation on. With fake=False the tensors are real, and
    `measured()` (the tests' profiler) is entered where the counting starts. Returns the counter,
    this rank's state bytes and its micro-steps per step. `group(world, rank)`: the process group
    to run in (PyTorch's fake one by default). sampling: roles noted at every mark and block. gloo:
    a CPU run's process group, whose buffers count (GlooBuffers)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    settings = dict(settings, device="cpu")
    local_steps = per_rank_micro_steps(settings, world)
    counter = Allocations()
    counter.sampling = sampling
    with (group or fake_process_group)(world, rank):
        back = make_backend(backend_name, settings)  # (its mesh outside the fake mode: meshes read values)
        model = meta_model(settings)
        with measured(), FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext(), counter, \
                GlooBuffers(counter) if gloo else nullcontext():
            state = steps(counter, settings, back, model, local_steps, fake)
    return counter, state, local_steps


def steps(counter, settings, back, model, local_steps, fake):
    back, model, optimizer = build_with(back, model, settings, plain_ddp=fake)
    counter.roles = lambda: roles(model, optimizer, counter.comm_storages)
    block_marks(model, counter)
    state = []
    for step in range(2):
        def mark(where, step=step):
            counter.snapshot_if_at_peak()
            if counter.sampling:
                counter.note_roles()
            counter.where = f"step {step + 1} {where}"
            counter.marks.append((len(counter.trace), counter.where))
            if where == "zero_grad":  # the gradients are still there
                counter.host_numbers.update(counter.live[key].number for key, role in counter.roles().items()
                                            if role in STATE_ROLES and key in counter.live)
                if step == 1:
                    state.append(state_bytes(optimizer))
        if step == 1:
            counter.comm, counter.bus_bytes = {}, 0  # communication per step: the second step's
        training.train_step(settings, back, model, optimizer, local_steps, random_batch(settings), step,
                            dist.get_rank(), mark=mark)
        if step == 0:
            counter.steady = counter.allocated
    for bucket in getattr(model, "_planned_ddp_buckets", ()):  # DDP's reducer all-reduces each bucket once a step
        counter.count_collective("all_reduce", collective_bytes([bucket]), back.world_size)
    counter.snapshot_if_at_peak()
    counter.roles = None
    return state[0]


class Child:
    """fn(*args) in a forked child, started at once; result() returns what it returned (or raises
    what it raised). Each rank is planned in a process of its own: DTensor caches sharding results
    by mesh, and meshes of different ranks compare equal, so a second rank in one process would get
    the first rank's local shapes. Two children run side by side on two cores."""

    def __init__(self, fn, *args, **kwargs):
        import pickle
        self.read_end, write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child, which never returns (a parent gone before reading: EPIPE, exit)
            try:
                os.close(self.read_end)
                try:
                    result = (True, fn(*args, **kwargs))
                except BaseException as e:  # (SystemExit of a refusal too: the parent raises it again)
                    result = (False, e)
                with os.fdopen(write_end, "wb") as f:
                    pickle.dump(result, f)
            finally:
                os._exit(0)
        os.close(write_end)

    def result(self):
        import pickle
        with os.fdopen(self.read_end, "rb") as f:
            data = f.read()
        os.waitpid(self.pid, 0)
        ok, value = pickle.loads(data)
        if not ok:
            raise value
        return value


def in_child(fn, *args, **kwargs):
    """fn(*args) in a forked child (Child), waited for."""
    return Child(fn, *args, **kwargs).result()


# nccl-tests' bus bandwidth of large all-gathers and reduce-scatters on H100s, in GB/s (sources in
# IMPLEMENTATION.md): NVLink within one node of 8, then InfiniBand by world size, 8 GPUs and eight
# 400 Gb/s NICs per node, measured from 4 nodes to 128 (fewer nodes take the 4-node figure)
NVLINK_BUSBW = 360
INFINIBAND_BUSBW = {32: 360, 64: 345, 128: 320, 256: 300, 512: 280, 1024: 260}


def busbw(world, given=""):
    """The bus bandwidth (GB/s) the projection divides by: --busbw_gbps, or the default for W ranks."""
    if given:
        return float(given)
    if world <= 8:
        return NVLINK_BUSBW
    return INFINIBAND_BUSBW[min([w for w in INFINIBAND_BUSBW if w >= world] or [1024])]


def cuda_model(trace):
    """CUDA's caching allocator replayed over a plan's trace. cuBLAS's workspaces are made at the
    first forward and backward, and kept: the peak, in the second step, holds them, and a block
    never freed is reused by nobody, so they go first."""
    return CachingAllocatorModel().replay([(-1 - i, CUBLAS_WORKSPACE_BYTES) for i in range(CUBLAS_WORKSPACES)] + trace)


def plan(settings, backend_name, world, rank, timeline=False, gloo=False, keep_trace=False):
    """One backend at W ranks, as rank `rank`: the row plan.py reports; with timeline, its
    "timeline" too (Allocations.timeline), with keep_trace the "trace" the CUDA model replays. Under
    cpu_offload the run is planned without it, and the GPU's side is what stays after the state
    moves to host memory. gloo: a CPU run's buffers count."""
    started = time.time()
    offload = settings["cpu_offload"]
    if offload and backend_name == "ddp":  # (planned without offload below: ask train.py's refusal here)
        raise BackendError("cpu_offload and replicate_degree apply to the sharded backends only")
    counter, state, local_steps = run(dict(settings, cpu_offload=False), backend_name, world, rank, sampling=timeline,
                                      gloo=gloo)
    peak, peak_at, made_of, trace = counter.peak, counter.peak_where, counter.made_of(), counter.trace
    peak_event = counter.peak_index - 1
    if offload:
        peak, peak_at, trace, peak_event = device_side(counter)
        made_of = None  # (the breakdown is the whole run's)
    cuda = cuda_model(trace)
    extra = {"trace": trace} if keep_trace else {}
    if timeline:
        extra["timeline"] = dict(counter.timeline(exclude=counter.host_numbers if offload else ()),
                                 peak_event=peak_event)
    return extra | {"backend": backend_name, "nproc": world, "rank": rank, "micro_steps": local_steps,
            "peak_allocated_bytes": peak, "cuda_allocated_bytes": cuda.peak_allocated,
            "reserved_bytes": cuda.reserved, "peak_at": peak_at, "peak_made_of": made_of,
            "communicators": len(counter.groups),
            "outside_allocator_bytes": CUDA_CONTEXT_BYTES + NCCL_COMMUNICATOR_BYTES * len(counter.groups),
            "host_bytes": state if offload else 0,
            "steady_bytes": counter.steady, "state_bytes": state, "comm_bytes_per_step": counter.comm,
            "comm_bus_bytes_per_step": round(counter.bus_bytes),
            "seconds": round(time.time() - started, 2)}


def device_side(counter):
    """CPU offload's GPU side: the run's allocations but those of the state (the sharded parameters,
    their gradients, the optimizer state), which live in host memory -> (peak, where, its trace,
    the index in the run's trace of the event that made the peak).
    Not modelled: each gather's copy of a unit's shard to the GPU, and each reduce-scatter's output
    there until it is copied out; together at most two of the largest unit's shards."""
    live, allocated, peak, peak_index, trace = {}, 0, 0, 0, []
    for index, (number, nbytes) in enumerate(counter.trace):
        if number in counter.host_numbers:
            continue
        allocated += nbytes - live.get(number, 0)
        live[number] = nbytes
        trace.append((number, nbytes))
        if allocated > peak:
            peak, peak_index = allocated, index
    phase = bisect.bisect_right([index for index, _ in counter.marks], peak_index) - 1
    return peak, counter.marks[phase][1] if phase >= 0 else "setup", trace, peak_index


def meta_model(settings):
    """The GPT on the meta device, as train.py makes it (outside the fake mode: plain meta tensors,
    which take no memory and which to_empty() replaces)."""
    args = {k: settings[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "dropout",
                                     "activation_checkpointing")}
    with torch.device("meta"):
        return GPT(GPTConfig(**args, vocab_size=settings["vocab_size"]))


def build_with(back, model, settings, plain_ddp=False):
    """The model wrapped (sharded, materialized) through backends.py and its optimizer, as train.py
    builds them. plain_ddp: DDP's model without its C++ reducer, which reads tensor data (fake
    tensors have none); the reducer's buckets are added as bytes of their own."""
    if plain_ddp and isinstance(back, DDPBackend) and back.world_size > 1:
        back.world_size = 1  # (the plain model: what DDP wraps)
        back, model, optimizer = build_with(back, model, settings)
        ddp_buckets(model)
        back.world_size = dist.get_world_size()
        return back, model, optimizer
    model = back.wrap(model, lambda m: m.init_weights(settings["seed"]))
    optimizer = back.unwrap(model).configure_optimizers(
        settings["weight_decay"], settings["learning_rate"], (settings["beta1"], settings["beta2"]),
        back.optimizer_class)
    return back, model, optimizer


def ddp_buckets(model):
    """DDP's gradient buckets, held for the model's life: one flat tensor per bucket, in DDP's own
    assignment of the trainable parameters (their reverse order, capped as DDP caps them)."""
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20]
    buckets, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    model._planned_ddp_buckets = [torch.empty(sum(params[i].numel() for i in b), dtype=params[b[0]].dtype)
                                  for b in buckets]


def state_bytes(optimizer):
    """Bytes of this rank's parameters, gradients and optimizer state (each storage once), taken
    after the optimizer step, before zero_grad: ZeRO's model states."""
    sizes = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for t in (p, p.grad, *optimizer.state.get(p, {}).values()):
                if isinstance(t, torch.Tensor):
                    sizes[storage_id(t)] = getattr(t, "_local_tensor", t).untyped_storage().nbytes()
    return sum(sizes.values())


GPUS = {"a100": 81_920, "h100": 81_559, "h200": 143_771}  # MiB, as nvidia-smi reports the 80 GB and 141 GB parts


def gpu_bytes(own):
    """The GPU memory to fit in, from --gpu_mem_gib or --gpu (None: no question asked)."""
    if own["gpu"]:
        if own["gpu"].lower() not in GPUS:
            configurator.fail(f"unknown --gpu={own['gpu']} (choose one of {', '.join(GPUS)}, or give --gpu_mem_gib)")
        return GPUS[own["gpu"].lower()] * 2**20
    return int(float(own["gpu_mem_gib"]) * 2**30) if own["gpu_mem_gib"] else None


def second_batch(batch):
    """The other batch size a plan is made at, for the line through two."""
    return batch + 1 if batch == 1 else batch // 2


def batch_line(trace, batch, other_trace, other):
    """batch -> the plan's trace at that batch size, from its traces at two (None where they do not
    line up). The step allocates the same storages in the same order at every batch size; each
    one's bytes are a line in the batch (an activation's grow with it, the state's do not). Traces
    of other events, or bytes off a line of whole bytes, mean a path that depends on the batch."""
    if len(trace) != len(other_trace):
        return None
    events = []
    for (number, nbytes), (other_number, other_nbytes) in zip(trace, other_trace):
        slope, rest = divmod(nbytes - other_nbytes, batch - other)
        if number != other_number or rest:
            return None
        events.append((number, nbytes - slope * batch, slope))
    return lambda at: [(number, base + slope * at) for number, base, slope in events]


def largest_batch(settings, backend_name, world, rank, row, second, limit, gloo=False, line=True):
    """The largest batch_size whose modelled reserved memory fits in `limit` bytes (0: none), from
    the plans at the run's batch (`row`) and at second_batch (`second`), both with their traces.
    The two give each allocation's bytes as a line in the batch (batch_line): the reserve at any
    batch is the CUDA model over the trace on those lines, and one more plan, at the answer, checks
    them. Where the lines fail, or with line=False, each batch asked is planned.
    The search: CUDA's allocated bytes grow linearly with the batch, so the two plans give a first
    guess under that line; the reserve grows in steps above it, so reserves around the guess settle
    it, stepping by doubling strides, then halving."""
    batch, other = settings["batch_size"], second_batch(settings["batch_size"])
    if limit < 0:  # (the context and NCCL's buffers alone take more: no batch fits)
        return 0

    def planned(batch):
        return in_child(plan, dict(settings, batch_size=batch), backend_name, world, rank, gloo=gloo, keep_trace=True)
    trace_at = batch_line(row["trace"], batch, second["trace"], other) if line else None
    per_sample = (row["cuda_allocated_bytes"] - second["cuda_allocated_bytes"]) / (batch - other)
    fixed = row["cuda_allocated_bytes"] - per_sample * batch
    reserves = {0: 0, batch: row["reserved_bytes"], other: second["reserved_bytes"]}

    def fits(batch):
        if batch not in reserves:
            reserves[batch] = cuda_model(trace_at(batch)).reserved if trace_at else planned(batch)["reserved_bytes"]
        return reserves[batch] <= limit
    lo = max(int((limit - fixed) // per_sample) if per_sample > 0 else batch, 0)
    hi, stride = lo + 1, 1
    while not fits(lo):  # (lo fits, hi does not, once both loops are done)
        lo, hi, stride = max(lo - stride, 0), lo, stride * 2
    while fits(hi):
        lo, hi, stride = hi, hi + stride, stride * 2
    while hi - lo > 1:
        middle = (lo + hi) // 2
        lo, hi = (middle, hi) if fits(middle) else (lo, middle)
    if trace_at and lo not in (0, batch, other) and planned(lo)["trace"] != trace_at(lo):
        return largest_batch(settings, backend_name, world, rank, row, second, limit, gloo, line=False)
    return lo


def plan_row(settings, backend_name, world, rank, own, limit, drawn, gloo):
    """plan.py's row for one backend and W, whole: the plan (planned in a child) and what it answers,
    the communication time at the bus bandwidth and, given the GPU's memory, the headroom, whether
    it fits and the largest batch that does. -> (row, its timeline or None)."""
    asked = limit is not None  # (the GPU's memory given: the largest batch too, from a second plan beside)
    second = Child(plan, dict(settings, batch_size=second_batch(settings["batch_size"])), backend_name, world, rank,
                   gloo=gloo, keep_trace=True) if asked else None
    row = in_child(plan, settings, backend_name, world, rank, drawn, gloo, keep_trace=asked)
    timeline = None
    if drawn:
        timeline = {k: row[k] for k in ("backend", "nproc", "rank", "peak_allocated_bytes", "peak_at")} | row.pop("timeline")
    row["busbw_gbps"] = busbw(world, own["busbw_gbps"])
    row["comm_seconds_per_step"] = row["comm_bus_bytes_per_step"] / (row["busbw_gbps"] * 1e9)
    row["fits"] = row["headroom_bytes"] = row["max_batch_size"] = None  # (no GPU memory given)
    if limit is not None:  # (the context and NCCL's buffers come out of the same memory)
        room = limit - row["outside_allocator_bytes"]
        row["headroom_bytes"] = room - row["reserved_bytes"]
        row["fits"] = row["headroom_bytes"] >= 0
        row["max_batch_size"] = largest_batch(settings, backend_name, world, rank, row, second.result(), room, gloo)
    row.pop("trace", None)
    return row, timeline


def main(argv):
    own, rest = split_argv(argv)
    limit = gpu_bytes(own)
    given_backend = any(a.startswith("--dist_backend=") for a in rest)
    def given(key):  # on the command line or in a config file
        return any(a.startswith(f"--{key}=") if a.startswith("--") else key in configurator.run_file(a) for a in rest)
    settings = training.settings(rest)
    if not given("dtype"):
        settings["dtype"] = "bfloat16"  # (what train.py takes on the GPUs plans are for)
    gloo = given("device") and settings["device"] == "cpu"  # (a CPU run: its collectives go through gloo)
    settings["vocab_size"] = training.vocab_size(settings)
    compiled, settings["compile"] = settings["compile"], False  # (torch.compile's kernels: not planned)
    backends = [settings["dist_backend"]] if given_backend else list(BACKENDS)
    if settings["cpu_offload"] and not given_backend:  # (DDP does not offload: plan(ddp) refuses it)
        backends = [b for b in backends if b != "ddp"]
    rows, timelines = [], []
    drawn = bool(own["timeline"] or own["timeline_json"])
    jobs = [(backend_name, world, own["rank"] if own["rank"] < world else 0)
            for backend_name in backends for world in own["nproc"]]
    running = []  # rows planned two at a time, each in a process of its own (two cores), kept in order
    for index, (backend_name, world, rank) in enumerate(jobs):
        print(f"planning {backend_name} at W={world}, rank {rank}", file=sys.stderr, flush=True)
        running.append(Child(plan_row, settings, backend_name, world, rank, own, limit, drawn, gloo))
        while running and (len(running) == ROWS_AT_ONCE or index == len(jobs) - 1):
            try:
                row, timeline = running.pop(0).result()
            except BackendError as e:
                configurator.fail(str(e))
            rows.append(row)
            if drawn:
                timelines.append(timeline)
    print(table(rows, settings, limit, gloo))
    if compiled:
        print("compile=True is planned as eager: the compiled kernels' own buffers are not counted.")
    if own["json"]:
        import json
        with open(own["json"], "w") as f:
            json.dump(rows, f, indent=1)
    if own["png"]:
        draw(rows, settings, own["png"])
    if own["timeline_json"]:
        import json
        with open(own["timeline_json"], "w") as f:
            json.dump(timelines, f)
    if own["timeline"]:
        draw_timelines(timelines, settings, own["timeline"])


def draw(rows, settings, path):
    """Each backend's per-rank peak against W (log scales, W from 1 to 1024), beside ZeRO's 16 bytes
    per parameter over W: what sharding divides, and what it leaves (activations, gathered units)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    params = sum(p.numel() for p in meta_model(settings).parameters())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        points = sorted((r["nproc"], r["peak_allocated_bytes"] / 2**30) for r in rows if r["backend"] == backend)
        ax.plot(*zip(*points), marker="o", label=f"{backend}: peak per rank")
    worlds = [2**i for i in range(11)]
    ax.plot(worlds, [16 * params / w / 2**30 for w in worlds], "k--", label="16 bytes/param / W (ZeRO-3 state)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(1, 1024)
    ax.set_xlabel("world size W")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{params / 1e9:.2f}B parameters, batch {settings['batch_size']} x {settings['block_size']}, "
                 f"{settings['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


ROLE_COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
                "gathered_parameters": "#8172b3", "communication": "#c44e52", "activations": "#ccb974", "other": "#999999"}
EVENT_MARKS = {"all_gather": ("v", "#1f77b4", "all-gather"), "reduce_scatter": ("^", "#d62728", "reduce-scatter"),
               "all_reduce": ("D", "#ff7f0e", "all-reduce"), "gathered_freed": ("|", "#555555", "gathered freed")}


def draw_timelines(timelines, settings, path):
    """One panel per planned run: a rank's allocated bytes over two training steps, event by event,
    stacked by role; under it each collective and each free of gathered parameters, at the event
    where the step issues it; phases as dotted lines; the peak and its moment labelled. The panels
    share the y-axis, so backends and world sizes compare at a glance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    top = max(t["peak_allocated_bytes"] for t in timelines)
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    top /= scale
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 2.4 * len(timelines) + 0.9), sharey=True, squeeze=False)
    for ax, t in zip(axes[:, 0], timelines):
        x = [row[0] for row in t["stacked"]]
        layers = [[row[1 + i] / scale for row in t["stacked"]] for i in range(len(t["roles"]))]
        ax.stackplot(x, layers, colors=[ROLE_COLOURS[r] for r in t["roles"]], step="post", linewidth=0)
        events = [(index, kind) for index, kind, _ in t["collectives"]] + [(i, "gathered_freed") for i, _ in t["gathered_freed"]]
        for kind, (marker, colour, _) in EVENT_MARKS.items():
            at = [index for index, k in events if k == kind]
            y = -top * (0.05 if kind == "gathered_freed" else 0.11)
            ax.plot(at, [y] * len(at), marker, color=colour, markersize=4, linestyle="none", clip_on=False)
        for index, where in t["marks"]:
            ax.axvline(index, color="#bbbbbb", linewidth=0.5, linestyle=":")
        ticks = [(index, where) for index, where in t["marks"] if where.endswith("forward 0") or where.endswith("clip")]
        ax.set_xticks([index for index, _ in ticks])
        ax.set_xticklabels([where.replace("step ", "step ").replace(" forward 0", ": forward").replace(" clip", ": clip")
                            for _, where in ticks], fontsize=7)
        ax.annotate(f"peak {t['peak_allocated_bytes'] / scale:,.2f} {unit}: {t['peak_at']}",
                    (t["peak_event"], t["peak_allocated_bytes"] / scale), xytext=(0.01, 0.95), textcoords="axes fraction",
                    fontsize=7, va="top", arrowprops=dict(arrowstyle="->", color="k", linewidth=0.6))
        ax.set_title(f"{t['backend']}, W={t['nproc']}, rank {t['rank']}", fontsize=9, loc="right")
        ax.set_xlim(0, t["events"])
        ax.set_ylim(-top * 0.15, top * 1.1)
        ax.set_ylabel(f"{unit} allocated", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    handles = [Patch(color=ROLE_COLOURS[r], label=r.replace("_", " ")) for r in ROLES] + [
        Line2D([], [], marker=m, color=c, linestyle="none", markersize=5, label=label) for m, c, label in EVENT_MARKS.values()]
    fig.legend(handles=handles, loc="upper center", ncol=6, fontsize=7, frameon=False)
    axes[-1, 0].set_xlabel("allocation events in the order the step makes them: two training steps", fontsize=8)
    fig.text(0.01, 0.995, f"batch {settings['batch_size']} x {settings['block_size']}, {settings['dtype']}",
             fontsize=8, va="top")
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.07, right=0.99, top=1 - 0.8 / height, bottom=0.65 / height, hspace=0.55)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gib(n):
    """Bytes in GiB, as the table shows them."""
    return f"{n / 2**30:,.2f}"


class Column(NamedTuple):
    """A column of plan.py's table: its name, the format spec of the name and of each cell, and a
    row's cell; `answers` columns show only when a GPU's memory is given."""
    name: str
    spec: str
    cell: Callable
    answers: bool = False


TABLE_COLUMNS = (
    Column("backend", "<12", lambda r: r["backend"]),
    Column("W", ">5", lambda r: r["nproc"]),
    Column("rank", ">4", lambda r: r["rank"]),
    Column("peak GiB", ">9", lambda r: gib(r["peak_allocated_bytes"])),
    Column("reserve", ">9", lambda r: gib(r["reserved_bytes"])),
    Column("state GiB", ">9", lambda r: gib(r["state_bytes"])),
    Column("comm GiB", ">9", lambda r: gib(sum(r["comm_bytes_per_step"].values()))),
    Column("comm ms", ">8", lambda r: f"{r['comm_seconds_per_step'] * 1e3:,.1f}"),
    Column("headroom", ">8", lambda r: gib(r["headroom_bytes"]), answers=True),
    Column("max batch", ">9", lambda r: r["max_batch_size"], answers=True),
    Column("peak at", "", lambda r: r["peak_at"]),  # (free text, last)
)


def table_line(columns, cells):
    """The cells under their columns, one space apart; the last, free text, two spaces after."""
    *aligned, last = (f"{cell:{column.spec}}" for column, cell in zip(columns, cells))
    return " ".join(aligned) + "  " + last


def table(rows, settings, limit, gloo=False):
    answers = limit is not None
    columns = [c for c in TABLE_COLUMNS if answers or not c.answers]
    lines = [table_line(columns, [c.name for c in columns])]
    lines += [table_line(columns, [c.cell(r) for c in columns]) for r in rows]
    lines.append(f"\nbatch_size={settings['batch_size']}, block_size={settings['block_size']}, dtype={settings['dtype']}; "
                 "a rank's micro-steps: gradient_accumulation_steps / W")
    lines.append("(one where W does not divide it: memory depends on the micro-batch; the job needs a multiple of W).")
    if answers:
        smallest = {}
        for r in rows:
            if r["fits"]:
                smallest.setdefault(r["backend"], r["nproc"])
        lines.append(f"in {limit / 2**30:,.1f} GiB: " + "; ".join(
            f"{b} fits from W={w}" for b, w in smallest.items()) if smallest else "none of these fits")
    lines.append("peak: allocated, as the CPU allocator counts it (kernels' own scratch aside).")
    if gloo:
        lines.append("device=cpu: gloo's buffers count at their worst: a gather's from the call to its wait,")
        lines.append("a reduce-scatter's copy of its input until the handle is dropped.")
    lines.append(f"reserve: CUDA's caching allocator replayed over it, one stream, with {CUBLAS_WORKSPACES} cuBLAS "
                 f"workspaces of {CUBLAS_WORKSPACE_BYTES // 2**20} MiB.")
    if answers:
        lines.append(f"headroom GiB: the GPU's memory less the reserve, {CUDA_CONTEXT_BYTES // 2**20} MiB of CUDA "
                     f"context and {NCCL_COMMUNICATOR_BYTES // 2**20} MiB per NCCL communicator.")
        lines.append("Below 0 it does not fit.")
    if settings["cpu_offload"]:
        lines.append("cpu_offload: peak and reserve are the GPU's; the state column lives in (pinned) host memory.")
        lines.append("Not modelled there: a unit's shard copied to the GPU for its gather, and its reduced grads")
        lines.append("until they are copied out (together at most two of the largest unit's shards).")
    lines.append("comm ms: a projection, the step's bus bytes over a bus bandwidth of " + ", ".join(
        f"{b:g}" for b in sorted({r["busbw_gbps"] for r in rows})) + " GB/s (H100s: NVLink to W=8,")
    lines.append("InfiniBand above; --busbw_gbps sets it); latency aside, before any overlap with compute.")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
