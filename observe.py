"""
What a run costs, for any backend: memory at the stages users look at, collectives counted
per step, the training thread's CPU time per phase of a step, profiler traces and memory
snapshots of a few steps. train.py owns one Observer.

    --profile=True          Chrome/Perfetto traces, one per rank: out_dir/traces/<backend>/rank<R>.json
                            of the run's steps PROFILE_STEPS, each a ProfilerStep#<step> range
                            holding that training step alone (evaluation and checkpointing
                            fall between the ranges); overlap.py reports per range.
                            On CPU every thread is recorded (gloo moves the bytes on threads of
                            its own), unless --memory_snapshot=True is on too.
    --memory_snapshot=True  CUDA: torch.cuda.memory history, out_dir/memory/rank<R>.pickle (open it
                            at pytorch.org/memory_viz); CPU: a trace with every allocation and the
                            memory in use as a counter track, rank<R>.json (open it in Perfetto).
                            (The profiler's own export_memory_timeline asserts on the FSDP
                            backends' storage resizing, so it is not used.)
"""
import os
import resource
import shutil
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import metrics
from overlap import PHASE_RANGE
from fsdp_impl.comm import collective_bytes


PROFILE_STEPS = (2, 5)  # the run's steps [2, 5), counting from 0: past warm-up, few enough
# dense tensor-core peaks in FLOP/s: (bf16 or fp16, TF32, which float32 matmuls run on with
# allow_tf32); the PCIe and NVL H100s before the SXM one, whose name theirs contain
PEAK_FLOPS = (("A100", 312e12, 156e12), ("H100 PCIe", 756e12, 378e12), ("H100 NVL", 835.5e12, 417.5e12),
              ("H100", 989e12, 494.5e12), ("H200", 989e12, 494.5e12))


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def peak_flops(device_name, dtype):
    """What MFU divides by: the device's peak for matmuls in `dtype`, or None where unknown (CPU)."""
    for name, half, tf32 in PEAK_FLOPS:
        if name in device_name:
            return tf32 if dtype == "float32" else half
    return None


def local_tensor(t):
    """What this rank holds of `t`: a DTensor's local shard, or a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def model_state_mb(model, optimizer):
    """This rank's bytes of parameters, gradients and optimizer state (local shards only)."""
    def local(t):
        t = local_tensor(t)
        return t.numel() * t.element_size()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params_mb": sum(map(local, params)) / 2**20,
            "grads_mb": sum(local(p.grad) for p in params if p.grad is not None) / 2**20,
            "optim_mb": sum(map(local, state)) / 2**20}


class CommCounter:
    """Counts collectives and bytes (fsdp_impl.comm's byte rule) issued through torch.distributed's
    Python API: everything FSDP2 and fsdp_impl issue. DDP's C++ reducer is not seen (bench.py states
    its formula)."""
    KINDS = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "all_reduce": "all_reduce"}

    def __init__(self):
        self.totals = {}
        self.steps = 0
        self.take()
        for fn_name, kind in self.KINDS.items():
            if hasattr(dist, fn_name):  # the *_single names are new in torch 2.13
                setattr(dist, fn_name, self._counting(getattr(dist, fn_name), kind))

    def _add(self, kind, nbytes):
        self.current[f"{kind}_count"] += 1
        self.current[f"{kind}_bytes"] += nbytes

    def _counting(self, fn, kind):
        def counted(*args, **kwargs):
            self._add(kind, collective_bytes([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]))
            return fn(*args, **kwargs)
        return counted

    def take(self):
        """Counts and bytes since the last call."""
        taken, self.current = getattr(self, "current", None), {
            f"{k}_{x}": 0 for k in set(self.KINDS.values()) for x in ("count", "bytes")}
        return taken

    def add_step(self):
        """Close one training step: what it issued joins the per-step average."""
        for k, v in self.take().items():
            self.totals[k] = self.totals.get(k, 0) + v
        self.steps += 1

    def per_step(self):
        return {k: v / max(self.steps, 1) for k, v in self.totals.items()}


