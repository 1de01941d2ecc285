"""Stand-ins for the plan executor's tests: a recording rollout pool and training side, and a
launcher whose workers are `python -c` sleepers standing for rollout instances and hybrid
replicas (they write their ready file and sleep; no engine, no model)."""

from __future__ import annotations

import sys
from pathlib import Path

from libra.planner.controls import LaunchSpec
from libra.planner.diff import JoinHybridReplica, RestartTraining, StartRolloutInstance
from libra.training.elastic import HybridJoin

# argv: ready_file address [release_file]. Writes the address atomically, then sleeps; with a
# release file it exits 0 once that file appears (a hybrid replica told to leave by its core).
SLEEPER = """
import os, sys, time
ready, address = sys.argv[1], sys.argv[2]
release = sys.argv[3] if len(sys.argv) > 3 else ""
with open(ready + ".tmp", "w") as f:
    f.write(address)
os.replace(ready + ".tmp", ready)
for _ in range(6000):
    if release and os.path.exists(release):
        sys.exit(0)
    time.sleep(0.05)
"""
# A worker that dies before it serves.
BROKEN = "import sys; sys.exit(3)"


class RecordingRollout:
    """Records every call in order. `stuck` instances keep that many trajectories past a drain's
    deadline; `inflight` is what a cut aborts."""

    def __init__(self, inflight: dict[str, int] | None = None, stuck: dict[str, int] | None = None):
        self.calls: list[tuple] = []
        self.inflight = dict(inflight or {})
        self.stuck = dict(stuck or {})
        self.registered: dict[str, tuple[int, str]] = {}
        self.routed: set[str] = set()
        self.expected: list[tuple[int, ...]] = []
        """Each `expect` call's TP sizes, apart from `calls`."""

    def drain(self, instance_id: str, timeout_s: float) -> int:
        self.calls.append(("drain", instance_id, timeout_s))
        self.routed.discard(instance_id)
        left = self.stuck.get(instance_id, 0)
        self.inflight[instance_id] = left
        return left

    def cut(self, instance_id: str) -> int:
        self.calls.append(("cut", instance_id))
        self.routed.discard(instance_id)
        return self.inflight.pop(instance_id, 0)

    def restore(self, instance_id: str) -> None:
        self.calls.append(("restore", instance_id))
        self.routed.add(instance_id)

    def remove_instance(self, instance_id: str) -> None:
        self.calls.append(("remove", instance_id))
        del self.registered[instance_id]

    def add_instance(self, instance_id: str, worker_id: str, tp: int, address: str) -> None:
        self.calls.append(("add", instance_id, tp, address))
        self.registered[instance_id] = (tp, address)
        self.routed.add(instance_id)

    def set_bucket_thresholds(self, thresholds) -> None:
        self.calls.append(("thresholds", thresholds))

    def expect(self, tp_sizes: tuple[int, ...]) -> None:
        self.expected.append(tuple(tp_sizes))


class RecordingTraining:
    """Records the training side's calls; a release creates the hybrid's release file."""

    def __init__(self, release_dir: Path):
        self.calls: list[tuple] = []
        self.release_dir = release_dir
        self.generations: dict[int, int] = {}

    def release_file(self, replica: int) -> Path:
        return self.release_dir / f"release-{replica}"

    def request_join(self, replica: int) -> HybridJoin:
        self.generations[replica] = self.generations.get(replica, 0) + 1
        self.calls.append(("join", replica, self.generations[replica]))
        self.release_file(replica).unlink(missing_ok=True)
        return HybridJoin(self.generations[replica], ("127.0.0.1:9",))

    def cancel_join(self, replica: int, generation: int, reason: str) -> None:
        self.calls.append(("cancel_join", replica, generation, reason))

    def request_release(self, replica: int) -> None:
        self.calls.append(("release", replica))
        self.release_file(replica).touch()

    def checkpoint(self) -> str:
        self.calls.append(("checkpoint",))
        return "ckpt-1"

    def stop_training(self) -> None:
        self.calls.append(("stop_training",))

    def start_training(self, layout: RestartTraining) -> None:
        self.calls.append(("start_training", layout.new_devices))

    def load_checkpoint(self, checkpoint: str) -> None:
        self.calls.append(("load", checkpoint))


class SleeperLauncher:
    """Sleepers for every worker; instance ids containing `broken` die at once, and a hybrid
    replica in `missing_command` names no executable (StartWorker refuses it)."""

    def __init__(
        self, work_dir: Path, training: RecordingTraining, missing_command: frozenset[int] = frozenset()
    ):
        self.work_dir = work_dir
        self.training = training
        self.missing_command = missing_command

    def rollout_instance(self, action: StartRolloutInstance) -> LaunchSpec:
        ready = self.work_dir / f"{action.instance_id}.addr"
        if "broken" in action.instance_id:
            return LaunchSpec((sys.executable, "-c", BROKEN), ready_file=str(ready))
        address = f"127.0.0.1:{7000 + action.devices[0]}"
        return LaunchSpec((sys.executable, "-c", SLEEPER, str(ready), address), ready_file=str(ready))

    def hybrid_replica(self, action: JoinHybridReplica, join: HybridJoin) -> LaunchSpec:
        if action.replica in self.missing_command:
            return LaunchSpec(("/nonexistent/libra-hybrid-worker",))
        ready = self.work_dir / f"hybrid-{action.replica}-g{join.generation}.ready"
        release = self.training.release_file(action.replica)
        argv = (sys.executable, "-c", SLEEPER, str(ready), join.lane_addresses[0], str(release))
        return LaunchSpec(argv, ready_file=str(ready))
