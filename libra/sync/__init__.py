"""Weight publication from the trainer to rollout instances.

Owns resharding: the per-rank layouts of Megatron (TP, PP) and vLLM (TP) as block stacks
(`layouts`), transfer plans between them computed by the C++ core in `libra._native`
(`plan`), and their multi-threaded executor into flat, bucketed buffers (`executor`).
Publication builds on them: the publisher writes each destination rank's buffer straight into a
transport's memory with a manifest of per-bucket checksums (`publisher`, `transport`); the
transports are shared memory (`shm`), a torch.distributed group (`collective`) and chunked gRPC
(`grpc_stream`); a vLLM worker extension stages, verifies and commits a version between turns,
never half-loaded (`vllm_loader`, driven by `instance_update`); the controller's `versions`
ledger tracks which version each instance runs and retries failed loads.
Inside the trainer, `trainer_publisher` gathers the ranks' shards to the publishing rank and owns
the publisher; what an instance loads is a typed `LoadRequest` (`load_request`), carried over
gRPC as `libra.v1.VersionLoad` (`wire`).
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
from libra.sync.load_request import LoadRequest, RankLoad
from libra.sync.plan import BucketSlice, ParamSlot, TransferPlan, build_transfer_plan
from libra.sync.publisher import Publication, WeightPublisher
from libra.sync.transport import BufferManifest, TransferError, WeightReceiver, WeightSender
from libra.sync.versions import VersionLedger

__all__ = [
    "Block",
    "BucketSlice",
    "BufferManifest",
    "DestLayout",
    "LoadRequest",
    "ModelShape",
    "ParamSlot",
    "Publication",
    "RankLoad",
    "ShardParam",
    "SourceKey",
    "SourceLayout",
    "SyncConfig",
    "TransferError",
    "TransferPlan",
    "VersionLedger",
    "WeightPublisher",
    "WeightReceiver",
    "WeightSender",
    "build_transfer_plan",
    "execute",
    "logical_tensors",
    "megatron_layout",
    "megatron_vocab_size",
    "vllm_layout",
    "vllm_vocab_size",
]
