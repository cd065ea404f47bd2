"""
Counts the gradient collectives of each micro-step of gradient accumulation, per backend.

    torchrun --standalone --nproc_per_node=2 tests/accum_worker.py RESULT.json [ddp fsdp custom_fsdp fsdp+keep ...]

Builds a tiny GPT on the meta device and wraps it with backends.make_backend(...).wrap(...) exactly
as train.py does, then runs MICRO_STEPS micro-steps with backend.set_grad_sync(model, is_last).
A name ending in +keep runs with train.py's reshard_after_forward=False and reshard_after_backward=False:
the units stay gathered from the first forward to the last backward.
Rank 0 writes {backend: {"grad_collectives": [per micro-step], "all_gathers": [...], "units": n}}.

Counting, not guessing: train.py's observe.CommCounter wraps torch.distributed's collectives
before any backward runs (FSDP2 and fsdp_impl/comm.py look them up at call time). DDP's reducer issues its
all-reduce from C++, so a comm hook that all-reduces the bucket as the default hook does routes
it through torch.distributed, where the counter sees it.
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
from observe import CommCounter  # noqa: E402

MICRO_STEPS = 3
N_LAYER = 2
CFG = dict(device="cpu", dtype="float32", compile=False, cpu_offload=False, replicate_degree=1,
           wrap_policy="block", min_wrap_params=1_000_000, reshard_after_forward=True, prefetch=True,
           reshard_after_backward=True, float8=False)
KEEP = dict(reshard_after_forward=False, reshard_after_backward=False)


def allreduce_hook(state, bucket):
    """DDP's default allreduce hook (average the bucket), through the counted dist.all_reduce."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def run(name, counter):
    name, keep = name.removesuffix("+keep"), name.endswith("+keep")
    back = make_backend(name, CFG | KEEP if keep else CFG)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=N_LAYER, n_head=2, n_embd=32, block_size=16, vocab_size=65,
                              dropout=0.0, bias=False))
    model = back.wrap(model, lambda m: m.init_weights(0))
    if name == "ddp":
        model.register_comm_hook(None, allreduce_hook)
        units = None
    else:
        from torch.distributed.fsdp import FSDPModule
        # fully_shard-ed modules: each is one unit (one communication group) in both implementations
        units = sum(1 for m in model.modules() if isinstance(m, FSDPModule) or hasattr(m, "_fsdp_unit"))
    rank = dist.get_rank()
    grad_collectives, all_gathers = [], []
    for step in range(MICRO_STEPS):
        is_last = step == MICRO_STEPS - 1
        back.set_grad_sync(model, is_last)
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randint(0, 65, (2, 16), generator=gen)
        y = torch.randint(0, 65, (2, 16), generator=gen)
        counter.take()
        with back.autocast():
            _, loss = model(x, y)
        back.backward(loss / MICRO_STEPS)
        counts = counter.take()
        grad_collectives.append(counts["reduce_scatter_count"] + counts["all_reduce_count"])
        all_gathers.append(counts["all_gather_count"])
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
    return {"grad_collectives": grad_collectives, "all_gathers": all_gathers, "units": units,
            "n_layer": N_LAYER, "has_grads": has_grads, "grads_agree": grads_agree,
            "grads": [g.full_tensor().tolist() if hasattr(g, "full_tensor") else g.tolist() for g in grads]}


def main():
    out_path = sys.argv[1]
    names = sys.argv[2:] or ["ddp", "fsdp", "custom_fsdp"]
    dist.init_process_group("gloo")
    counter = CommCounter()
    results = {name: run(name, counter) for name in names}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # FSDP2 on gloo can abort in interpreter teardown after a clean run


if __name__ == "__main__":
    main()
