"""
The planned step: the model built on the meta device and wrapped through backends.py as train.py
wraps it, then two training steps of training.train_step, as one rank of W, in a fake process
group, counted by counting.Allocations. Each plan runs in a forked child (Child).
"""
import bisect
import os
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

import training
from backends import BackendError, DDPBackend, make_backend
from fsdp_impl.comm import collective_bytes
from model import GPT, GPTConfig

from . import timing
from .counting import STATE_ROLES, Allocations, GlooBuffers, roles, storage_id
from .cuda import CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES, cuda_model


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
        gloo=False, timed=False):
    """Build the model and take two training steps as rank `rank` of `world`, under a fake process
    group, counting storages from the model's creation on. With fake=False the tensors are real, and
    `measured()` (the tests' profiler) is entered where the counting starts. Returns the counter,
    this rank's state bytes and its micro-steps per step. `group(world, rank)`: the process group
    to run in (PyTorch's fake one by default). sampling: roles noted at every mark and block. gloo:
    a CPU run's process group, whose buffers count (GlooBuffers). timed: the second step's ops kept
    (counter.ops) for the time model."""
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
            state = steps(counter, settings, back, model, local_steps, fake, timed)
    return counter, state, local_steps


def steps(counter, settings, back, model, local_steps, fake, timed=False):
    back, model, optimizer = build_with(back, model, settings, plain_ddp=fake)
    counter.roles = lambda: roles(model, optimizer, counter.comm_storages)
    block_marks(model, counter)
    ddp_bucket_marks(model, counter, back.world_size, local_steps)
    state = []
    for step in range(2):
        def mark(where, step=step):
            counter.snapshot_if_at_peak()
            if counter.sampling:
                counter.note_roles()
            counter.where = f"step {step + 1} {where}"
            counter.marks.append((len(counter.trace), counter.where))
            if where == "clip" and step == 1:  # the end of backward: gradients reduced, activations gone
                counter.backward_end = counter.hold_moment()
            if where == "zero_grad":  # the gradients are still there
                counter.host_numbers.update(counter.live[key].number for key, role in counter.roles().items()
                                            if role in STATE_ROLES and key in counter.live)
                if step == 1:
                    state.append(state_bytes(optimizer))
        if step == 1:
            counter.comm, counter.bus_bytes = {}, 0  # communication per step: the second step's
            counter.ops = [] if timed else None  # and its ops, for the time model
        training.train_step(settings, back, model, optimizer, local_steps, random_batch(settings), step,
                            dist.get_rank(), mark=mark)
        if step == 0:
            counter.steady = counter.allocated
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


def plan(settings, backend_name, world, rank, timeline=False, gloo=False, keep_trace=False, device=None,
         snapshot=False):
    """One backend at W ranks, as rank `rank`: the row plan.py reports; with timeline, its
    "timeline" too (Allocations.timeline), with keep_trace the "trace" the CUDA model replays. Under
    cpu_offload the run is planned without it, and the GPU's side is what stays after the state
    moves to host memory. gloo: a CPU run's buffers count. snapshot: its "snapshot" too, the CUDA
    model's replay as torch.cuda.memory._snapshot() gives one (snapshot.py), roles sampled as for timeline.
    device: the step's ops are kept ("timed_ops") for time_rows, which the caller runs on all its rows."""
    started = time.time()
    offload = settings["cpu_offload"]
    if offload and backend_name == "ddp":  # (planned without offload below: ask train.py's refusal here)
        raise BackendError("cpu_offload and replicate_degree apply to the sharded backends only")
    counter, state, local_steps = run(dict(settings, cpu_offload=False), backend_name, world, rank,
                                      sampling=timeline or snapshot, gloo=gloo, timed=device is not None)
    peak, peak_at, made_of, trace = counter.peak, counter.peak_where, counter.made_of(), counter.trace
    peak_event = counter.peak_index - 1
    if offload:
        peak, peak_at, trace, peak_event = device_side(counter)
        made_of = None  # (the breakdown is the whole run's)
    cuda = cuda_model(trace, log=snapshot)
    extra = {"trace": trace} if keep_trace else {}
    if snapshot:
        from .snapshot import memory_snapshot
        extra["snapshot"] = memory_snapshot(counter, cuda, counter.host_numbers if offload else ())
    if device is not None:
        extra["timed_ops"] = counter.ops  # (timed by time_rows, beside the other rows planned with it)
    if timeline:
        extra["timeline"] = dict(counter.timeline(exclude=counter.host_numbers if offload else ()),
                                 peak_event=peak_event)
    return extra | {"backend": backend_name, "nproc": world, "rank": rank, "micro_steps": local_steps,
            "peak_allocated_bytes": peak, "cuda_allocated_bytes": cuda.peak_allocated,
            "backward_end_made_of": None if offload else counter.made_of(*counter.backward_end),
            "reserved_bytes": cuda.reserved, "peak_at": peak_at, "peak_made_of": made_of,
            "communicators": len(counter.groups),
            "outside_allocator_bytes": CUDA_CONTEXT_BYTES + NCCL_COMMUNICATOR_BYTES * len(counter.groups),
            "host_bytes": state if offload else 0,
            "steady_bytes": counter.steady, "state_bytes": state, "comm_bytes_per_step": counter.comm,
            "comm_bus_bytes_per_step": round(counter.bus_bytes),
            "seconds": round(time.time() - started, 2)}


