"""Protobuf ↔ rollout dataclasses, at the edge of the RolloutInstance service."""

from __future__ import annotations

from libra.control.convert import InvalidArgument
from libra.rollout.types import Chunk, FinishReason, InstanceStats, PauseMode, SamplingSpec
from libra.sync import wire
from libra.sync.instance_update import LoadResult
from libra.sync.load_request import LoadRequest
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


def load_request_to_proto(request: LoadRequest) -> rollout_pb2.LoadWeightsRequest:
    return rollout_pb2.LoadWeightsRequest(load=wire.load_request_to_proto(request))


def load_request_from_proto(msg: rollout_pb2.LoadWeightsRequest) -> LoadRequest:
    if not msg.HasField("load"):
        raise InvalidArgument("load must be set")
    try:
        return wire.load_request_from_proto(msg.load)
    except ValueError as e:
        raise InvalidArgument(f"load: {e}") from None


def load_result_to_proto(result: LoadResult) -> rollout_pb2.LoadWeightsReply:
    return rollout_pb2.LoadWeightsReply(
        ok=result.ok,
        error=result.error,
        weight_version=result.version,
        stage_seconds=result.stage_seconds,
        commit_seconds=result.commit_seconds,
        seconds=result.seconds,
        num_preempted=result.num_preempted,
    )


def load_result_from_proto(msg: rollout_pb2.LoadWeightsReply) -> LoadResult:
    return LoadResult(
        ok=msg.ok,
        version=msg.weight_version,
        error=msg.error,
        stage_seconds=msg.stage_seconds,
        commit_seconds=msg.commit_seconds,
        seconds=msg.seconds,
        num_preempted=msg.num_preempted,
    )
