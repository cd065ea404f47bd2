"""
Layout: where a unit's parameters sit in its two flat buffers (FSDP2's, from _fsdp_param.py and
_fsdp_collectives.py, so the same arithmetic gives the same bits). W ranks, rank r:

    flat_shard   [S]        this rank's chunk of every parameter, back to back (along dim 0, padded
                            to ceil(dim0/W) rows, or along the dim shard_placement_fn asks for). The
                            sharded parameters view it, so the optimizer updates it in place, and it
                            is the all-gather's input. With parameters of several dtypes: bytes.
    all-gather   [W, S]     rank-major, as the collective writes it; copied out once into
    flat_full    [W * S]    parameter-major: each parameter's full (padded) tensor is contiguous, and
                            the unsharded parameters view it. One sharded on dim d > 0 arrives as its
                            chunks stacked on dim 0, concatenated along d by the copy-out.

With one rank the shard already has the full layout: the all-gather copies it into flat_full.
Resharded after forward to groups of G ranks, rank r keeps piece r % G of each padded full tensor.
"""
import math

import torch


def typed_view(flat, start, numel, dtype):
    """`numel` elements of `dtype` from element `start` of a flat buffer: flat's own elements, or,
    for a parameter of another dtype in a byte buffer, its bytes viewed as that dtype."""
    if flat.dtype == dtype:
        return flat[start:start + numel]
    return flat[start:start + numel * dtype.itemsize].view(dtype)


class Layout:
    """Places in flat_shard from fully_shard on; in the gather's buffer and flat_full from lazy init."""

    def __init__(self, params, world, post_forward_size=None):
        self.params, self.world, self.post_forward_size = params, world, post_forward_size
        self.lay_out_shard([ps.dtype for ps in params])

    def lay_out_shard(self, dtypes):
        """Each parameter's `offset` and `slot` in flat_shard's elements; of several dtypes (LoRA's), in
        bytes, each place 16-byte aligned so that it views as its own dtype."""
        self.mixed = mixed = len(set(dtypes)) > 1
        self.dtype = torch.uint8 if mixed else dtypes[0] if dtypes else torch.float32
        offset = 0
        for ps, dtype in zip(self.params, dtypes):
            ps.dtype, ps.offset = dtype, -(-offset // 16) * 16 if mixed else offset
            ps.slot = ps.padded_numel * dtype.itemsize if mixed else ps.padded_numel
            offset = ps.offset + ps.slot
        self.shard_numel = offset

    def local_view(self, flat, ps):
        """Parameter ps's shard in a flat shard: its local tensor."""
        return typed_view(flat, ps.offset, ps.local_numel, ps.dtype).view(ps.local_shape)

    def lay_out_gather(self, param_dtype):
        """The gather's dtypes and places: param_dtype for floating point parameters, else their own.
        One gather dtype over a shard of several: their casts packed into a buffer (`repack`);
        several: flat_shard's bytes."""
        for ps in self.params:
            ps.gather_dtype = param_dtype if param_dtype is not None and ps.dtype.is_floating_point else ps.dtype
        gather_dtypes = {ps.gather_dtype for ps in self.params}
        self.repack = self.mixed and len(gather_dtypes) == 1
        self.gather_dtype = gather_dtypes.pop() if len(gather_dtypes) == 1 else torch.uint8
        self.gather_numel = 0
        for ps in self.params:
            ps.gather_offset, ps.gather_slot = ((self.gather_numel, ps.padded_numel) if self.repack
                                                else (ps.offset, ps.slot))
            self.gather_numel = ps.gather_offset + ps.gather_slot

    def views_of(self, flat_full):
        """Each parameter's full tensor in flat_full; also the places the copy-out fills: each
        parameter's padded full tensor as [W, its slot], and the alignment gaps of a byte buffer."""
        self.slots, self.full_slots, cursor = [], [], 0
        self.cat_slots = []  # (index in slots, parameter) of those sharded on dim > 0
        for ps in self.params:
            gap = ((cursor, ps.gather_offset - cursor),) if ps.gather_offset > cursor else ()
            for start, size in gap + ((ps.gather_offset, ps.gather_slot),):
                self.slots.append(size)
                self.full_slots.append(flat_full[start * self.world:(start + size) * self.world].view(self.world, -1))
            if ps.dim:
                self.cat_slots.append((len(self.slots) - 1, ps))
            cursor = ps.gather_offset + ps.gather_slot
        if self.post_forward_size:  # each of them cut in that many pieces: a rank keeps one after forward
            self.group_slots = [slot * self.world // self.post_forward_size for slot in self.slots]
            self.group_full_slots = [full.view(self.post_forward_size, -1) for full in self.full_slots]
        return [typed_view(flat_full, ps.gather_offset * self.world, math.prod(ps.shape), ps.gather_dtype).view(ps.shape)
                for ps in self.params]

    def gather_input(self, flat_shard, device):
        """What the all-gather sends: flat_shard itself, or each parameter's shard cast into its place
        in a buffer of the gather's dtype (repack: the padding is never read), or flat_shard cast."""
        if self.repack:
            shard = torch.empty(self.gather_numel, dtype=self.gather_dtype, device=device)
            torch._foreach_copy_([shard[ps.gather_offset:ps.gather_offset + ps.local_numel] for ps in self.params],
                                 [ps.sharded._local_tensor.view(-1) for ps in self.params], non_blocking=True)
            return shard
        if self.world > 1 and (flat_shard.dtype != self.gather_dtype or flat_shard.device != device):
            return flat_shard.to(device, self.gather_dtype, non_blocking=True)
        return flat_shard

    def group_piece(self, rank):
        """This rank's piece of flat_full over the smaller group it reshards to after forward."""
        return torch.cat([full[rank] for full in self.group_full_slots])

    def copy_out(self, output, in_group, extra_sizes=(), extra_out=()):
        """The rank-major all-gather output into flat_full's places, then into `extra_out` ([W, size]
        each: the extension's inputs, gathered after flat_full's, in bytes if of other dtypes). A
        parameter sharded on dim d > 0 arrives as its chunks: into a temporary, then concatenated along d."""
        if in_group:  # rank-major over the smaller group: each piece into its place
            torch.split_with_sizes_copy(output.view(self.post_forward_size, -1), self.group_slots, dim=1,
                                        out=self.group_full_slots)
            return
        out, sizes = self.full_slots, self.slots
        if self.cat_slots:
            out = list(out)
            for i, _ in self.cat_slots:
                out[i] = torch.empty_like(out[i])
        if extra_out:
            if output.dtype != self.gather_dtype:  # gathered as bytes
                out, sizes = [o.view(output.dtype) for o in out], [s * self.gather_dtype.itemsize for s in sizes]
            out, sizes = [*out, *extra_out], [*sizes, *extra_sizes]
        torch.split_with_sizes_copy(output.view(self.world, -1), sizes, dim=1, out=out)
        for i, ps in self.cat_slots:
            chunks = out[i].view(ps.gather_dtype).view(self.world, *ps.local_shape).unbind()
            torch.cat(chunks, dim=ps.dim, out=self.full_slots[i].view(ps.gather_dtype).view(ps.shape))
