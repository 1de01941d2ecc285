"""The train rank's gRPC service (`TrainRank`) and its process entry point.

    python -m libra.training.worker --spec JSON        (a `TrainRankSpec`: `spec.to_argv()`)

One process hosts one Megatron rank; global rank 0 also publishes the weights to rollout instances
(`PublishWeights`, `libra.sync.trainer_publisher`). The controller calls every rank of the job with the same
requests in the same order; a lock serialises calls inside a rank, because the engine's
collectives must line up across ranks. Trajectories are converted from proto once, here.
The bearer token comes from LIBRA_TOKEN.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from libra.backends.config import BackendConfig
from libra.control.config import ControlConfig
from libra.control.convert import InvalidArgument
from libra.control.server import rpc_errors
from libra.launch_spec import ArgvSpec
from libra.logs import configure_logging
from libra.model_spec import ModelSpec
from libra.sync.config import SyncConfig
from libra.sync.layouts import ModelShape
from libra.sync.trainer_publisher import SourceRank, TrainerPublisher
from libra.training.config import TrainingConfig
from libra.training.elastic import ElasticConfig
from libra.trajectory import TOOL_TOKEN_VERSION, Trajectory


@dataclass(frozen=True)
class TrainRankSpec(ArgvSpec):
    """How to start one train rank. The layout is `training`'s parallel sizes (world size: their
    product); the rank serves its gRPC service with `control`'s settings, TLS among them."""

    module = "libra.training.worker"
    hf_model: str
    """HF model folder (config.json + safetensors) the rank loads."""
    rank: int
    master_port: int
    training: TrainingConfig
    master_addr: str = "127.0.0.1"
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight publication (rank 0 publishes)."""
    backend: BackendConfig = field(default_factory=BackendConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    host: str = "127.0.0.1"
    port: int = 0
    """0: any free port (see `port_file`)."""
    port_file: str | None = None
    """Written with the bound port once serving."""
    elastic: ElasticConfig | None = None
    """Host a lane of the elastic hybrid pool (PP=1 only)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.training.world_size:
            raise ValueError(f"rank must be in 0..{self.training.world_size - 1}, got {self.rank}")


def trajectory_from_proto(msg) -> Trajectory:
    t = Trajectory(
        trajectory_id=msg.trajectory_id,
        prompt_id=msg.group_id,
        group_id=msg.group_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        response_token_ids=list(msg.response_token_ids),
        loss_mask=list(msg.loss_mask),
        rollout_logprobs=list(msg.rollout_logprobs),
        policy_versions=list(msg.policy_versions),
        reward=msg.reward if msg.has_reward else None,
    )
    n = len(t.response_token_ids)
    if not (len(t.loss_mask) == len(t.rollout_logprobs) == len(t.policy_versions) == n):
        raise InvalidArgument(
            f"trajectories[{msg.trajectory_id}]: {n} response tokens, {len(t.loss_mask)} loss_mask, "
            f"{len(t.rollout_logprobs)} rollout_logprobs, {len(t.policy_versions)} policy_versions"
        )
    if any(v < TOOL_TOKEN_VERSION for v in t.policy_versions):
        raise InvalidArgument(f"trajectories[{msg.trajectory_id}].policy_versions has values below -1")
    return t


def trajectory_to_proto(t: Trajectory):
    from libra.v1 import training_pb2

    return training_pb2.TrainTrajectory(
        trajectory_id=t.trajectory_id,
        group_id=t.group_id,
        prompt_token_ids=t.prompt_token_ids,
        response_token_ids=t.response_token_ids,
        loss_mask=t.loss_mask,
        rollout_logprobs=t.rollout_logprobs,
        policy_versions=t.policy_versions,
        reward=t.reward or 0.0,
        has_reward=t.reward is not None,
    )


