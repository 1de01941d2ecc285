"""The controller's handle on the train ranks: every call goes to every rank, in the same order,
concurrently (the ranks' collectives must line up), and the ranks must agree on the result."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from libra.config import ControlConfig
from libra.control.auth import open_channel
from libra.training.worker import trajectory_to_proto
from libra.trajectory import Trajectory
from libra.v1 import training_pb2, training_pb2_grpc


@dataclass(frozen=True)
class TrainStepStats:
    version: int
    loss: float
    pg_loss: float
    entropy: float
    clip_fraction: float
    grad_norm: float
    num_tokens: int
    num_trajectories: int
    num_dropped_stale: int


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

    def train_step(self, trajectories: Sequence[Trajectory]) -> TrainStepStats:
        request = training_pb2.TrainStepRequest(trajectories=[trajectory_to_proto(t) for t in trajectories])
        replies = self._call_all("TrainStep", request)
        if len({r.version for r in replies}) != 1:
            raise RuntimeError(
                f"train ranks disagree on the version after a step: {[r.version for r in replies]}"
            )
        r = replies[0]
        return TrainStepStats(
            r.version,
            r.loss,
            r.pg_loss,
            r.entropy,
            r.clip_fraction,
            r.grad_norm,
            r.num_tokens,
            r.num_trajectories,
            r.num_dropped_stale,
        )

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Per-token logprobs of each response under the trainer's current weights."""
        request = training_pb2.ComputeLogprobsRequest(
            trajectories=[trajectory_to_proto(t) for t in trajectories]
        )
        return [list(row.logprobs) for row in self._call_all("ComputeLogprobs", request)[0].trajectories]

    def export_weights(self) -> tuple[int, bytes]:
        """The full HF state dict (safetensors bytes) and its version. Every rank takes part in the
        gather; rank 0's copy is returned."""
        replies = self._call_all("ExportWeights", training_pb2.ExportWeightsRequest())
        return replies[0].version, replies[0].safetensors

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
