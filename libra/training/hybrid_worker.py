"""A hybrid replica of the elastic hybrid pool as a worker process, started by the plan executor
through a node agent on devices taken from rollout.

    python -m libra.training.hybrid_worker --spec JSON      (a `HybridReplicaSpec`)

One lane address per TP rank of the core replica it pairs with, in TP order: the replica has the
core's TP = T (PP = 1) and is T processes in its own torch.distributed world (the core's process
groups are never touched). The process the agent starts is TP rank 0 on the worker's first device;
it starts ranks 1..T-1 as its children on the next devices (they die with it, and stopping the
worker stops its whole process group) and exits as soon as one of them fails. Each rank builds
the same engine as its core rank, connects to its core rank's lane and follows the join protocol
(`libra.training.hybrid.run_hybrid_replica`) until the core releases it (exit 0); rank 0 writes
the ready file once the replica's world is up. A lost lane or any failure exits non-zero; the
core has rolled the whole replica back by then.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from libra.backends.config import BackendConfig
from libra.control.auth import TOKEN_ENV
from libra.control.lifetime import die_with_parent
from libra.launch_spec import ArgvSpec
from libra.logs import configure_logging
from libra.model_spec import ModelSpec
from libra.training.config import TrainingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HybridReplicaSpec(ArgvSpec):
    """How to start one hybrid replica: its TP rank 0, which starts the other ranks itself."""

    module = "libra.training.hybrid_worker"
    hf_model: str
    """The HF model folder the core started from."""
    lanes: tuple[str, ...]
    """host:port of each lane of the paired core replica, one per TP rank, in TP order."""
    replica: int
    """Its DP replica index (>= 1; the core is replica 0)."""
    generation: int
    """The join's generation (>= 1)."""
    training: TrainingConfig
    """The core's training config, or the replicas would not step in lockstep; its parallel sizes
    are the core's, the replica's own are TP = len(lanes), PP = DP = 1."""
    backend: BackendConfig = field(default_factory=BackendConfig)
    ready_file: str | None = None
    """Written by rank 0 with the lane addresses once the replica's world is up."""
    result_file: str | None = None
    """torch.save of the steps run and their losses (rank 0)."""
    tp_rank: int = 0
    master_port: int | None = None
    """Of the replica's own world; rank 0 picks it and gives it to the others."""
    parent_pid: int | None = None
    """Rank 0's pid (ranks > 0 die with it)."""

    def __post_init__(self) -> None:
        if self.replica < 1 or self.generation < 1:
            raise ValueError(f"replica and generation must be >= 1, got {self.replica}, {self.generation}")
        if not self.lanes:
            raise ValueError("lanes: one address per TP rank of the core replica, got none")
        if not 0 <= self.tp_rank < len(self.lanes):
            raise ValueError(
                f"tp_rank must be in [0, {len(self.lanes)}) for {len(self.lanes)} lanes, got {self.tp_rank}"
            )
        if self.tp_rank > 0 and (self.master_port is None or self.parent_pid is None):
            raise ValueError("tp_rank > 0 needs the master_port and parent_pid of rank 0")

    def other_rank(self, tp_rank: int, master_port: int, parent_pid: int) -> HybridReplicaSpec:
        """TP rank `tp_rank` of the same replica (rank 0 alone writes the files)."""
        return dataclasses.replace(
            self,
            tp_rank=tp_rank,
            master_port=master_port,
            parent_pid=parent_pid,
            ready_file=None,
            result_file=None,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_atomically(path: str, text: str) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    spec = HybridReplicaSpec.from_argv(sys.argv[1:] if argv is None else argv)
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise SystemExit(f"{TOKEN_ENV} must be set: the replica proves it to its core rank's lane")
    tp, rank = len(spec.lanes), spec.tp_rank
    if rank > 0:
        # A rank left alone would wait in the replica's rendezvous or a collective on devices
        # already handed back.
        die_with_parent(signal.SIGKILL, spec.parent_pid)
    configure_logging(f"hybrid-replica-{spec.replica}-tp{rank}")
    master_port = spec.master_port or _free_port()
    children = _start_other_ranks(spec, master_port) if rank == 0 else []

    from libra.backends import get_backend

    os.environ["LOCAL_RANK"] = str(rank)  # the worker's devices: TP rank t takes the t-th
    backend = get_backend(spec.backend.name, **spec.backend.options())
    backend.prepare_worker()
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.hybrid import run_hybrid_replica
    from libra.training.model import ModelArchitecture
    from libra.training.parallel import initialize, shutdown

    cfg = dataclasses.replace(spec.training, tensor_parallel=tp, pipeline_parallel=1, data_parallel=1)
    info = initialize(
        tp,
        1,
        rank=rank,
        world_size=tp,
        master_addr="127.0.0.1",
        master_port=master_port,
        backend=backend.distributed_backend,
        seed=cfg.seed,
    )
    arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(spec.hf_model))
    # No optimizer: the replica takes its weights from its core rank (`libra.training.hybrid`).
    engine = TrainEngine(arch, cfg, info, device=backend.torch_device(rank), with_optimizer=False)
    engine.load_hf(hf_tensor_reader(spec.hf_model))
    if spec.ready_file:
        _write_atomically(spec.ready_file, ",".join(spec.lanes))
    losses: dict[int, float] = {}
    num_steps = run_hybrid_replica(
        engine,
        spec.lanes[rank],
        replica=spec.replica,
        generation=spec.generation,
        token=token,
        on_step=lambda step, result: losses.__setitem__(step, result.loss),
    )
    print(
        f"hybrid replica {spec.replica} TP rank {rank} (generation {spec.generation}) "
        f"released after {num_steps} steps"
    )
    if spec.result_file:
        import torch

        torch.save({"steps": num_steps, "losses": losses}, spec.result_file)
    shutdown()
    # Released together: each rank exits 0 after its own release.
    return 1 if any(child.wait() != 0 for child in children) else 0


def _start_other_ranks(spec: HybridReplicaSpec, master_port: int) -> list[subprocess.Popen]:
    """Starts TP ranks 1..T-1 of the replica and watches them: one that fails ends this process,
    and with it the replica (a rank left alone would wait for its peers in a collective until a
    timeout)."""
    children = [
        subprocess.Popen(spec.other_rank(rank, master_port, os.getpid()).to_argv(), stdin=subprocess.DEVNULL)
        for rank in range(1, len(spec.lanes))
    ]

    def watch(rank: int, child: subprocess.Popen) -> None:
        if child.wait() != 0:
            logger.error(
                "TP rank %d of the hybrid replica exited with %d; ending the replica", rank, child.returncode
            )
            os._exit(1)

    for rank, child in enumerate(children, start=1):
        threading.Thread(target=watch, args=(rank, child), daemon=True, name=f"watch-tp{rank}").start()
    return children


if __name__ == "__main__":
    raise SystemExit(main())
