"""Training: one Megatron-core rank per worker process.

Owns building a Megatron `GPTModel` from a Hugging Face config (`model`), HF <-> Megatron weight
conversion for any TP/PP (`hf_weights`), process-group setup from the plan (`parallel`), the GRPO
advantages and loss (`grpo`), the bounded-staleness gate (`staleness`), token-balanced
micro-batches (`batching`), the rank engine (`engine`: logprobs, train step, checkpoints, export)
and its gRPC service (`worker`, `python -m libra.training.worker`), and the elastic hybrid pool:
its join/release protocol as a pure state machine with the limits the planner is told
(`elastic`), the core rank's lane (`hybrid`) and the hybrid replica's process (`hybrid_worker`).
Shares only `Trajectory` with rollout.
"""

from libra.training.config import GrpoConfig, TrainingConfig

__all__ = ["GrpoConfig", "TrainingConfig"]
