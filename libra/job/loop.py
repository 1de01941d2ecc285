"""The asynchronous GRPO loop: draw → route/rollout → reward → gate → train → publish.

    while version < num_steps:
        launch groups while the staleness gate has room     (rollout of step n+1 runs on ...)
        batch = the next finished groups                    (... while step n trains)
        train on the fresh ones; publish the new weights to every instance; record; checkpoint

Asynchrony comes from the gate: with `max_staleness` s, rollouts may be started for up to
(version + s + 1) batches, so while the trainer takes step n the instances are already
generating step n+1's groups (and switch to the new weights between tokens when they arrive).
No trajectory whose oldest token is more than s + t versions old is trained on (t:
`training.tail_staleness`, extra versions for the late ones, which do not deepen the launch): with
`training.staleness_mode=drop` such a group is dropped, whole, when its batch is formed; with
`wait` the trainer instead waits, before a step, for the groups launched s + t versions ago, so
the long tail is trained on rather than thrown away; with `budget` (the default) it waits for
them only when dropping them would take the run's share dropped as too stale past
`training.drop_budget`.
Training and weight export are blocking gRPC calls made from a thread, so the event loop keeps
driving every trajectory meanwhile.

A run is resumable from its first step: the starting state is checkpointed before the first
rollout. A checkpoint holds, besides the trainer's, the data position, the gate, the router, the
groups not yet trained on (rolled out again, under the same ids, by the resumed run) and the
record files' lengths (what was recorded after it is moved aside on resume); the resumed run's
planner starts from the trajectories recorded up to it. Losing the train
ranks ends the run with a message naming what was lost, an event and the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from libra.config import LibraConfig
from libra.job.agents import load_agent
from libra.job.instances import resolved_instance_config
from libra.job.planning import StepTimes
from libra.job.recorder import (
    HeldOutEvaluation,
    JobEvent,
    RunRecorder,
    StepMetrics,
    read_jsonl,
    rewind_records,
)
from libra.job.rollouts import Group, GroupRollout, TaskStream
from libra.job.setup import JobWorkers
from libra.job.trackers import flat_config, open_trackers
from libra.job.trainer import measure_logprob_gap
from libra.rollout.environment import load_environment
from libra.tasks.rewards import load_reward_function
from libra.trace import read_traces
from libra.training.staleness import StalenessGate
from libra.trajectory import Trajectory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobResult:
    run_dir: Path
    steps: list[StepMetrics]
    num_trajectories: int
    """Trajectories rolled out (trained on or not)."""
    version: int
    evaluations: list[HeldOutEvaluation]
    """Held-out reward before the first step and after the last (`job.eval_tasks`)."""


class TrainingLost(RuntimeError):
    """The train ranks failed a call: their host, or the ranks themselves, are gone."""


class GrpoJob:
    def __init__(self, config: LibraConfig, resume: bool = False):
        config = config.resolved()  # a config built in code, not loaded, is checked and completed here
        # The engine settings left unset are the backend's, stated in the job's config.
        config = dataclasses.replace(
            config, rollout=dataclasses.replace(config.rollout, instance=resolved_instance_config(config))
        )
        self.config, self.job, self.resume = config, config.job, resume
        self.run_dir = Path(config.run_dir)
        self._resume_from = _last_checkpoint(self.run_dir) if resume else None  # refused before any start
        if config.tasks.reward_function:  # a reward function that cannot be loaded: before any start
            load_reward_function(config.tasks.reward_function)
        if config.tasks.environment:  # likewise an environment class
            load_environment(config.tasks.environment)
        if config.endpoint.agent:  # and an agent
            load_agent(config.endpoint.agent)
        self.gate = StalenessGate(
            config.training.max_staleness, self.job.batch_size, tail_staleness=config.training.tail_staleness
        )
        self.in_flight: dict[int, asyncio.Task[Group]] = {}
        self.finished: dict[int, Group] = {}
        self.unfinished: dict[int, int] = {}
        """Group index -> task index of every group launched and not yet taken into a batch."""
        self.launched: dict[int, Group] = {}
        """Group index -> the groups in flight (when each was launched: `started_version`)."""
        self._relaunch: list[tuple[int, int]] = []
        """(group index, task index) of the unfinished groups of the checkpoint resumed from."""
        self.steps: list[StepMetrics] = []
        self.evaluations: list[HeldOutEvaluation] = []
        self.num_rolled_out = 0
        self._doing = "the start"
        """What the loop is doing, for the message when the train ranks are lost."""

    def run(self) -> JobResult:
        return asyncio.run(self._run())

    async def _run(self) -> JobResult:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        resume_state, superseded = {}, {}
        if self._resume_from is not None:
            # Before the recorder opens the files: it appends to what the checkpoint recorded.
            resume_state = json.loads((self._resume_from / "job_state.json").read_text())
            if "records" in resume_state:  # a checkpoint of an older version kept no lengths
                superseded = rewind_records(self.run_dir, resume_state["records"])
        self.workers = JobWorkers(self.config)
        trackers = open_trackers(
            self.job.trackers,
            self.run_dir,
            self.job.tracker_project,
            self.job.mlflow_tracking_uri,
            purge_step=resume_state["version"] + 1 if resume_state else None,
            config=flat_config(self.config),
        )
        self.recorder = RunRecorder(self.run_dir, trackers, prometheus=self._start_prometheus())
        try:
            await self.workers.start(self.recorder)
            # The launch may have filled in the planner's rollout layout (`job.rollout_tp_sizes`).
            self.config, self.job = self.workers.config, self.workers.job
            self.recorder.publish_to(self.workers.cluster.controller.events)
            self._start_planning()
            self.stream = TaskStream(self.workers.source.tasks, self.job.seed)
            if resume_state:
                await self._restore(resume_state, superseded)
            self.rollout = self._group_rollout(self.job.group_size)
            self._checkpoint()  # the starting state: resumable from the first step
            if not any(e["when"] == "before" for e in read_jsonl(self.run_dir / "evaluations.jsonl")):
                await self._evaluate("before")
            await self._train_until_done_or_lost()
            await self._evaluate("after")
            await self._close_planning()
            self._checkpoint()
        finally:
            await self._close_planning()
            for task in self.in_flight.values():
                task.cancel()
            await asyncio.gather(*self.in_flight.values(), return_exceptions=True)
            await self.workers.stop()
            self.recorder.close()
        return JobResult(self.run_dir, self.steps, self.num_rolled_out, self.gate.version, self.evaluations)

    def _start_planning(self) -> None:
        """The planner in the loop (`libra.job.planning`), unless `job.planner` is off."""
        self.planning = None
        if self.job.planner:
            from libra.job.planning import JobPlanning

            w = self.workers
            self.planning = JobPlanning(
                self.config,
                w.cluster,
                w.fleet,
                w.instances,
                w.train_ranks,
                w.planning_problem,
                self.recorder,
                w.rescorer,
            )
            self.planning.adopt_launch_layout()
            self.workers.instances.on_gone = self.planning.on_instance_gone

    async def _close_planning(self) -> None:
        """A plan being carried out finishes (the pool and its instances are still up)."""
        planning, self.planning = getattr(self, "planning", None), None
        if planning is not None:
            await planning.close()

    def _start_prometheus(self):
        if self.job.metrics_port < 0:
            return None
        from libra.job.prometheus import JobMetrics

        metrics = JobMetrics(self.job.metrics_port, self.config.control.host)
        (self.run_dir / "metrics.port").write_text(f"{metrics.port}\n")
        return metrics

    async def _train_until_done_or_lost(self) -> None:
        """The train loop, stopped where it waits as soon as the watchdog reports a train rank
        lost (`TrainRankGroup.gone`); a failed call to the ranks stops it on its own."""
        train = asyncio.create_task(self._train_loop())
        gone = asyncio.create_task(self.workers.train_ranks.gone.wait())
        try:
            await asyncio.wait({train, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            train.cancel()  # no-op when it ended
            (outcome,) = await asyncio.gather(train, return_exceptions=True)
        if isinstance(outcome, asyncio.CancelledError) and gone.done() and not gone.cancelled():
            raise self._training_lost(self._doing)
        if isinstance(outcome, BaseException):
            raise outcome

    async def _train_loop(self) -> None:
        last_tokens, last_time = await self.workers.generated_tokens(), time.monotonic()
        while self.gate.version < self.job.num_steps:
            self._doing = f"the rollout of step {self.gate.version + 1}"
            step_started = time.monotonic()
            self._launch_groups()
            batch = await self._next_batch()
            train_started = time.monotonic()
            wait_s = train_started - step_started
            with self._train_ranks_call("the train step"):
                # Before the update: the trainer still runs the version that sampled the compared tokens.
                gap = await asyncio.to_thread(
                    measure_logprob_gap, self.workers.train_ranks.client, batch, self.gate.version
                )
                self.workers.train_ranks.busy = True
                try:
                    stats = await asyncio.to_thread(self.workers.train_ranks.client.train_step, batch)
                finally:
                    self.workers.train_ranks.busy = False
            self.gate.on_train_step(self._batch_slots)
            if stats.version != self.gate.version:
                raise RuntimeError(f"trainer is at version {stats.version}, the job at {self.gate.version}")
            publish_started = time.monotonic()
            with self._train_ranks_call(f"publishing version {self.gate.version}"):
                await self.workers.publish(self.gate.version)
            now = time.monotonic()
            tokens = await self.workers.generated_tokens()
            # Per instance: a restarted instance counts from zero again.
            new_tokens = sum(n - last_tokens.get(i, 0) for i, n in tokens.items())
            metrics = StepMetrics(
                step=stats.version,
                time_s=round(self.recorder.elapsed(), 2),
                mean_reward=sum(t.reward for t in batch) / len(batch),
                num_trajectories=len(batch),
                num_dropped_stale=self._last_dropped,
                generated_tokens=sum(t.num_generated_tokens for t in batch),
                rollout_tokens_per_s=new_tokens / max(now - last_time, 1e-6),
                trained_tokens_per_s=sum(t.num_generated_tokens for t in batch)
                / max(now - step_started, 1e-6),
                step_time_s=now - step_started,
                train_time_s=publish_started - train_started,
                publish_time_s=now - publish_started,
                loss=stats.loss,
                pg_loss=stats.pg_loss,
                entropy=stats.entropy,
                grad_norm=stats.grad_norm,
                mean_turns=sum(t.num_turns for t in batch) / len(batch),
                tool_use_rate=sum(bool(t.tool_returns) for t in batch) / len(batch),
                mean_staleness=sum(stats.version - 1 - t.oldest_policy_version for t in batch) / len(batch),
                logprob_abs_diff=gap.mean,
                logprob_max_abs_diff=gap.max,
                num_current_tokens=gap.num_tokens,
            )
            last_tokens, last_time = tokens, now
            self.steps.append(metrics)
            self.recorder.step(metrics)
            self.workers.progress.step(
                metrics, self.job.num_steps, self.planning.layout() if self.planning else "static"
            )
            if self.planning is not None:
                await self.planning.after_step(
                    StepTimes(metrics.step, wait_s, now - train_started, self._last_dropped)
                )
            if self.job.checkpoint_interval and self.gate.version % self.job.checkpoint_interval == 0:
                with self._train_ranks_call(f"the checkpoint of version {self.gate.version}"):
                    self._checkpoint()

    @contextlib.contextmanager
    def _train_ranks_call(self, what: str):
        """Turns a failed call to the train ranks into `TrainingLost`."""
        before, self._doing = self._doing, what
        try:
            yield
        except grpc.RpcError as e:
            raise self._training_lost(what, e) from e
        self._doing = before

    def _training_lost(self, what: str, error: grpc.RpcError | None = None) -> TrainingLost:
        """`TrainingLost` naming the ranks and hosts lost and the checkpoint to resume from,
        recorded as a `training_lost` event."""
        lost = self.workers.train_ranks.lost()
        checkpoint = _last_checkpoint(self.run_dir)
        failed = f" (the call failed with {error.code().name}: {error.details()})" if error else ""
        message = (
            f"training lost during {what} at version {self.gate.version}: "
            f"{'; '.join(lost) or 'no train rank reported ended'}{failed}; "
            f"resume with `libra run CONFIG --resume {self.run_dir}` "
            f"(from {checkpoint.name}, version {_checkpoint_version(checkpoint)})"
        )
        self.recorder.event(JobEvent.TRAINING_LOST, message, lost=lost, checkpoint=str(checkpoint))
        return TrainingLost(message)

    def _group_rollout(self, group_size: int, seed: int | None = None) -> GroupRollout:
        return GroupRollout(
            self.workers.agent_loop,
            self.workers.source.chat,
            group_size,
            qa_metric=self.config.tasks.qa_metric,
            sandbox=self.workers.sandbox,
            reward_function=self.config.tasks.reward_function,
            environment=self.config.tasks.environment,
            agent=self.workers.agent_runner,
            seed=seed,
        )

    async def _evaluate(self, when: str) -> None:
        """Rolls the held-out tasks out with the current weights and records their reward; none
        of these trajectories is trained on. Their groups and prompt ids are negative, apart from
        the training prompts' in the router's prefix trees. The built-in loop's (task, sample) is
        seeded by `job.seed`: the evaluations before and after training draw the same random
        numbers."""
        tasks = self.workers.source.eval_tasks[: self.job.eval_tasks]
        if not tasks:
            return
        print(
            f"[libra] held-out evaluation ({when}): {len(tasks)} tasks x {self.job.eval_samples}", flush=True
        )
        rollout = self._group_rollout(self.job.eval_samples, seed=self.job.seed)
        groups = await asyncio.gather(
            *(rollout.run(Group(-i, -i, self.gate.version), task) for i, task in enumerate(tasks, start=1))
        )
        trajectories = [t for group in groups for t in group.trajectories]
        with self._train_ranks_call(f"the logprob gap of the {when} evaluation"):
            gap = await asyncio.to_thread(
                measure_logprob_gap, self.workers.train_ranks.client, trajectories, self.gate.version
            )
        result = HeldOutEvaluation(
            when=when,
            version=self.gate.version,
            num_tasks=len(tasks),
            samples_per_task=self.job.eval_samples,
            mean_reward=sum(t.reward for t in trajectories) / len(trajectories),
            tool_use_rate=sum(bool(t.tool_returns) for t in trajectories) / len(trajectories),
            logprob_abs_diff=gap.mean,
            logprob_max_abs_diff=gap.max,
            num_compared_tokens=gap.num_tokens,
        )
        self.evaluations.append(result)
        self.recorder.evaluation(result, groups)

    def _launch_groups(self) -> None:
        """Starts groups while the gate allows a whole group."""
        while self.gate.capacity() >= self.job.group_size:
            self.gate.try_start(self.job.group_size)
            if self._relaunch:
                index, task_index = self._relaunch.pop(0)
                task = self.stream.tasks[task_index]
            else:
                index = self.stream.position
                task_index, task = self.stream.next()
            self.unfinished[index] = task_index
            group = self.launched[index] = Group(index, task_index, self.gate.version)
            self.in_flight[index] = asyncio.create_task(self.rollout.run(group, task))

    async def _next_batch(self) -> list[Trajectory]:
        """The oldest finished groups, `job.prompts_per_step` of them; a group without a trained
        token or (whole) too stale is dropped (its gate slots freed) and replaced by a newer one.
        A group holds `group_size` gate slots whatever it brings back (an agent's session may
        bring several segments, a trajectory may hold no model token), so the gate counts groups
        and the trainer gets every trajectory of the groups taken. In `wait` mode the batch waits
        for every group that would be too stale after this step, in `budget` mode until dropping
        those left stays within the budget (`training.staleness_mode`, `_collect_finished`)."""
        batch: list[Trajectory] = []
        self._last_dropped = self._batch_slots = 0
        slots = self.job.group_size
        while self._batch_slots < self.job.batch_size:
            await self._collect_finished()
            while self.finished and self._batch_slots < self.job.batch_size:
                group = self.finished.pop(min(self.finished))
                del self.unfinished[group.index]
                self.recorder.group(group)
                if self.planning is not None:
                    self.planning.record(group.traces)
                self.num_rolled_out += len(group.trajectories)
                usable = [t for t in group.trajectories if t.num_generated_tokens > 0]
                if not usable:
                    self.gate.drop(slots)  # nothing to train on
                elif self.gate.admit_group([t.oldest_policy_version for t in usable], slots):
                    batch += usable
                    self._batch_slots += slots
                else:
                    self._last_dropped += len(usable)
            self._launch_groups()  # dropped groups returned slots
        return batch

    async def _collect_finished(self) -> None:
        """Waits until at least one group has finished, and for the groups this step must train
        on (`StalenessGate.must_train`): in `wait` mode all of them, in `budget` mode until
        dropping those left would stay within the budget (`StalenessGate.waits_for_due`); moves
        every finished one over. The groups it waits for are the oldest, so the batch takes them
        first."""
        training = self.config.training
        while True:
            due = [
                t
                for i, t in self.in_flight.items()
                if not t.done() and self.gate.must_train(self.launched[i].started_version)
            ]
            slots = len(due) * self.job.group_size
            if not self.gate.waits_for_due(slots, training.staleness_mode, training.drop_budget):
                break
            # `wait`: until none is left; `budget`: until those left fit the budget.
            await asyncio.wait(due, return_when=asyncio.FIRST_COMPLETED)
        if not any(t.done() for t in self.in_flight.values()):
            await asyncio.wait(self.in_flight.values(), return_when=asyncio.FIRST_COMPLETED)
        for index in [i for i, t in self.in_flight.items() if t.done()]:
            self.finished[index] = self.in_flight.pop(index).result()
            del self.launched[index]

    # -- checkpoints ---------------------------------------------------------------------------

    def _checkpoint(self) -> None:
        directory = self.run_dir / "checkpoints" / f"step_{self.gate.version:06d}"
        if (directory / "job_state.json").is_file():
            return
        directory.mkdir(parents=True, exist_ok=True)
        version = self.workers.train_ranks.client.save_checkpoint(str(directory / "trainer"))
        state = {
            "version": version,
            "data_position": self.stream.position,
            "gate": self.gate.state_dict(),
            "router": self.workers.instances.router_state(),
            "num_rolled_out": self.num_rolled_out,
            "unfinished_groups": sorted([*self.unfinished.items(), *self._relaunch]),
            "records": self.recorder.offsets(),
        }
        (directory / "job_state.json").write_text(json.dumps(state))
        self.recorder.event(JobEvent.CHECKPOINT, f"saved version {version} to {directory}")

    async def _restore(self, state: dict, superseded: dict[str, int]) -> None:
        directory = self._resume_from
        version = await asyncio.to_thread(
            self.workers.train_ranks.client.load_checkpoint, str(directory / "trainer")
        )
        self.gate.load_state_dict(state["gate"], release_in_flight=True)
        self.stream.position = state["data_position"]
        self.num_rolled_out = state["num_rolled_out"]
        self._relaunch = [(index, task) for index, task in state.get("unfinished_groups", [])]
        self.workers.instances.restore_router(state["router"])
        if version > 0:  # version 0 is the model the instances started from
            await self.workers.publish(version)
        traces = self.run_dir / "trajectories.jsonl"
        restored = 0
        # A checkpoint of an older version kept no record lengths: its file was not rewound.
        if self.planning is not None and "records" in state and traces.is_file():
            newest = await asyncio.to_thread(read_traces, traces, self.planning.history.maxlen)
            restored = self.planning.restore_history(newest)
        moved = ", ".join(f"{n} {name}" for name, n in superseded.items()) or "none"
        self.recorder.event(
            JobEvent.RESUME,
            f"resumed at version {version} from {directory}; {len(self._relaunch)} groups unfinished "
            f"at the checkpoint are rolled out again under their ids; rows recorded after the "
            f"checkpoint, moved to superseded/: {moved}; the planner's history: {restored} "
            "trajectories of the stopped run",
            rolled_out_again=[index for index, _ in self._relaunch],
            superseded=superseded,
            planner_history=restored,
        )


def _last_checkpoint(run_dir: Path) -> Path:
    done = sorted((run_dir / "checkpoints").glob("step_*/job_state.json"))
    if not done:
        raise ValueError(f"--resume: {run_dir}/checkpoints holds no finished checkpoint")
    return done[-1].parent


def _checkpoint_version(directory: Path) -> int:
    return json.loads((directory / "job_state.json").read_text())["version"]
