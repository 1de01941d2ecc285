"""The RL job: what `libra run CONFIG` runs. Owns the controller and node agents (`cluster`);
every worker it runs, one record each under one name, their start and stop (the launch's and the
plan executor's) and the watchdog (`fleet`); the train ranks' layout and client (`train_ranks`);
the rollout instances with their pool and router, restarted in place when lost (`instances`);
the tasks (`task_source`); what the loop talks to, built in order (`setup`); the asynchronous
GRPO loop with bounded staleness (`loop`); group rollout with rewards and traces (`rollouts`); weight
publication to instances (`publication`: the trainer's PublishWeights, then every instance's
LoadWeights, retried through `libra.sync`'s version ledger); the global planner on the controller
(`cluster`: served as PlannerService) and in the loop with plans carried out on the live cluster,
its problem built from the job (`problem`), its candidates re-scored in the simulator on the
job's own finished groups (`rescoring`), hybrid replicas joining from rollout (`planning`) and
training restarted in a new layout (`training_restart`); checkpoints and resume (`loop`); and the
run folder: metrics, TensorBoard, trajectories, live progress and the report (`recorder`,
`progress`, `report`).

`libra run` enters at `libra.job.run.run_job`. This package exports only `JobConfig`: the root
config imports `libra.job.config`, which loads this file first, so it may import nothing that
imports the root config (docs/layers.md, `job.config`)."""

from libra.job.config import JobConfig

__all__ = ["JobConfig"]
