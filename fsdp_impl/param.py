"""
The two forms of one managed parameter, split by lifetime (FSDP2's FSDPParam, _fsdp_param.py):

    ParamShard       from fully_shard on: where the modules register it, its chunk and places in
                     the flat buffers, and its sharded nn.Parameter(DTensor) viewing flat_shard
    UnshardedParam   from the first forward on: the nn.Parameter viewing flat_full, and its grads

A tensor parallel parameter is sharded by its local tensor, as FSDP2 does: its sharded DTensor
spans the dp and tp dims, its unsharded one the tp dims.
"""
import math

import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def same_storage(a, b):
    """Whether tensors a and b view one storage. By the storage object, not its address: two
    storages without memory (empty, or fake tensors') both report address 0."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def local_tensor(param):
    """What the dp group shards: a tensor parallel parameter's local tensor, else the parameter."""
    return param._local_tensor if isinstance(param, DTensor) else param


def contiguous_stride(shape):
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def dtensor_around(local, mesh, placements, shape, stride):
    """A DTensor whose local tensor is `local` itself, wherever it lives, as FSDP2 builds them:
    from_local would copy an offloaded shard to the GPU, and the optimizer would update the copy."""
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


class ParamShard:
    """One managed parameter, for the unit's whole life. Of a tensor parallel parameter, `shape` is
    its local tensor's; `global_shape` the whole parameter's."""
    __slots__ = ("registrations", "tp_spec", "shape", "dim", "first", "padded_numel", "local_shape", "local_numel",
                 "stride", "dtype", "offset", "slot", "gather_dtype", "gather_offset", "gather_slot", "mesh",
                 "placements", "global_shape", "sharded", "unsharded", "requires_grad", "extension")  # (no field added elsewhere)

    def __init__(self, registrations, param, world, rank, mesh, placements, dim):
        self.registrations = registrations  # [(module, attribute name)], several when tied
        self.tp_spec = param._spec if isinstance(param, DTensor) else None
        self.shape = local_tensor(param).shape  # what the dp group shards
        self.dim = dim  # this rank holds torch.chunk(tensor, W, dim)[rank] (only dim 0 may split unevenly)
        size = math.ceil(self.shape[dim] / world)  # torch.chunk's length per rank (FSDP2's too)
        self.first = rank * size  # this rank's first index along dim
        padded, local = list(self.shape), list(self.shape)
        padded[dim], local[dim] = size, max(0, min(size, self.shape[dim] - self.first))
        self.padded_numel = math.prod(padded)
        self.local_shape = tuple(local)
        self.local_numel = math.prod(local)
        self.stride = contiguous_stride(self.local_shape)  # the local tensor's, and its grad's
        self.dtype = param.dtype  # its own; Layout.lay_out_shard may change it (module.to(dtype))
        self.offset = self.slot = None  # its place in flat_shard, in flat_shard's elements (Layout)
        self.gather_dtype = self.gather_offset = self.gather_slot = None  # in the gather's buffer (Layout)
        self.mesh, self.placements = mesh, placements  # of the sharded DTensor
        self.global_shape = param.shape  # a DTensor's: the whole parameter's, over every mesh dim
        self.sharded = None  # nn.Parameter(DTensor)
        self.unsharded = None  # UnshardedParam
        self.requires_grad = param.requires_grad  # as last seen on both parameter objects
        self.extension = None  # ExtensionParam, when its local tensor has the all-gather hooks

    def as_sharded(self, local):
        """The sharded DTensor whose local tensor is `local`, this rank's chunk."""
        return dtensor_around(local, self.mesh, self.placements, self.global_shape, contiguous_stride(self.global_shape))

    def chunk_of(self, tensor):
        """This rank's chunk of the full `tensor` (empty where the ranks before took it all). narrow,
        not indexing: a whole-tensor index is an alias, which drops a tensor subclass (float8's weights)."""
        start = min(self.first, tensor.shape[self.dim])
        return tensor.narrow(self.dim, start, self.local_shape[self.dim])


class UnshardedParam:
    """A parameter's gathered form, from lazy init on: `param`, viewing flat_full (over the tp mesh
    for a tensor parallel one), which forward and backward see, and its grads until reduced."""

    def __init__(self, view, ps):
        self.tp_spec = ps.tp_spec
        if self.tp_spec:  # the local tensor gathered over dp, placed over tp as before sharding
            view = dtensor_around(view, self.tp_spec.mesh, self.tp_spec.placements, ps.global_shape,
                                  contiguous_stride(ps.global_shape))
        self.param = nn.Parameter(view, requires_grad=ps.requires_grad)
        self.accumulated_grad = None  # reduce_dtype sum kept while gradient sync is off

    def local_grad(self):
        """This backward's grad as a plain tensor (None if none). A tensor parallel one is first
        placed as its parameter (a Partial sum reduced over tp, say), as FSDP2 does."""
        grad = self.param.grad
        if grad is None or self.tp_spec is None:
            return grad
        if grad.placements != self.tp_spec.placements:
            grad = grad.redistribute(placements=self.tp_spec.placements)
        return grad._local_tensor

    def take_grad(self):
        """The grad to reduce: the kept sum, or this backward's grad; the parameter holds none after."""
        grad = self.accumulated_grad if self.accumulated_grad is not None else self.local_grad()
        self.accumulated_grad = None
        self.drop_grad()
        return grad

    def drop_grad(self):
        """The parameter holds no grad after. The old one is freed once .grad reads None: freed inside
        the setter, an allocator's callback (plan.py's counter) would read a half-set grad and crash."""
        old, self.param.grad = self.param.grad, None
        del old

    def has_grad(self):
        return self.param.grad is not None or self.accumulated_grad is not None
