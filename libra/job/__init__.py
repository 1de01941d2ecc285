"""The RL job: what `libra run CONFIG` runs. Owns worker launch through the control plane
(`workers`, `setup`), the asynchronous GRPO loop with bounded staleness (`loop`), group rollout
with rewards and traces (`rollouts`), weight publication to instances (`setup.publish`: the
trainer's PublishWeights, then every instance's LoadWeights, retried through `libra.sync`'s
version ledger), the global planner in the loop with plans carried out on the live cluster,
hybrid replicas joining from rollout (`planning`) and training restarted in a new layout
(`training_restart`), checkpoints and resume (`loop`), and the run folder: metrics, TensorBoard,
trajectories, live progress and the report (`recorder`, `progress`, `report`)."""

from libra.job.config import JobConfig
from libra.job.run import load_job_config, run_job

__all__ = ["JobConfig", "load_job_config", "run_job"]
