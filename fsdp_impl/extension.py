"""
FSDP2's all-gather extension (_fsdp_param.py): a parameter whose local tensor defines

    fsdp_pre_all_gather(mesh[, outer_size, outer_stride, module, mp_policy]) -> (inputs, metadata)
    fsdp_post_all_gather(outputs, metadata, param_dtype[, out=]) -> (unsharded, inner tensors)

chooses what is gathered (torchao's float8 weights: one byte an element, and their scale as
metadata) and how the unsharded parameter is rebuilt from the gathered outputs. The first gather
builds it; later ones refill it in place (out=), so the tensors autograd saved stay valid.

Such a parameter keeps its own padded shard, made by its own subclass (new_zeros, narrow) as
FSDP2 makes it: flat_shard cannot hold a subclass. Its inputs join the unit's one all-gather.
"""
import inspect
import math

import torch

from .param import contiguous_stride


def has_extension(tensor):
    """Whether `tensor` defines the extension's hooks; one without the other is refused (FSDP2's type)."""
    pre, post = hasattr(tensor, "fsdp_pre_all_gather"), hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        raise AssertionError("fully_shard: define both fsdp_pre_all_gather and fsdp_post_all_gather for an "
                             f"all-gather extension, not one: {type(tensor).__name__}")
    return pre


class ExtensionParam:
    """One hooked parameter's own state: its padded shard, and from its first gather the outputs
    and the inner tensors of its unsharded form, which a reshard frees and a gather refills."""

    def __init__(self, ps, local, module, mesh, mp_policy, on_host, pin_memory):
        self.module, self.mesh, self.mp = module, mesh, mp_policy
        self.pre_takes_mesh_only = self._signature(local) == 1
        padded_shape = list(ps.shape)
        padded_shape[0] = ps.padded_numel // max(1, math.prod(ps.shape[1:]))
        self.padded_shape = torch.Size(padded_shape)
        self.padded = self._pad(ps, local, on_host, pin_memory)
        self.metadata, self.input_sizes = None, ()
        self.outputs = []  # 1-D, [W * input numel] each, from the first gather on
        self.inner = []  # what fsdp_post_all_gather said the unsharded tensor holds
        self.inner_bytes = []  # their storages' sizes, to give them memory again

    @staticmethod
    def _signature(tensor):
        count = len(inspect.signature(tensor.fsdp_pre_all_gather).parameters)
        if count not in (1, 5):  # (FSDP2's exception type)
            raise AssertionError(f"fsdp_pre_all_gather of {type(tensor).__name__} takes {count} arguments: it takes "
                                 "(mesh) or (mesh, outer_size, outer_stride, module, mp_policy)")
        return count

    def _pad(self, ps, chunk, on_host, pin_memory):
        """This rank's chunk in a zero-padded tensor of the subclass itself (new_zeros keeps it)."""
        padded = chunk.new_zeros(self.padded_shape)
        if chunk.numel():
            padded.narrow(0, 0, chunk.shape[0]).copy_(chunk)
        if on_host and not padded.is_meta:
            padded = padded.cpu()
            if pin_memory:
                padded = padded.pin_memory()
        return padded

    def local(self, ps):
        """The sharded local tensor: the padded one's first rows, this rank's own."""
        self.held = self.padded.narrow(0, 0, ps.local_shape[0])
        return self.held

    def adopt(self, ps, local, on_host, pin_memory):
        """A new local tensor (to_empty, load_state_dict(assign=True)): padded again, as FSDP2 does."""
        self.padded = self._pad(ps, local, on_host, pin_memory)
        return self.local(ps)

    @torch.no_grad()
    def inputs(self, ps, local, device):
        """The hook's all-gather inputs, flattened (uneven shards: each of the padded size)."""
        if local.device != device:  # offloaded
            local = local.to(device, non_blocking=True)
        if self.pre_takes_mesh_only:
            inputs, self.metadata = local.fsdp_pre_all_gather(self.mesh)
        else:
            inputs, self.metadata = local.fsdp_pre_all_gather(self.mesh, ps.shape, contiguous_stride(ps.shape),
                                                              self.module, self.mp)
            if local.shape != self.padded_shape and any(t.shape != self.padded_shape for t in inputs):
                raise AssertionError(  # (FSDP2's type; only ranks with padding see it)
                    f"fsdp_pre_all_gather of an unevenly sharded {tuple(ps.shape)} parameter returned "
                    f"{[tuple(t.shape) for t in inputs]}: return inputs of the padded size {tuple(self.padded_shape)}")
        self.input_sizes = [t.shape for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def output_views(self, world, dtypes, device):
        """Where the copy-out writes this parameter's gathered inputs: [W, numel] each, given memory."""
        if not self.outputs:
            self.outputs = [torch.empty(world * math.prod(size), dtype=dtype, device=device)
                            for size, dtype in zip(self.input_sizes, dtypes)]
        for t in self.outputs:
            if t.untyped_storage().nbytes() == 0:
                t.untyped_storage().resize_(t.numel() * t.itemsize)
        return [t.view(world, -1) for t in self.outputs]

    def unsharded(self, ps, param_dtype, param):
        """Run fsdp_post_all_gather: the unsharded tensor, the first time; after, a refill of `param`."""
        outputs = tuple(t.view(-1, *size[1:]) for t, size in zip(self.outputs, self.input_sizes))
        dtype = param_dtype or ps.dtype
        if param is not None:
            for t, nbytes in zip(self.inner, self.inner_bytes):
                if t.untyped_storage().nbytes() == 0:
                    t.untyped_storage().resize_(nbytes)
            self.sharded_local_of(ps).fsdp_post_all_gather(outputs, self.metadata, dtype, out=param)
            self.metadata = None
            return None
        tensor, self.inner = self.sharded_local_of(ps).fsdp_post_all_gather(outputs, self.metadata, dtype)
        self.inner_bytes = [t.untyped_storage().nbytes() for t in self.inner]
        self.metadata = None
        return torch.as_strided(tensor, ps.shape, contiguous_stride(ps.shape), 0)

    @staticmethod
    def sharded_local_of(ps):
        return ps.sharded._local_tensor

    def free(self):
        for t in (*self.outputs, *self.inner):
            t.untyped_storage().resize_(0)
