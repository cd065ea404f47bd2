#!/bin/bash
# Multi-node training under Slurm: one torchrun launcher per node, rendezvous on the first node.
#   sbatch scripts/slurm.sh config/train_gpt2.py --dist_backend=custom_fsdp --replicate_degree=4
# 4 nodes x 8 GPUs = 32 processes: gradient_accumulation_steps must be divisible by 32 (train_gpt2.py's is)
#SBATCH --job-name=fsdp-gpt
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1          # one launcher per node; it starts one process per GPU
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=8
# NCCL: fail loudly instead of hanging when a peer dies, and say which interface it uses
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# export NCCL_SOCKET_IFNAME=ib0      # the interface for bootstrap traffic, if the default is wrong
# export NCCL_IB_HCA=mlx5            # which InfiniBand adapters to use

# --max_restarts: a crashed rank restarts the job, which resumes from the last checkpoint
srun torchrun \
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node=8 --max_restarts=3 \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_node:29500" \
    train.py "$@"
