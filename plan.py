"""
Will it fit? Each rank's memory for a train.py run, planned on one CPU, before anything launches.

    python plan.py config/train_gpt2.py --nproc=8,64
    python plan.py config/train_gpt2.py --dist_backend=custom_fsdp --nproc=2,4 --json=plan.json

It takes train.py's config files and --key=value settings, plus its own: --nproc (world sizes,
comma-separated), --rank (default: rank 0, whose shards are the largest), --gpu (a100, h100, h200)
or --gpu_mem_gib (whether it fits, and the largest batch that does), --busbw_gbps (the bus bandwidth
the communication time is projected at), --json (one row per backend and world size), --png
(peak per rank against W) and --recalibrate (a CPU run's figures measured again, not cached ones).
--dist_backend plans one backend; without it, all three. Without --dtype it plans bfloat16, or
float32 for a --device=cpu run, as train.py takes them.

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
import sys

from planner.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
