"""The job's train ranks: the layout that runs, their workers (through the fleet) and the client
that calls them all (`TrainRanks`).

A layout is started whole (every rank launched before any is waited for: rank 0 serves only once
every rank joined its process group) and stopped whole; a training restart starts a new
generation of ranks (worker names are never reused). A rank that ends unasked, or whose agent is
lost, sets `gone`: no train step can run without every rank, and the loop ends the run
(`GrpoJob`) wherever it waits.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from libra.config import LibraConfig
from libra.job.cluster import Placement, free_port
from libra.job.fleet import Fleet, FleetWorker, WorkerKind
from libra.job.trainer import TrainRanks
from libra.training.config import TrainingConfig
from libra.training.worker import TrainRankSpec


class TrainRankGroup:
    def __init__(self, config: LibraConfig, fleet: Fleet, model_dir: Path, hosts_hybrid_lane: bool):
        self.config = config
        self.fleet = fleet
        self.model_dir = model_dir
        self.hosts_hybrid_lane = hosts_hybrid_lane
        """Every rank hosts a lane of the elastic hybrid pool (the planner runs, PP = 1)."""
        self.run_dir = Path(config.run_dir)
        self.names: list[str] = []
        """The fleet names of the running layout's ranks, in rank order."""
        self.addresses: list[str] = []
        self.client: TrainRanks | None = None
        self.busy = False
        """A train step is running (the loop sets it; the device-busy samples read it)."""
        self.gone = asyncio.Event()
        """Set once a serving rank ended, or its agent was lost, without the job asking."""
        self._generation = 0
        fleet.on_loss(WorkerKind.TRAIN_RANK, self._rank_lost)

    @property
    def training(self) -> TrainingConfig:
        """The running layout's config (a training restart replaces it)."""
        return self.config.training

    def layout(self) -> tuple[TrainingConfig, list[Placement]]:
        """The running layout: its config and each rank's placement, in rank order."""
        return self.config.training, [self.fleet.get(name).placement for name in self.names]

    def start(self, placements: list[Placement], training: TrainingConfig | None = None) -> list[str]:
        """Starts one rank per placement in the layout of `training` (which becomes the job's;
        default: `config.training`), waits until they serve and opens the client. Blocking.
        Returns their addresses."""
        if training is not None:
            self.config.training = training
        training = self.config.training
        self._generation += 1
        prefix = "train" if self._generation == 1 else f"train-g{self._generation}"
        cluster = self.fleet.cluster
        master_addr, master_port = cluster.agent_host(placements[0].agent_id), free_port()
        launched = []
        self.names = []  # as they start: a failure part-way knows what to stop
        for rank, placement in enumerate(placements):
            port_file = self.run_dir / f"{prefix}-rank-{rank}.port"
            spec = TrainRankSpec(
                hf_model=str(self.model_dir),
                rank=rank,
                master_port=master_port,
                training=training,
                master_addr=master_addr,
                sync=self.config.sync,
                backend=self.config.backend,
                control=self.config.control,
                host=cluster.agent_host(placement.agent_id),
                port_file=str(port_file),
                elastic=self.config.elastic if self.hosts_hybrid_lane else None,
            )
            name = f"{prefix}-{rank}"
            launched.append(
                self.fleet.launch(name, WorkerKind.TRAIN_RANK, placement, spec.to_argv(), port_file)
            )
            self.names.append(name)
        self.addresses = []
        for record in launched:
            self.fleet.wait_serving(record)
            record.address = f"{cluster.agent_host(record.placement.agent_id)}:{record.address}"
            self.addresses.append(record.address)
        self.client = TrainRanks(self.addresses, cluster.token, self.config.control)
        return self.addresses

    def stop(self) -> None:
        """Closes the client and stops every rank started last (also a layout that came up only
        in part); their devices are free afterwards."""
        if self.client is not None:
            self.client.close()
            self.client = None
        for name in self.names:
            self.fleet.stop(name)
            self.fleet.forget(name)

    def lost(self, wait_s: float = 15.0) -> list[str]:
        """What happened to the ranks that ended or whose agent is gone, one line each. A failed
        call may arrive before the controller knows why: an agent's loss takes missed heartbeats,
        so this waits up to `wait_s` for a cause."""
        deadline = time.monotonic() + wait_s
        while not (lost := self.fleet.describe_lost(self.names)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [f"train rank {line}" for line in lost]

    async def _rank_lost(self, record: FleetWorker) -> None:
        # Also ends the loop's wait for rollouts: when the ranks' host held every rollout
        # instance too, a loss noticed only by the next train call would come after the batch's
        # trajectories waited out `rollout.agent.no_instance_wait_s` for an instance.
        self.gone.set()