class Observer:
    def __init__(self, out_dir, backend_name, rank, device, profile, memory_snapshot):
        self.out_dir, self.backend_name, self.rank, self.device = out_dir, backend_name, rank, device
        self.cuda = device.startswith("cuda")
        self.profiler, self.memory_snapshot = None, memory_snapshot
        self.step_range = None  # the open ProfilerStep range of a profiled step
        self.phase_range = None  # and its open phase (mark)
        self.profile = profile
        self.steps = 0
        self.host_ms = {}  # this step's CPU time of the training thread per phase

    @contextmanager
    def host_time(self, phase):
        """Add the training thread's CPU time inside the block to this step's `phase`. On a GPU it
        is the host's own work (Python, dispatch, launches), which the device may be waiting on,
        except backward's: autograd runs that on a thread of its own for the device, not counted;
        on a CPU the compute as well. Waits that sleep (gloo's) do not count; CUDA synchronizations
        spin and would, but train.py's one per step is outside the phases."""
        start = time.thread_time()
        try:
            yield
        finally:
            self.host_ms[phase] = self.host_ms.get(phase, 0.0) + (time.thread_time() - start) * 1e3

    def memory(self, stage, model, optimizer):
        """Memory at a stage: allocator figures on CUDA, the peak RSS so far everywhere, the model's
        state; max over ranks."""
        row = {"event": metrics.MEMORY, "stage": stage, "rss_mb": rss_mb()}
        if self.cuda:
            row |= {"allocated_mb": torch.cuda.memory_allocated() / 2**20,
                    "max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
                    "reserved_mb": torch.cuda.memory_reserved() / 2**20,
                    "max_reserved_mb": torch.cuda.max_memory_reserved() / 2**20}  # (plan.py's reserve predicts it)
        row |= model_state_mb(model, optimizer)
        if dist.is_initialized():
            keys = [k for k in row if k.endswith("_mb")]
            values = torch.tensor([row[k] for k in keys], dtype=torch.float64,
                                  device=self.device if self.cuda else "cpu")
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            row |= dict(zip(keys, values.tolist()))
        return row

    def peak_mb(self):
        """The peak so far: CUDA's max allocated on a GPU, else this process's peak RSS."""
        return torch.cuda.max_memory_allocated() / 2**20 if self.cuda else rss_mb()

    def before_step(self):
        """Open a profiled step when the window holds it (the first one starts the profiler).
        train.py calls this before it starts the step's clock and after_step() after it stops
        it: the profiler's start and the export are in no logged step time, and each
        ProfilerStep range holds one training step, not the evaluation and checkpoint that
        come before the next."""
        self.host_ms = {}
        if self.steps == PROFILE_STEPS[0] and self.memory_snapshot and self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        if self.steps == PROFILE_STEPS[0] and (self.profile or (self.memory_snapshot and not self.cuda)):
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            mem = self.memory_snapshot and not self.cuda
            # no schedule: its ProfilerStep ranges would run from one step() to the next, through
            # whatever lies between two steps; ours are opened and closed around each step (and
            # the profiler's start-up, which the schedule's warm-up step absorbed, is outside both)
            # on CPU every thread, for gloo's, which move the bytes of every collective; a trace
            # that records allocations records the training thread's only
            threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=not (self.cuda or mem))
            self.profiler = torch.profiler.profile(activities=acts, record_shapes=mem, profile_memory=mem,
                                                   with_stack=mem, experimental_config=threads)
            self.profiler.start()
        if self.profiler is not None:  # (the range name is the one overlap.py reads)
            self.step_range = torch.profiler.record_function(f"ProfilerStep#{self.steps}")
            self.step_range.__enter__()

    def mark(self, where):
        """In a profiled step, a range from each of the step's marks to the next ("phase: forward 0",
        "phase: backward 0", ..., "phase: zero_grad"), so that a trace shows its phases and
        micro-steps; overlap.py draws them."""
        if self.phase_range is not None:
            self.phase_range.__exit__(None, None, None)
            self.phase_range = None
        if self.step_range is not None and where != "between steps":
            self.phase_range = torch.profiler.record_function(PHASE_RANGE + where)
            self.phase_range.__enter__()

    def _path(self, *parts):
        path = os.path.join(self.out_dir, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def after_step(self):
        """Close the profiled step; at the window's end, write what was recorded."""
        self.mark("between steps")
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        self.steps += 1
        if self.steps == PROFILE_STEPS[1]:
            self.finish()

    def finish(self):
        """Write what was recorded (also when the run ended inside the window), or say in one
        line that a run too short to reach the window recorded nothing. (Its first steps are
        not traced in its place: they carry one-time costs, the compilation with compile=True,
        and would pass for typical steps.)"""
        asked = [f"--{k}=True" for k in ("profile", "memory_snapshot") if getattr(self, k)]
        if asked and self.steps <= PROFILE_STEPS[0] and self.rank == 0:
            print(f"{' and '.join(asked)}: nothing recorded: this run trained {self.steps} step(s), and the "
                  f"recorded ones are its steps {PROFILE_STEPS[0]}-{PROFILE_STEPS[1] - 1} (counting from 0): "
                  f"train at least {PROFILE_STEPS[0] + 1}", flush=True)
        paths = []
        if self.profiler is not None:
            self.profiler.stop()
            paths = ([self._path("traces", self.backend_name, f"rank{self.rank}.json")] if self.profile else []) + \
                ([self._path("memory", f"rank{self.rank}.json")] if self.memory_snapshot and not self.cuda else [])
            self.profiler.export_chrome_trace(paths[0])  # on CPU with memory: allocations as a counter track
            for extra in paths[1:]:
                shutil.copyfile(paths[0], extra)  # a trace can be exported only once
            self.profiler = None
        if self.memory_snapshot and self.cuda and self.steps > PROFILE_STEPS[0]:
            paths.append(self._path("memory", f"rank{self.rank}.pickle"))
            torch.cuda.memory._dump_snapshot(paths[-1])
            torch.cuda.memory._record_memory_history(enabled=None)
        if paths and self.rank == 0:
            print(f"wrote {', '.join(paths)} (and each rank's beside them)", flush=True)
        self.memory_snapshot = self.profile = False
