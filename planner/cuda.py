"""
The GPU's side of a plan: CUDA's caching allocator replayed over the plan's allocations, and what
a CUDA process holds outside it (the context, NCCL's buffers), against the GPU's memory.
"""
from dataclasses import dataclass

import configurator


# What a CUDA process holds beside the step's tensors: not counted, but named (sources in
# IMPLEMENTATION.md; scripts/plan_check.py measures each on a GPU). cuBLAS's workspace comes from the
# caching allocator, one per thread that multiplies: the forward's and autograd's (Hopper's size)
CUBLAS_WORKSPACES = 2
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
# outside the allocator: the CUDA context (lazy module loading), NCCL's buffers per communicator
CUDA_CONTEXT_BYTES = 500 * 2**20
NCCL_COMMUNICATOR_BYTES = 700 * 2**20


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
    resized in place is a new block, then the old one freed (a copy).
    With log=True it also keeps `log`, the replay's events for a memory snapshot (snapshot.py):
    ("segment_alloc", index in the trace, address, size), ("alloc", index, storage number, address,
    block size, bytes asked) and ("free", index, storage number, address, block size); each
    segment lies at an address of its own (`bases`), after the one before it."""
    SMALL, MIN_BLOCK, SMALL_SEGMENT, LARGE_SEGMENT, MIN_LARGE, ROUND_LARGE = (
        2**20, 512, 2 * 2**20, 20 * 2**20, 10 * 2**20, 2 * 2**20)
    BASE = 0x7F0000000000  # the first segment's address (where CUDA's usually lie; below 2**53 for JavaScript)

    def __init__(self, log=False):
        self.free = {True: [], False: []}  # small pool?: its free blocks
        self.blocks = {}  # storage number -> its block
        self.allocated = self.reserved = self.peak_allocated = 0
        self.segments = 0
        self.bases = {}  # segment -> its address (segments' sizes are whole 2 MiB: each one aligned)
        self.log = [] if log else None

    def replay(self, trace):
        for at, (number, nbytes) in enumerate(trace):
            old = self.blocks.pop(number, None)
            if nbytes:
                block = self.blocks[number] = self._malloc(nbytes, at)
                if self.log is not None:
                    self.log.append(("alloc", at, number, self.address(block), block.size, nbytes))
            if old is not None:
                if self.log is not None:
                    self.log.append(("free", at, number, self.address(old), old.size))
                self._release(old)
        return self

    def address(self, block):
        return self.bases[block.segment] + block.offset

    def layout(self):
        """The segments now, in address order: [(segment, small pool?, [(offset, size, storage
        number, or None where the block is free)])], each segment's blocks in order, covering it."""
        segments = {}
        held = [(block, number) for number, block in self.blocks.items()]
        for block, number in held + [(block, None) for pool in self.free.values() for block in pool]:
            segments.setdefault(block.segment, (block.small, []))[1].append((block.offset, block.size, number))
        return [(segment, small, sorted(blocks, key=lambda b: b[0]))
                for segment, (small, blocks) in sorted(segments.items())]

    def _malloc(self, nbytes, at=None):
        size = max(self.MIN_BLOCK, -(-nbytes // self.MIN_BLOCK) * self.MIN_BLOCK)
        small = size <= self.SMALL
        fits = [b for b in self.free[small] if b.size >= size]
        if fits:
            block = min(fits, key=lambda b: (b.size, b.segment, b.offset))
            self.free[small].remove(block)
        else:
            segment = self.SMALL_SEGMENT if small else (
                self.LARGE_SEGMENT if size < self.MIN_LARGE else -(-size // self.ROUND_LARGE) * self.ROUND_LARGE)
            self.segments += 1
            self.bases[self.segments] = self.BASE + self.reserved
            self.reserved += segment
            block = Block(self.segments, 0, segment, small)
            if self.log is not None:
                self.log.append(("segment_alloc", at, self.bases[self.segments], segment))
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


def cuda_model(trace, log=False):
    """CUDA's caching allocator replayed over a plan's trace. cuBLAS's workspaces are made at the
    first forward and backward, and kept: the peak, in the second step, holds them, and a block
    never freed is reused by nobody, so they go first (storages -1, -2, ..., the trace's first
    entries). log: the model keeps its events (CachingAllocatorModel)."""
    return CachingAllocatorModel(log).replay([(-1 - i, CUBLAS_WORKSPACE_BYTES) for i in range(CUBLAS_WORKSPACES)]
                                             + trace)


GPUS = {"a100": 81_920, "h100": 81_559, "h200": 143_771}  # MiB, as nvidia-smi reports the 80 GB and 141 GB parts


def gpu_bytes(own):
    """The GPU memory to fit in, from --gpu_mem_gib, else --gpu's (None: no question asked)."""
    if own["gpu"] and own["gpu"].lower() not in GPUS:
        configurator.fail(f"unknown --gpu={own['gpu']} (choose one of {', '.join(GPUS)}, or give --gpu_mem_gib)")
    if own["gpu_mem_gib"]:
        return int(float(own["gpu_mem_gib"]) * 2**30)
    return GPUS[own["gpu"].lower()] * 2**20 if own["gpu"] else None
