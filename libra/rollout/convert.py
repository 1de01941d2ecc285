"""Protobuf ↔ rollout dataclasses, at the edge of the RolloutInstance service."""

from __future__ import annotations

from libra.control.convert import InvalidArgument
from libra.rollout.types import Chunk, FinishReason, InstanceStats, PauseMode, SamplingSpec
from libra.v1 import rollout_pb2


def sampling_to_proto(spec: SamplingSpec) -> rollout_pb2.SamplingParams:
    msg = rollout_pb2.SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_tokens=spec.max_tokens,
        stop_token_ids=list(spec.stop_token_ids),
        ignore_eos=spec.ignore_eos,
    )
    if spec.seed is not None:
        msg.seed = spec.seed
    return msg


def sampling_from_proto(msg: rollout_pb2.SamplingParams) -> SamplingSpec:
    try:
        return SamplingSpec(
            temperature=msg.temperature,
            top_p=msg.top_p or 1.0,
            top_k=msg.top_k,
            max_tokens=msg.max_tokens,
            stop_token_ids=tuple(msg.stop_token_ids),
            seed=msg.seed if msg.HasField("seed") else None,
            ignore_eos=msg.ignore_eos,
        )
    except ValueError as e:
        raise InvalidArgument(f"sampling: {e}") from None


def chunk_to_proto(chunk: Chunk) -> rollout_pb2.GenerateChunk:
    return rollout_pb2.GenerateChunk(
        token_ids=chunk.token_ids,
        logprobs=chunk.logprobs,
        weight_version=chunk.weight_version,
        finish_reason=int(chunk.finish_reason),
        stop_token_id=chunk.stop_token_id,
    )


def chunk_from_proto(msg: rollout_pb2.GenerateChunk) -> Chunk:
    return Chunk(
        token_ids=list(msg.token_ids),
        logprobs=list(msg.logprobs),
        weight_version=msg.weight_version,
        finish_reason=FinishReason(msg.finish_reason),
        stop_token_id=msg.stop_token_id,
    )


def pause_mode_from_proto(value: int) -> PauseMode:
    if value == rollout_pb2.PAUSE_MODE_UNSPECIFIED:
        return PauseMode.KEEP
    try:
        return PauseMode(value)
    except ValueError:
        raise InvalidArgument(f"mode: unknown pause mode {value}") from None


def stats_to_proto(stats: InstanceStats) -> rollout_pb2.InstanceStats:
    return rollout_pb2.InstanceStats(**vars(stats))


def stats_from_proto(msg: rollout_pb2.InstanceStats) -> InstanceStats:
    return InstanceStats(**{name: getattr(msg, name) for name in InstanceStats.__dataclass_fields__})
