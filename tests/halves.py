"""
Tensor subclasses with FSDP2's all-gather hooks, the smallest that FSDP2 trains, for
tests/extension_worker.py and tests/reshard_worker.py. Halves gathers a float32 weight exactly, as
the high and low 16 bits of each element: two inputs of two dtypes (bfloat16 and int16).
"""
import math

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

aten = torch.ops.aten
KEEP = {aten.detach.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
        aten.as_strided.default, aten._to_copy.default, aten.split.Tensor, aten.clone.default,
        aten.empty_like.default}  # the ops whose results stay Halves: FSDP2 pads, chunks and views with them


class Wrapped(torch.Tensor):
    """A float32 tensor wrapped: ops run on its data, and those in KEEP stay wrapped."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = pytree.tree_map_only(Wrapped, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, cls, out) if func in KEEP else out


class Halves(Wrapped):
    """A float32 weight that FSDP2 gathers as two 16-bit halves of its bits, and rebuilds exactly."""

    def split_bits(self, rows):
        bits = F.pad(self._data, (0, 0, 0, rows - self._data.shape[0])).view(torch.int32)
        return (bits >> 16).to(torch.int16).view(torch.bfloat16), (bits & 0xFFFF).to(torch.int16)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = math.ceil(outer_size[0] / mesh.size())  # uneven shards: inputs of the padded size
        return self.split_bits(rows), ("halves", tuple(outer_size))

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        high, low = outputs
        assert metadata[0] == "halves" and high.dtype == torch.bfloat16 and low.dtype == torch.int16, metadata
        bits = (high.view(torch.int16).to(torch.int32) << 16) | (low.to(torch.int32) & 0xFFFF)
        full = bits.view(torch.float32).to(param_dtype)
        if out is not None:  # a refill: autograd saved `out` in forward, so its version must not change
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(full[:out.shape[0]])
            return None
        return full, (full,)


class HalvesMeshOnly(Halves):
    """The hook's older signature, mesh only (torchao's float8 takes it too); even shards only."""

    def fsdp_pre_all_gather(self, mesh):
        return self.split_bits(self._data.shape[0]), ("halves",)


class HalvesUnpadded(Halves):
    """Returns an unevenly sharded weight's inputs unpadded: refused, on the ranks with padding."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return self.split_bits(self._data.shape[0]), ("halves",)


class PreOnly(Wrapped):
    """Defines one hook of the two."""

    def fsdp_pre_all_gather(self, mesh):
        raise AssertionError("never called")


class Whole(Wrapped):
    """One input, the data itself (as torchao's float8 has one)."""

    def fsdp_pre_all_gather(self, mesh):
        return (self._data,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:  # refilled by the copy-out already: it is the output itself
            return None
        return outputs[0], outputs
