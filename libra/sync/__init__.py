"""Weight publication from the trainer to rollout instances.

Owns resharding: the per-rank layouts of Megatron (TP, PP) and vLLM (TP) as block stacks
(`layouts`), transfer plans between them computed by the C++ core in `libra._native`
(`plan`), and their multi-threaded executor into flat, bucketed buffers (`executor`).
Transports (shared memory, collectives) come later and build on these.
"""

from libra.sync.config import SyncConfig
from libra.sync.executor import execute
from libra.sync.layouts import (
    Block,
    DestLayout,
    ModelShape,
    ShardParam,
    SourceKey,
    SourceLayout,
    logical_tensors,
    megatron_layout,
    megatron_vocab_size,
    vllm_layout,
    vllm_vocab_size,
)
from libra.sync.plan import BucketSlice, ParamSlot, TransferPlan, build_transfer_plan

__all__ = [
    "Block",
    "BucketSlice",
    "DestLayout",
    "ModelShape",
    "ParamSlot",
    "ShardParam",
    "SourceKey",
    "SourceLayout",
    "SyncConfig",
    "TransferPlan",
    "build_transfer_plan",
    "execute",
    "logical_tensors",
    "megatron_layout",
    "megatron_vocab_size",
    "vllm_layout",
    "vllm_vocab_size",
]
