"""A training restart in a new layout, as the job carries it out (`TrainingControl` for the
planner's executor).

A plan that changes the core's shape (TP, PP, or DP beyond what the elastic hybrid pool adds)
restarts training: the ranks save a Megatron distributed checkpoint (loadable at any TP/PP), stop,
the new layout's ranks start on the plan's devices, and load it. The job runs such a plan at a step
boundary while its loop waits (`JobPlanning`): no train step is in flight, and rollout keeps
serving on its instances meanwhile. Afterwards the new ranks publish the current version again
(the old ranks' weight buffers went with them), so an instance restarted later still loads it.
"""

from __future__ import annotations

import dataclasses
import logging

from libra.job.cluster import JobCluster, Placement
from libra.job.instances import RolloutInstances
from libra.job.train_ranks import TrainRankGroup
from libra.planner.diff import RestartTraining

logger = logging.getLogger(__name__)


class JobTrainingRestart:
    """`TrainingControl` over the job's train ranks. If the new layout's ranks do not come up, the
    old layout is started again from the same checkpoint before the failure is reported: the run
    goes on as it was, and the planner is reconciled to it."""

    def __init__(self, train_ranks: TrainRankGroup, instances: RolloutInstances, cluster: JobCluster):
        self.train_ranks, self.instances, self.cluster = train_ranks, instances, cluster
        self._count = 0
        self._checkpoint = ""
        self._old: tuple = ()

    def checkpoint(self) -> str:
        self._count += 1
        directory = self.train_ranks.run_dir / "restarts" / f"restart-{self._count}"
        version = self.train_ranks.client.save_checkpoint(str(directory))
        logger.info("training restart %d: saved version %d to %s", self._count, version, directory)
        self._checkpoint = str(directory)
        return self._checkpoint

    def stop_training(self) -> None:
        self._old = self.train_ranks.layout()
        self.train_ranks.stop()

    def start_training(self, layout: RestartTraining) -> None:
        """One rank per device of `layout.new_devices`, in order."""
        devices = self.cluster.device_map()
        placements = []
        for device in layout.new_devices:
            agent_id, local = devices.locate((device,))
            placements.append(Placement(agent_id, tuple(local)))
        training = dataclasses.replace(
            self.train_ranks.training,
            tensor_parallel=layout.tp,
            pipeline_parallel=layout.pp,
            data_parallel=layout.dp,
        )
        try:
            self.train_ranks.start(placements, training)
        except Exception as e:
            self._back_to_old_layout(e)
            raise RuntimeError(
                f"the new training layout did not start ({type(e).__name__}: {e}); "
                "training resumed in the old layout from the restart checkpoint"
            ) from e

    def load_checkpoint(self, checkpoint: str) -> None:
        version = self.train_ranks.client.load_checkpoint(checkpoint)
        current = self.instances.publication.current_version
        if version != current:
            raise RuntimeError(f"the restarted ranks loaded version {version}, the job is at {current}")
        self.instances.republish(self.train_ranks.client)

    def _back_to_old_layout(self, error: Exception) -> None:
        logger.error("training restart %d failed, restoring the old layout: %s", self._count, error)
        self.train_ranks.stop()
        training, placements = self._old
        self.train_ranks.start(placements, training)
        self.load_checkpoint(self._checkpoint)
