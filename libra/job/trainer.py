"""The controller's handle on the train ranks: every call goes to every rank, in the same order,
concurrently (the ranks' collectives must line up), and the ranks must agree on the result."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from libra.control.auth import open_channel
from libra.control.config import ControlConfig
from libra.sync.load_request import LoadRequest
from libra.sync.wire import load_request_from_proto
from libra.training.engine import StepResult
from libra.training.worker import trajectory_to_proto
from libra.trajectory import TOOL_TOKEN_VERSION, Trajectory
from libra.v1 import training_pb2, training_pb2_grpc


@dataclass(frozen=True)
class PublishedVersion:
    version: int
    loads: dict[int, LoadRequest]
    """What an instance of each rollout TP size loads."""
    gather_seconds: float
    publish_seconds: float


@dataclass(frozen=True)
class LogprobGap:
    """The train/inference gap: per-token |rollout logprob - trainer logprob| under the same weights."""

    mean: float
    max: float
    num_tokens: int
    num_trajectories: int


def measure_logprob_gap(
    trainer: TrainRanks, batch: Sequence[Trajectory], version: int, max_trajectories: int = 8
) -> LogprobGap:
    """Compares the rollout logprobs of up to `max_trajectories` trajectories of `batch` whose
    sampled tokens all came from `version` with the trainer's logprobs of the same tokens. Call it
    while the trainer runs `version` (before the step's update): then both sides computed with the
    same weights, and the gap is float rounding (fp32 on the CPU) unless publication delivered
    other weights. NaN and zero counts when no trajectory of the batch qualifies."""
    sample = [t for t in batch if _sampled_versions(t) == {version}][:max_trajectories]
    if not sample:
        return LogprobGap(float("nan"), float("nan"), 0, 0)
    diffs = [
        abs(rollout - trainer_lp)
        for t, row in zip(sample, trainer.compute_logprobs(sample), strict=True)
        for mask, rollout, trainer_lp in zip(t.loss_mask, t.rollout_logprobs, row, strict=True)
        if mask
    ]
    if not diffs:
        return LogprobGap(float("nan"), float("nan"), 0, len(sample))
    return LogprobGap(sum(diffs) / len(diffs), max(diffs), len(diffs), len(sample))


def _sampled_versions(t: Trajectory) -> set[int]:
    return {v for v in t.policy_versions if v != TOOL_TOKEN_VERSION}


class TrainRanks:
    def __init__(
        self, addresses: Sequence[str], token: str, control: ControlConfig, timeout_s: float = 600.0
    ):
        self._channels = [open_channel(a, token, control) for a in addresses]
        self._stubs = [training_pb2_grpc.TrainRankStub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(len(self._stubs), thread_name_prefix="libra-train-call")
        self._timeout = timeout_s

    def _call_all(self, method: str, request) -> list:
        futures = [self._pool.submit(getattr(s, method), request, timeout=self._timeout) for s in self._stubs]
        return [f.result() for f in futures]

    def train_step(self, trajectories: Sequence[Trajectory]) -> StepResult:
        request = training_pb2.TrainStepRequest(trajectories=[trajectory_to_proto(t) for t in trajectories])
        replies = self._call_all("TrainStep", request)
        if len({r.version for r in replies}) != 1:
            raise RuntimeError(
                f"train ranks disagree on the version after a step: {[r.version for r in replies]}"
            )
        return StepResult(**{f.name: getattr(replies[0], f.name) for f in dataclasses.fields(StepResult)})

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Per-token logprobs of each response under the trainer's current weights."""
        request = training_pb2.ComputeLogprobsRequest(
            trajectories=[trajectory_to_proto(t) for t in trajectories]
        )
        return [list(row.logprobs) for row in self._call_all("ComputeLogprobs", request)[0].trajectories]

    def publish_weights(
        self, version: int, tp_sizes: Sequence[int], release_versions: Sequence[int] = ()
    ) -> PublishedVersion:
        """Publishes the trainer's weights of `version` for rollout instances of each TP size in
        `tp_sizes` (every rank takes part; the publishing rank answers with the load requests),
        after freeing the buffers of `release_versions`."""
        request = training_pb2.PublishWeightsRequest(
            version=version, tp_sizes=sorted(set(tp_sizes)), release_versions=list(release_versions)
        )
        replies = self._call_all("PublishWeights", request)
        published = [r for r in replies if r.publisher]
        if len(published) != 1:
            raise RuntimeError(f"{len(published)} train ranks published version {version}, expected one")
        reply = published[0]
        loads = {load.tp_size: load for load in (load_request_from_proto(m) for m in reply.loads)}
        if sorted(loads) != sorted(set(tp_sizes)):
            raise RuntimeError(
                f"version {version} was published for TP {sorted(loads)}, asked for {tp_sizes}"
            )
        return PublishedVersion(reply.version, loads, reply.gather_seconds, reply.publish_seconds)

    def save_checkpoint(self, directory: str) -> int:
        return self._call_all("SaveCheckpoint", training_pb2.CheckpointRequest(directory=directory))[
            0
        ].version

    def load_checkpoint(self, directory: str) -> int:
        return self._call_all("LoadCheckpoint", training_pb2.CheckpointRequest(directory=directory))[
            0
        ].version

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in self._channels:
            c.close()