def time_rows(rows, devices, settings):
    """The time model's answers for rows planned with a device (their "timed_ops"), each on its own
    device with its own settings. The op costs every row lacks are measured first, in one pass over
    all of them (opcosts.py), so a slow spell of the machine meets every row's ops alike: the rows
    keep their order. Then each row's step is replayed."""
    by_table = {}
    for row, device in zip(rows, devices):
        if device.op_costs is not None:
            key = (device.op_costs.path, device.op_costs.threads)
            by_table.setdefault(key, (device, []))[1].extend(row["timed_ops"])
    for device, ops in by_table.values():
        device.prepare(ops)
    for device in devices:  # (the other devices of a table take what it measured, contended or not)
        if device.op_costs is not None:
            device.op_costs.costs |= by_table[(device.op_costs.path, device.op_costs.threads)][0].op_costs.costs
    for row, device, s in zip(rows, devices, settings):
        row |= step_time(row.pop("timed_ops"), device, s)
    return rows


def step_time(ops, device, settings):
    """The time model's answers for the planned step (timing.py) on `device`, its op costs measured."""
    bars = []
    device.prepare(ops)
    t = timing.replay(ops, device, bars)
    tokens = settings["gradient_accumulation_steps"] * settings["batch_size"] * settings["block_size"]
    peak = timing.peak_flops(device, settings["dtype"])
    return {"device": device.name, "step_seconds": t.seconds, "compute_seconds": t.compute_seconds,
            "comm_busy_seconds": t.comm_seconds, "exposed_comm_seconds": t.exposed_comm_seconds,
            "tokens_per_second": tokens / t.seconds, "mfu": t.flops / t.seconds / peak if peak else None,
            "device_source": device.source, "predicted_lanes": timing.lanes(bars, t.seconds, device)}


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
    model._planned_ddp_buckets = [(torch.empty(sum(params[i].numel() for i in b), dtype=params[b[0]].dtype),
                                   [params[i] for i in b]) for b in buckets]


def ddp_bucket_marks(model, counter, world, local_steps):
    """DDP's reducer at work in the micro-step that syncs gradients (the last), as its ops: each
    gradient, once accumulated, is copied into its bucket divided by W (mul.out); a bucket whose
    gradients are all in is all-reduced at once, so the time model overlaps it with the rest of
    backward as DDP does; after the last, every gradient is copied back from its bucket."""
    buckets = getattr(model, "_planned_ddp_buckets", ())
    views, pending = {}, {}
    for bucket, (flat, params) in enumerate(buckets):
        offset = 0
        for p in params:
            views[p] = (bucket, flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def accumulated(param):
        if not counter.where.split(" @ ")[0].endswith(f"backward {local_steps - 1}"):
            return
        bucket, view = views[param]
        flat, params = buckets[bucket]
        torch.mul(param.grad, 1.0 / world, out=view)
        waiting = pending.setdefault(bucket, set(map(id, params)))
        waiting.discard(id(param))
        if waiting:
            return
        nbytes = collective_bytes([flat])
        counter.count_collective("all_reduce", nbytes, world)
        if counter.ops is not None:
            counter.ops.append(timing.collective_op("all_reduce", nbytes, world, (flat,), flat,
                                                    f"{counter.where} (ddp's bucket {bucket})"))
        if len(pending) == len(buckets) and not any(pending.values()):  # (the last bucket: DDP's finalize)
            pending.clear()
            for p, (_, view) in views.items():
                p.grad.copy_(view)
    for p in views:
        p.register_post_accumulate_grad_hook(accumulated)


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
