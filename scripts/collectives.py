"""
The collectives FSDP is made of, alone: all-gather, reduce-scatter and all-reduce at a few sizes, on
this job's process group (gloo on CPU, NCCL on GPUs). Rank 0 writes one JSON row per op and size.

    torchrun --standalone --nproc_per_node=2 scripts/collectives.py --json=PATH [--sizes_mb=1,10,100] [--iters=5]

Size is nccl-tests' size: the gathered output, the scattered input, the reduced tensor (float32).
Each op runs once first, then `iters` times, each between barriers; the row holds the median time.
algbw is size / time; busbw is what each rank's link carries per second, nccl-tests' factors:
(W-1)/W of algbw for a gather or a scatter, 2 (W-1)/W for an all-reduce. `ran_as` names what the
backend ran, as the profiler records it: gloo's op, or NCCL's kernel with its algorithm.
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

OPS = ("all_gather", "reduce_scatter", "all_reduce")
BUS_FACTOR = {"all_gather": lambda w: (w - 1) / w, "reduce_scatter": lambda w: (w - 1) / w,
              "all_reduce": lambda w: 2 * (w - 1) / w}


def run_op(op, numel, device):
    """A callable that runs `op` once over `numel` float32 elements of size (the nccl-tests size)."""
    world = dist.get_world_size()
    big = torch.ones(numel, device=device)
    piece = torch.ones(numel // world, device=device)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(big, piece)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(piece, big)
    return lambda: dist.all_reduce(big)


def ran_as(fn, device):
    """The names of what the backend ran for one call of fn: gloo's ops or NCCL's kernels."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.name.startswith(("gloo:", "nccl"))}
    return ", ".join(sorted(names)) or "-"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="the JSON file rank 0 writes")
    p.add_argument("--sizes_mb", default="1,10,100", help="sizes in MB (10**6 bytes), comma-separated")
    p.add_argument("--iters", type=int, default=5, help="timed calls per op and size")
    args = p.parse_args()
    try:
        sizes = [float(s) for s in args.sizes_mb.split(",")]
    except ValueError:
        p.error(f"--sizes_mb={args.sizes_mb}: give sizes in MB such as 1,10,100")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rows = []
    for mb in sizes:
        numel = max(world, int(mb * 1e6 / 4) // world * world)  # (a multiple of W: an even split)
        for op in OPS:
            fn = run_op(op, numel, device)
            names = ran_as(fn, device)  # (also the warm-up call)
            seconds = []
            for _ in range(args.iters):
                dist.barrier()
                start = time.perf_counter()
                fn()
                if cuda:
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - start)
            t = statistics.median(seconds)
            size = numel * 4
            rows.append({"op": op, "size_bytes": size, "world_size": world, "seconds": t, "algbw_gbps": size / t / 1e9,
                         "busbw_gbps": size / t / 1e9 * BUS_FACTOR[op](world), "ran_as": names})
    if rank == 0:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import bench  # (the provenance every results file opens with)
        command = f"torchrun --nproc_per_node={world} scripts/collectives.py {shlex.join(sys.argv[1:])}"
        result = bench.provenance() | {"command": command, "device": bench.device_name(cuda),
                                       "backend": dist.get_backend(), "collectives": rows}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        for r in rows:
            print(f"{r['op']:>15} {r['size_bytes'] / 1e6:>7.1f} MB  W={world}  {r['seconds'] * 1e3:9.2f} ms  "
                  f"algbw {r['algbw_gbps']:6.2f} GB/s  busbw {r['busbw_gbps']:6.2f} GB/s  {r['ran_as']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
