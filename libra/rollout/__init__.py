"""Rollout: vLLM instances behind a token-in/token-out gRPC service (`instance_server`, `engine`;
they also load published weight versions, `libra.sync`), the controller's view of them grouped
into TP buckets (`pool`, which follows the controller's worker events to mark dead instances lost
at once), and the multi-turn agent loop with its chat format and tools (`agent_loop`, `chat`,
`tools/`), and the plan executor's hold on the pool (`plan_control`: drain, cut, restore, add).
Routing policy comes from `libra.scheduler` through its `Router` interface. vLLM is imported only
inside instance processes.
"""

from libra.rollout.agent_loop import AgentLoop, CallRecord
from libra.rollout.chat import ChatFormat, ToolCallError
from libra.rollout.client import InstanceClient, InstanceUnavailable
from libra.rollout.config import AgentLoopConfig, InstanceConfig, RolloutConfig
from libra.rollout.pool import InstancePool
from libra.rollout.types import Chunk, FinishReason, InstanceStats, PauseMode, SamplingSpec, Segment

__all__ = [
    "AgentLoop",
    "AgentLoopConfig",
    "CallRecord",
    "ChatFormat",
    "Chunk",
    "FinishReason",
    "InstanceClient",
    "InstanceConfig",
    "InstancePool",
    "InstanceStats",
    "InstanceUnavailable",
    "PauseMode",
    "RolloutConfig",
    "SamplingSpec",
    "Segment",
    "ToolCallError",
]
