"""
plan.py's workings, one concern a file (plan.py's docstring says what a plan is):

    counting.py   the dispatch mode that counts every storage the step allocates, resizes and frees
    cuda.py       CUDA's caching allocator replayed over the counts; the GPU's memory
    step.py       the planned step: the model wrapped as train.py wraps it, two steps on fake tensors
    draw.py       the pictures
    snapshot.py   the CUDA model's replay as a torch.cuda.memory._snapshot() file, for memory_viz
    timing.py     the time model: each op and collective timed, the step replayed on three clocks
    calibrate.py  this CPU's figures for the time model, measured once, checked and cached
    opcosts.py    this CPU's cost of each op of a step, timed at its own shapes and cached
    search.py     --search: a grid of settings planned, those that fit ranked by speed
    cli.py        the command line and the table
"""
from .counting import ROLES, Allocations
from .cuda import (CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES, CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES,
                   CachingAllocatorModel)
from .draw import draw_timelines
from .step import (Child, batch_line, fake_process_group, in_child, largest_batch, meta_model, plan, run,
                   second_batch)
from .cli import main

__all__ = ["ROLES", "Allocations", "CUBLAS_WORKSPACE_BYTES", "CUBLAS_WORKSPACES", "CUDA_CONTEXT_BYTES",
           "NCCL_COMMUNICATOR_BYTES", "CachingAllocatorModel", "draw_timelines", "Child", "batch_line",
           "fake_process_group", "in_child", "largest_batch", "meta_model", "plan", "run", "second_batch", "main"]