class TrainRankServicer:
    def __init__(self, engine, publisher: TrainerPublisher | None = None, lane=None):
        """`publisher`: this rank's side of weight publication (PublishWeights). `lane`: a
        `libra.training.hybrid.LaneControl` when the rank hosts the elastic hybrid pool's lane
        (RequestJoin, CancelJoin, RequestRelease; TrainStep then runs through it)."""
        self.engine = engine
        self.publisher = publisher
        self.lane = lane
        self._lock = threading.Lock()

    def _trajectories(self, request) -> list[Trajectory]:
        if not request.trajectories:
            raise InvalidArgument("trajectories must not be empty")
        return [trajectory_from_proto(m) for m in request.trajectories]

    def _run(self, fn, *args):
        try:
            with self._lock:
                return fn(*args)
        except InvalidArgument:
            raise
        except ValueError as e:  # bad batches (stale versions ahead of the trainer, shapes)
            raise InvalidArgument(str(e)) from e

    @rpc_errors
    def ComputeLogprobs(self, request, context):
        from libra.v1 import training_pb2

        logprobs = self._run(self.engine.compute_logprobs, self._trajectories(request))
        return training_pb2.ComputeLogprobsReply(
            trajectories=[training_pb2.TokenLogprobs(logprobs=row) for row in logprobs]
        )

    @rpc_errors
    def TrainStep(self, request, context):
        from libra.v1 import training_pb2

        r = self._run(self._train_step, self._trajectories(request))
        return training_pb2.TrainStepReply(
            version=r.version,
            loss=r.loss,
            pg_loss=r.pg_loss,
            kl=r.kl,
            entropy=r.entropy,
            clip_fraction=r.clip_fraction,
            grad_norm=r.grad_norm,
            num_tokens=r.num_tokens,
            num_trajectories=r.num_trajectories,
            num_dropped_stale=r.num_dropped_stale,
            num_dropped_no_variance=r.num_dropped_no_variance,
            rollout_capacity=self.engine.gate.capacity(),
        )

    def _train_step(self, batch: list[Trajectory]):
        if self.lane is None:
            return self.engine.train_step(batch)
        # The lane's step boundary (joins, activation, release) comes first, in the same lock.
        return self.lane.run_step(self.engine.version, batch)[1]

    # -- the elastic hybrid pool -------------------------------------------------------------------

    def _lane(self):
        if self.lane is None:
            raise RuntimeError(
                "this train rank hosts no hybrid lane (start it with --elastic; a core of PP=1)"
            )
        return self.lane

    @rpc_errors
    def RequestJoin(self, request, context):
        from libra.v1 import training_pb2

        lane = self._lane()
        try:
            join = lane.request_join(request.replica)
        except ValueError as e:  # not this rank's hybrid slot
            raise InvalidArgument(str(e)) from e
        # The job joins to train: the replica activates as soon as it holds the state.
        lane.lane.request_activation()
        return training_pb2.RequestJoinReply(generation=join.generation, lane_address=join.lane_addresses[0])

    @rpc_errors
    def CancelJoin(self, request, context):
        self._lane().cancel_join(request.replica, request.generation, request.reason)
        return self._hybrid_state()

    @rpc_errors
    def RequestRelease(self, request, context):
        self._lane().request_release(request.replica)
        return self._hybrid_state()

    @rpc_errors
    def GetHybridState(self, request, context):
        return self._hybrid_state()

    def _hybrid_state(self):
        from libra.v1 import training_pb2

        lane = self._lane().lane
        state = lane.state()
        return training_pb2.HybridStateReply(
            replica=-1 if lane.replica is None else lane.replica,
            generation=lane.generation,
            state="" if state is None else state.name,
            accepted_payloads=lane.counters.accepted_payloads,
            filled_in_shares=lane.counters.filled_in_shares,
            rollbacks=list(lane.counters.rollbacks),
        )

    @rpc_errors
    def SaveCheckpoint(self, request, context):
        from libra.v1 import training_pb2

        if not request.directory:
            raise InvalidArgument("directory must be set")
        self._run(self.engine.save_checkpoint, request.directory)
        return training_pb2.CheckpointReply(version=self.engine.version)

    @rpc_errors
    def LoadCheckpoint(self, request, context):
        from libra.v1 import training_pb2

        if not Path(request.directory, "metadata.json").is_file():
            raise InvalidArgument(f"directory {request.directory!r} holds no checkpoint")
        self._run(self.engine.load_checkpoint, request.directory)
        return training_pb2.CheckpointReply(version=self.engine.version)

    @rpc_errors
    def ExportWeights(self, request, context):
        from safetensors.torch import save

        from libra.v1 import training_pb2

        tensors = self._run(self.engine.export_hf)
        return training_pb2.ExportWeightsReply(version=self.engine.version, safetensors=save(tensors))

    @rpc_errors
    def PublishWeights(self, request, context):
        from libra.sync.wire import load_request_to_proto
        from libra.v1 import training_pb2

        if self.publisher is None:
            raise RuntimeError("this train rank was started without a weight publisher")
        if not request.tp_sizes:
            raise InvalidArgument("tp_sizes must not be empty")
        if request.version != self.engine.version:
            raise InvalidArgument(
                f"version {request.version} is not the trainer's version {self.engine.version}"
            )

        def publish():
            params = self.engine.publishable_parameters()
            return self.publisher.publish(
                request.version, list(request.tp_sizes), params, list(request.release_versions)
            )

        published = self._run(publish)
        return training_pb2.PublishWeightsReply(
            version=published.version,
            publisher=bool(published.loads),
            loads=[load_request_to_proto(published.loads[k]) for k in sorted(published.loads)],
            gather_seconds=published.gather_seconds,
            publish_seconds=published.publish_seconds,
        )

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


