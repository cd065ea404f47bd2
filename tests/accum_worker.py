"""
Counts the gradient collectives of each micro-step of gradient accumulation, per backend.

    torchrun --standalone --nproc_per_node=2 tests/accum_worker.py RESULT.json [ddp fsdp custom_fsdp]

Builds a tiny GPT on the meta device and wraps it with backends.make_backend(...).wrap(...) exactly
as train.py does, then runs MICRO_STEPS micro-steps with backend.set_grad_sync(model, is_last).
Rank 0 writes {backend: {"grad_collectives": [per micro-step], "all_gathers": [...], "units": n}}.

Counting, not guessing:
  ddp          a DDP comm hook that all-reduces the bucket (as the default hook does) and counts
               its calls; DDP's reducer issues its all-reduce from C++, so only a hook sees it.
  fsdp,        torch.distributed.reduce_scatter_tensor / reduce_scatter_single / isend (one per
  custom_fsdp  fsdp_impl reduce-scatter on two gloo ranks) / all_reduce are replaced by counting
               wrappers before any backward runs; FSDP2 and fsdp_impl/comm.py both look the
               function up on the torch.distributed module at call time.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from backends import make_backend  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

MICRO_STEPS = 3
N_LAYER = 2
CFG = dict(device="cpu", dtype="float32", compile=False, cpu_offload=False, replicate_degree=1,
           wrap_policy="block", min_wrap_params=1_000_000, reshard_after_forward=True, prefetch=True)

ORIGINAL = {name: getattr(dist, name) for name in
            ("reduce_scatter_tensor", "reduce_scatter_single", "isend", "all_reduce", "all_gather_single",
             "all_gather_into_tensor")}


class Counter:
    def __init__(self):
        self.step = None  # the micro-step running now (None: outside the measured region)
        self.grad = [0] * MICRO_STEPS
        self.gather = [0] * MICRO_STEPS

    def add(self, kind):
        if self.step is not None:
            getattr(self, kind)[self.step] += 1


counter = Counter()


def counting(name, kind):
    def wrapper(*args, **kwargs):
        counter.add(kind)
        return ORIGINAL[name](*args, **kwargs)
    wrapper.__name__ = name
    return wrapper


def patch_collectives():
    for name in ("reduce_scatter_tensor", "reduce_scatter_single", "isend", "all_reduce"):
        setattr(dist, name, counting(name, "grad"))
    for name in ("all_gather_single", "all_gather_into_tensor"):
        setattr(dist, name, counting(name, "gather"))


def counting_allreduce_hook(state, bucket):
    """DDP's default allreduce hook (average the bucket), counted; uses the unpatched all_reduce."""
    counter.add("grad")
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    fut = ORIGINAL["all_reduce"](buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def run(name):
    global counter
    counter = Counter()
    back = make_backend(name, CFG)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=N_LAYER, n_head=2, n_embd=32, block_size=16, vocab_size=65,
                              dropout=0.0, bias=False))
    model = back.wrap(model, lambda m: m.init_weights(0))
    if name == "ddp":
        model.register_comm_hook(None, counting_allreduce_hook)
        units = None
    else:
        from torch.distributed.fsdp import FSDPModule
        # fully_shard-ed modules: each is one unit (one communication group) in both implementations
        units = sum(1 for m in model.modules() if isinstance(m, FSDPModule) or hasattr(m, "_fsdp_unit"))
    rank = dist.get_rank()
    for step in range(MICRO_STEPS):
        is_last = step == MICRO_STEPS - 1
        back.set_grad_sync(model, is_last)
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randint(0, 65, (2, 16), generator=gen)
        y = torch.randint(0, 65, (2, 16), generator=gen)
        counter.step = step
        with back.autocast():
            _, loss = model(x, y)
        back.backward(loss / MICRO_STEPS)
        counter.step = None
    grads = [p.grad for p in model.parameters()]
    has_grads = all(g is not None for g in grads)
    # the synchronised gradients must be the same on every rank (ddp: whole, fsdp: the full tensor)
    if has_grads:
        flat = torch.cat([(g.full_tensor() if hasattr(g, "full_tensor") else g).reshape(-1) for g in grads])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        grads_agree = all(torch.equal(gathered[0], g) for g in gathered)
    else:
        grads_agree = False
    return {"grad_collectives": counter.grad, "all_gathers": counter.gather, "units": units,
            "n_layer": N_LAYER, "has_grads": has_grads, "grads_agree": grads_agree}


def main():
    out_path = sys.argv[1]
    names = sys.argv[2:] or ["ddp", "fsdp", "custom_fsdp"]
    dist.init_process_group("gloo")
    patch_collectives()
    results = {name: run(name) for name in names}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # FSDP2 on gloo can abort in interpreter teardown after a clean run


if __name__ == "__main__":
    main()
