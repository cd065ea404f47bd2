"""
fsdp_impl against FSDP2 on NCCL with W ranks, in what train.py has no setting for: gradient
accumulation that keeps every unit gathered between micro-steps (set_reshard_after_backward(False)
and set_requires_gradient_sync(False) until the last). tests/test_cuda_multi.py runs it as fake hosts
on one GPU and asserts on what rank 0 writes:

    python scripts/fakehosts.py --nproc=2 tests/multi_worker.py OUT.json

Both implementations train a small GPT from the same init on the same rank-dependent batches (AdamW,
fused); attention runs its math kernels and cuBLAS its deterministic ones, so equal inputs give equal
bits. Every rank compares its own losses, norms and the full parameters; the verdict is all ranks'.
"""
import json
import os
import sys
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_impl import fully_shard as our_fully_shard  # noqa: E402
from backends import use_deterministic_kernels  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

CFG = dict(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32)
BATCH, STEPS, MICRO = 4, 3, 3
IMPLS = {"fsdp2": fsdp2_fully_shard, "ours": our_fully_shard}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (gloo on CPU: a check of this script, not of NCCL)


def build(shard, mesh):
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG))
    for block in model.transformer.h:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    model.to_empty(device=DEVICE)
    model.init_weights(0)
    return model


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x, y = (torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"]), generator=g) for _ in range(2))
    return x.to(DEVICE), y.to(DEVICE)


def train(shard, mesh, rank):
    model = build(shard, mesh)
    initial = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses, norms = [], []
    for step in range(STEPS):
        for k in range(MICRO):
            last = k == MICRO - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)  # gathered through the accumulation, freed after the last
            _, loss = model(*batch(rank, step, k))
            (loss / MICRO).backward()
            losses.append(loss.item())
        squares = sum(p.grad.to_local().float().pow(2).sum() for p in model.parameters())
        dist.all_reduce(squares)
        norms.append(squares.sqrt().item())
        opt.step()
        opt.zero_grad()
    final = {n: p.full_tensor() for n, p in model.named_parameters()}
    moved = all(not torch.equal(initial[n], final[n]) for n in final)
    return losses, norms, final, moved


def main():
    use_deterministic_kernels()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(DEVICE, (world,))
    runs = {name: train(shard, mesh, rank) for name, shard in IMPLS.items()}
    (l1, n1, p1, m1), (l2, n2, p2, m2) = runs["ours"], runs["fsdp2"]
    same = l1 == l2 and n1 == n2 and all(torch.equal(p1[k], p2[k]) for k in p2)
    diff = max((p1[k].double() - p2[k].double()).abs().max().item() for k in p2)
    flags = torch.tensor([float(same), float(m1 and m2)], device=DEVICE)
    worst = torch.tensor([diff], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps({
            "world": world, "bitwise": flags[0].item() == 1, "moved": flags[1].item() == 1,
            "param_max_diff": worst.item(), "ours": {"losses": l1, "norms": n1}, "fsdp2": {"losses": l2, "norms": n2}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