def main(argv: list[str] | None = None) -> None:
    spec = TrainRankSpec.from_argv(sys.argv[1:] if argv is None else argv)
    configure_logging(f"train-rank-{spec.rank}")

    from libra.backends import get_backend

    backend = get_backend(spec.backend.name, **spec.backend.options())
    backend.prepare_worker()
    from libra.control.server import start_server
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.model import VOCAB_DIVISIBLE_BY, ModelArchitecture
    from libra.training.parallel import initialize
    from libra.v1 import training_pb2, training_pb2_grpc

    cfg = spec.training
    info = initialize(
        cfg.tensor_parallel,
        cfg.pipeline_parallel,
        rank=spec.rank,
        world_size=cfg.world_size,
        master_addr=spec.master_addr,
        master_port=spec.master_port,
        backend=backend.distributed_backend,
        seed=cfg.seed,
    )
    model = ModelSpec.from_hf_dir(spec.hf_model)
    arch = ModelArchitecture.from_spec(model)
    engine = TrainEngine(arch, cfg, info, device=backend.torch_device(0))
    engine.load_hf(hf_tensor_reader(spec.hf_model))
    token = os.environ.get("LIBRA_TOKEN")
    if not token:
        raise SystemExit("LIBRA_TOKEN must be set")
    source = SourceRank(info.rank, info.tp_rank, info.tp_size, info.pp_rank, info.pp_size, info.dp_rank)
    # The trainer's own vocab padding, which decides the source layout the plans strip.
    publisher = TrainerPublisher(ModelShape.from_spec(model), source, spec.sync, VOCAB_DIVISIBLE_BY)
    lane = None
    if spec.elastic is not None:
        from libra.training.hybrid import CoreLane, LaneControl

        lane = LaneControl(CoreLane(engine, spec.elastic, host=spec.host, token=token))
    servicer = TrainRankServicer(engine, publisher, lane)

    def add(server):
        training_pb2_grpc.add_TrainRankServicer_to_server(servicer, server)
        return [training_pb2.DESCRIPTOR.services_by_name["TrainRank"].full_name]

    running = start_server(spec.control, token, add, host=spec.host, port=spec.port)
    if spec.port_file:
        tmp = Path(spec.port_file + ".tmp")
        tmp.write_text(str(running.port))
        tmp.rename(spec.port_file)
    print(f"train rank {spec.rank} serving on {spec.host}:{running.port}", flush=True)
    # SIGTERM (the node agent stopping the worker) unwinds through `finally`, so the published
    # shared-memory buffers are unlinked instead of outliving the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        running.server.wait_for_termination()
    finally:
        servicer.close()
        running.stop(grace_s=1.0)


if __name__ == "__main__":
    main()
