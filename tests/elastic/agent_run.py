"""The core replica of the elastic hybrid pool with a real control plane (`ehp_job.py core_agent`).

This process runs the core rank (DP=1) and, beside it, the controller and the plan executor; a
`libra agent` process owns 2 CPU slots. Device 1 starts as a rollout instance (a `python -c`
sleeper standing for one; rollout itself is the recording fake of the executor tests). Then, by
plan actions executed in a background thread while the core keeps stepping:

  v2: stop the rollout instance (cut) + join hybrid replica 1 on device 1 — the executor starts
      `python -m libra.training.hybrid_worker` there through StartWorker;
  the core activates it after `zero_sync_steps` steps in ZERO_SYNC; in its `kill_after`-th active
  step the test kills it through the agent (StopWorker);
  v3: release replica 1 (its worker has ended) + start a rollout instance on device 1 again.

Results go to `result_core_agent.pt` in the spec's out_dir.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

TOKEN = "ehp-agent-token-0123456789"
_REPO = Path(__file__).resolve().parents[2]


class NoRestart:
    """The training side's restart steps; this run's plans never restart training."""

    def checkpoint(self) -> str:
        raise RuntimeError("this run's plans do not restart training")

    stop_training = start_training = load_checkpoint = checkpoint


class Launcher:
    def __init__(self, spec: dict, out_dir: Path):
        self.spec, self.out_dir = spec, out_dir

    def rollout_instance(self, action):
        from libra.planner.controls import LaunchSpec
        from tests.planner.actions_fakes import SLEEPER

        ready = self.out_dir / f"{action.instance_id}.addr"
        return LaunchSpec((sys.executable, "-c", SLEEPER, str(ready), "127.0.0.1:0"), ready_file=str(ready))

    def hybrid_replica(self, action, join):
        from libra.planner.controls import LaunchSpec
        from libra.training.hybrid_worker import HybridReplicaSpec
        from tests.elastic.ehp_job import training_config

        tag = f"hybrid{action.replica}-g{join.generation}"
        spec = HybridReplicaSpec(
            hf_model=self.spec["model"],
            lanes=tuple(join.lane_addresses),
            replica=action.replica,
            generation=join.generation,
            training=training_config(1),
            ready_file=str(self.out_dir / f"{tag}.ready"),
        )
        env = {"PYTHONPATH": str(_REPO), "PYTHONWARNINGS": "ignore", "LIBRA_TOKEN": TOKEN}
        return LaunchSpec(tuple(spec.to_argv()), env=env, cwd=str(_REPO), ready_file=spec.ready_file)


def _spawn_agent(controller, out_dir: Path) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "libra.cli",
        "agent",
        "--controller",
        controller.address,
        f"run_dir={out_dir / 'agent'}",
        "backend.num_devices=2",
    ]
    log = open(out_dir / "agent.log", "w")
    return subprocess.Popen(
        argv, env={**os.environ, "LIBRA_TOKEN": TOKEN}, stdout=log, stderr=subprocess.STDOUT, cwd=_REPO
    )


def _wait_for_agent(controller, agent: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not controller.cluster.snapshot().agents:
        if agent.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the node agent did not register (exit {agent.poll()})")
        time.sleep(0.05)


def run_core_agent(spec: dict) -> None:
    import torch

    from libra.backends.config import BackendConfig
    from libra.config import LibraConfig
    from libra.control import ClusterClient, Controller
    from libra.control.config import ControlConfig
    from libra.planner.actions import ActionExecutor, ExecutorConfig
    from libra.planner.diff import (
        JoinHybridReplica,
        ReleaseHybridReplica,
        StartRolloutInstance,
        StopRolloutInstance,
    )
    from libra.training.elastic import ElasticConfig, ReplicaState
    from libra.training.hybrid import CoreLane, LaneControl
    from libra.training.parallel import shutdown
    from tests.elastic.ehp_job import batch_for_step, build_engine
    from tests.planner.actions_fakes import RecordingRollout

    out_dir = Path(spec["out_dir"])
    config = LibraConfig(
        run_dir=str(out_dir / "controller"),
        control=ControlConfig(port=0, token=TOKEN, heartbeat_interval_s=0.5),
        backend=BackendConfig(name="cpu", num_devices=2),
    )
    controller = Controller(config).start()
    agent = _spawn_agent(controller, out_dir)  # it starts while the core builds its engine
    client = ClusterClient(controller.address, TOKEN, config.control)
    engine = build_engine(spec, 0, 1, spec["port"])
    lane = CoreLane(engine, ElasticConfig(gradient_timeout_s=20, activation_timeout_s=60), token=TOKEN)
    control = LaneControl(lane)
    record: dict = {"losses": [], "states": [], "times": [], "payloads": [], "events": [], "reports": []}
    try:
        _wait_for_agent(controller, agent)
        executor = ActionExecutor(
            client,
            RecordingRollout(inflight={"rollout-d1": 3}),
            NoRestart(),
            control,
            Launcher(spec, out_dir),
            ExecutorConfig(start_timeout_s=240, release_timeout_s=30, stop_grace_s=2),
            events=controller.events,
        )
        background: list[threading.Thread] = []

        def apply(actions, version: int) -> None:
            def run():
                report = executor.execute(actions, plan_version=version)
                record["reports"].append((version, report.ok, [r.describe() for r in report.results]))

            background.append(threading.Thread(target=run, name=f"plan-v{version}"))
            background[-1].start()

        apply([StartRolloutInstance("rollout-d1", 1, (1,))], 1)
        background[-1].join()
        zero_sync_left, active_seen, rolled_back_at = spec["zero_sync_steps"], 0, None
        for step in range(spec["max_steps"]):
            state = lane.state()
            if step == spec["first_join_step"]:
                apply(
                    [StopRolloutInstance("rollout-d1", (1,), cut_inflight=True), JoinHybridReplica(1, (1,))],
                    2,
                )
                record["events"].append((step, "plan v2: rollout device 1 -> hybrid replica 1"))
            if state is ReplicaState.ZERO_SYNC:
                zero_sync_left -= 1
                if zero_sync_left <= 0:
                    lane.request_activation()
            if state is ReplicaState.ACTIVE and active_seen == spec["kill_after"] - 1:
                # Killed through its node agent while the core is inside this active step.
                worker_id = executor.running_hybrids()[1].worker_id
                threading.Thread(target=client.stop_worker, args=(worker_id, 1.0)).start()
                record["events"].append((step, f"kill {worker_id} through the agent"))
            start = time.perf_counter()
            accepted_before = lane.counters.accepted_payloads
            state_in_step, result = control.run_step(step, batch_for_step(step))
            record["times"].append(time.perf_counter() - start)
            # Paced like a loop that waits for rollout, and slower while the hybrid starts (imports,
            # engine build: tens of seconds on a busy machine), so that it gets the CPU and the
            # run (and the static reference) needs few steps.
            pace = spec["min_step_s"] * (3 if state_in_step is ReplicaState.REQUESTED else 1)
            time.sleep(max(pace - record["times"][-1], 0.0))
            record["losses"].append(result.loss)
            record["states"].append(None if state_in_step is None else state_in_step.name)
            record["payloads"].append(lane.counters.accepted_payloads - accepted_before)
            active_seen += state_in_step is ReplicaState.ACTIVE
            if rolled_back_at is None and lane.state() is ReplicaState.ROLLED_BACK:
                rolled_back_at = step
                record["events"].append((step, "rolled back: " + lane.counters.rollbacks[-1]))
                apply([ReleaseHybridReplica(1, (1,)), StartRolloutInstance("rollout-d1b", 1, (1,))], 3)
            if any(not ok for _, ok, _ in record["reports"]):
                break  # a plan failed: the test reports it
            plans_done = len(record["reports"]) == 3
            if rolled_back_at is not None and plans_done and step >= rolled_back_at + spec["tail_steps"]:
                break
        for thread in background:
            thread.join(timeout=60)
        record["filled_in"] = lane.counters.filled_in_shares
        record["rollbacks"] = lane.counters.rollbacks
        record["workers"] = {
            w.spec.worker_id: (w.spec.devices, w.state.name, w.exit_code)
            for w in controller.cluster.snapshot().workers
        }
        record["device_events"] = [
            (e.kind.name, e.worker_id, e.exit_code) for e in controller.events._history if e.worker_id
        ]
        record["plan_events"] = [
            (e.plan_version, e.message) for e in controller.events._history if e.plan_version
        ]
        torch.save(record, out_dir / "result_core_agent.pt")
    finally:
        client.close()
        agent.terminate()  # it stops its workers and deregisters
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
        controller.stop()
        lane.listener.close()
        shutdown()
