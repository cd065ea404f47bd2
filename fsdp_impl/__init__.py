"""Our fully sharded data parallel (ZeRO-3), with FSDP2's API. See IMPLEMENTATION.md."""
from .api import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                  register_fsdp_forward_method)

__all__ = ["fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
           "register_fsdp_forward_method"]
