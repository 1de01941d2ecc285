"""A shortened run of the embedded default (configs/tiny_cpu.py) end to end: a Megatron train rank,
rollout instances in a TP-1 and a TP-2 bucket under C-MLFQ (a TP-2 + TP-1 launch, stated: the
planner would launch three TP-1 instances, and the loss of a two-worker instance is what is
tested here), the planner in the loop, its batch, learning rate and staleness, for 20 steps with a
held-out evaluation before the first and after the last; the TP-2 rollout instance is SIGKILLed
in the first step's rollouts. (Resuming from a checkpoint is `test_controller_kill.py`'s; the
planned launch is `test_environment_job.py`'s and `test_planning_parts.py`'s.)

It learns (issue #10): the warm-started policy skips its tool on a share of its sampled
trajectories (`WarmStartConfig.direct_answer_fraction`) and then almost always fails; GRPO teaches
it to call the tool. The held-out evaluation rolls the same 96 tasks out, 8 samples each, with the
same sampling, so the comparison is free of the prompt-mix noise of single training batches.
Measured (unseeded evaluations, 8 samples a task, 20 steps): tool use 0.75 -> 0.99, 0.75 -> 0.88,
0.76 -> 0.98 and 0.83 -> 1.00; reward 0.17 -> 0.24, 0.17 -> 0.23, 0.158 -> 0.230 and, once (a
CI run), 0.163 -> 0.148. Tool use rises by 0.13-0.30, the reward by less (sampled copying through
the tool, ~15-25 % success, is what tool use multiplies), and two independent evaluations of 768
samples differ by ~0.02 (one standard error) by the draw alone: the same policy scored 0.158,
0.163 and 0.195 before training. So each (task, sample) is now seeded, the same before and after
(`GroupRollout(seed=job.seed)`): a pair differs by what training changed. Measured: reward 0.156
-> 0.246, tool use 0.73 -> 0.99, 254 of 768 samples token for token the same after 20 steps, 82
gained and 13 lost; the paired standard error of the gain 0.012 (0.020 had the two evaluations
been independent). Tool use is asserted to rise by 0.10 (five standard errors: no chance rise
reaches it) and the reward to rise, not by how much.

Needs the warm-started tiny policy (built once per machine and cached under ~/.cache/libra; the
first build takes several minutes), about 9 GB of memory and 8-10 minutes: three vLLM engines
(one of them TP-2: two workers), a Megatron train rank, the controller and a node agent, all real
processes on loopback.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from libra.config import load_config
from libra.control.client import ClusterClient
from libra.control.config import ControlConfig
from libra.control.types import EventKind
from libra.job.fleet import WorkerKind
from libra.job.loop import GrpoJob, JobResult
from libra.job.recorder import read_jsonl
from libra.job.report import write_report
from libra.logs import LOG_DIR_ENV
from libra.scheduler import fair_queue_length
from libra.trace import read_traces

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start, pytest.mark.timeout(1500)]

NUM_STEPS = 20
CHECKPOINT_INTERVAL = 5
KILL_AFTER_S = 2.0
"""Into the first step's rollouts: after the held-out evaluation, before the first step ends (the
planner, which acts at step boundaries, cannot have changed the layout yet), and early, so that
the restarted instance (30-60 s to start on a loaded 2-core box) rejoins before the run ends."""
OVERRIDES = [
    "job.rollout_tp_sizes=2,1",
    f"job.num_steps={NUM_STEPS}",
    f"job.checkpoint_interval={CHECKPOINT_INTERVAL}",
    "job.live_progress=false",
    "job.eval_samples=8",
]
if os.environ.get("LIBRA_JOB_TEST_MODEL"):
    # A given policy folder instead of the cached warm-started one (it must hold the procedural
    # collection, like the warm-started model does).
    OVERRIDES.append(f"job.model={os.environ['LIBRA_JOB_TEST_MODEL']}")
LOST_OUTCOMES = {"error", "no_instance", "aborted", "running"}


def _kill_the_tp2_instance(job: GrpoJob, run_dir: Path, killed: dict) -> None:
    """SIGKILLs rollout-0 (the TP-2 instance: its engine and both workers) `KILL_AFTER_S` into the
    first step's rollouts."""
    while not read_jsonl(run_dir / "evaluations.jsonl"):
        if killed.get("stop"):
            return
        time.sleep(0.2)
    time.sleep(KILL_AFTER_S)
    pids = job.workers.fleet.pids(WorkerKind.ROLLOUT_INSTANCE)
    killed["worker"] = "rollout-0"
    killed["tp"] = job.workers.fleet.get("rollout-0").tp_size
    killed["at"] = time.monotonic()
    os.killpg(pids["rollout-0"], signal.SIGKILL)
    # A client of the controller's gRPC API follows the job as `libra status --watch` does.
    address = (run_dir / "controller.addr").read_text().strip()
    seen = killed.setdefault("job_events", [])
    last_sequence = 0
    with ClusterClient(address, (run_dir / "token").read_text().strip(), ControlConfig()) as client:
        while not killed.get("stop"):
            try:
                for event in client.watch_events(after_sequence=last_sequence, kinds=[EventKind.JOB]):
                    last_sequence = event.sequence
                    seen.append(event.message)
                    lost = any(m.startswith("instance_lost:") for m in seen)
                    if lost and event.message.startswith("step "):
                        return
            except grpc.RpcError:
                # A stream broken under load is resumed after the last event seen; once the job
                # has ended (`stop`), its controller is gone for good.
                time.sleep(0.5)


def _sample_the_routers_cap(job: GrpoJob, killed: dict) -> None:
    """Records each new value of the router's trajectory cap (derived from the pool in service)
    until the run ends: an instance is down for 30-60 s, far longer than the 0.1 s between looks."""
    caps = killed.setdefault("caps", [])
    while not killed.get("stop"):
        instances = getattr(getattr(job, "workers", None), "instances", None)
        if instances is not None:
            cap = instances.pool.router.config.max_queue_length
            if not caps or caps[-1][1] != cap:
                caps.append((time.monotonic(), cap))
        time.sleep(0.1)


@pytest.fixture(scope="module")
def killed() -> dict:
    """What the killer thread did and saw."""
    return {}


@pytest.fixture(scope="module")
def job_events(run_dir, killed) -> list[str]:
    return killed["job_events"]


@pytest.fixture(scope="module")
def result(tmp_path_factory, killed) -> JobResult:
    run_dir = tmp_path_factory.mktemp("job") / "run"
    config = load_config("configs/tiny_cpu.py", [f"run_dir={run_dir}", *OVERRIDES])
    job = GrpoJob(config)
    killer = threading.Thread(target=_kill_the_tp2_instance, args=(job, run_dir, killed))
    killer.start()
    sampler = threading.Thread(target=_sample_the_routers_cap, args=(job, killed))
    sampler.start()
    # Structured logs of every process the job starts (the agent passes its environment on).
    os.environ[LOG_DIR_ENV] = str(run_dir / "logs")
    try:
        result = job.run()
    finally:
        del os.environ[LOG_DIR_ENV]
        killed["stop"] = True
        killer.join()
        sampler.join()
    assert killed.get("worker") == "rollout-0", "the instance was never killed"
    assert result.version == NUM_STEPS
    write_report(run_dir)
    return result


@pytest.fixture(scope="module")
def run_dir(result) -> Path:
    return result.run_dir


def test_the_default_layout_mixes_tp_sizes_under_cmlfq(run_dir, killed):
    assert killed["tp"] == 2
    launch = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "started")
    assert launch["message"].startswith("2 rollout instances"), launch
    # C-MLFQ placed trajectories in both buckets of the launch layout (1 s occupancy samples; the
    # planner may change the layout later, by its cost model).
    steps = read_jsonl(run_dir / "metrics.jsonl")
    occupancy = [r for r in read_jsonl(run_dir / "occupancy.jsonl") if r["time_s"] <= steps[-1]["time_s"]]
    busy = {name for row in occupancy for name, n in row["buckets"].items() if n > 0}
    assert busy == {"short", "long"}, busy
    assert {i["tp"] for row in occupancy for i in row["instances"].values()} == {1, 2}
    before_kill = [r for r in occupancy if r["time_s"] <= steps[0]["time_s"]]
    assert max(r["devices"]["rollout"][1] for r in before_kill) == 3  # TP-2 + TP-1 held at launch
    # The cap left 0 is derived from the 128 trajectories in flight (64 a step, one version ahead)
    # over the weight in service: TP-1 weighs 1 and TP-2 2 on the CPU backend (its KV per device
    # is fixed), so 43 at launch (it moves as the instances join), and 128 once the killed TP-2
    # instance is out.
    assert launch["max_queue_length"] == fair_queue_length(128, 1 + 2) == 43
    caps = killed["caps"]
    assert caps[0][1] == 43, caps
    assert [cap for at, cap in caps if at <= killed["at"]][-1] == 43, caps  # both instances joined
    assert fair_queue_length(128, 1) in [cap for at, cap in caps if at > killed["at"]], caps


def test_held_out_reward_and_tool_use_rise(result, run_dir):
    before, after = result.evaluations
    assert (before.when, before.version, after.when, after.version) == ("before", 0, "after", NUM_STEPS)
    assert before.num_tasks == after.num_tasks >= 64
    assert after.tool_use_rate >= before.tool_use_rate + 0.10, result.evaluations
    assert after.mean_reward > before.mean_reward, result.evaluations
    # Each (task, sample) recorded in both, seeded the same, its reward adding up to the mean.
    rows = read_jsonl(run_dir / "evaluation_samples.jsonl")
    for evaluation in result.evaluations:
        mine = [r for r in rows if r["when"] == evaluation.when and r["version"] == evaluation.version]
        assert sorted((r["task"], r["sample"]) for r in mine) == [
            (task, sample)
            for task in range(evaluation.num_tasks)
            for sample in range(evaluation.samples_per_task)
        ]
        assert sum(r["reward"] for r in mine) / len(mine) == pytest.approx(evaluation.mean_reward)
    seeds = {when: [r["seed"] for r in rows if r["when"] == when] for when in ("before", "after")}
    assert seeds["before"] == seeds["after"] and len(set(seeds["before"])) == len(rows) // 2


def test_training_batches_call_the_tool_more(run_dir):
    steps = read_jsonl(run_dir / "metrics.jsonl")[:NUM_STEPS]
    first, last = steps[:5], steps[-5:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "tool_use_rate") >= mean(first, "tool_use_rate") + 0.1, steps
    # Not the reward: five batches of 8 prompts on each side, whose difficulty moves their mean
    # reward by a few hundredths, about as much as 20 steps raise it (0.03-0.12 held out); which
    # side wins then depends on the sampling path, i.e. on the machine's rounding. The held-out
    # evaluation (the same tasks before and after) compares the reward instead.


def test_every_trajectory_ends_with_an_outcome_and_a_reward(run_dir):
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert len(samples) >= NUM_STEPS * 64
    assert not [s for s in samples if s["outcome"] in LOST_OUTCOMES], "trajectories were lost"
    assert {s["reward"] for s in samples} <= {0.0, 1.0}
    traces = read_traces(run_dir / "trajectories.jsonl")  # the simulator's format, validated
    assert [t.trajectory_id for t in traces] == [s["trajectory_id"] for s in samples]
    assert any(len(t.turns) > 1 for t in traces), "no trajectory called a tool"


def test_versions_advance_and_instances_run_the_trainers_weights(run_dir):
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    assert all(s["num_trajectories"] > 0 for s in steps)
    # Rollouts sampled by versions published during the run (not only the initial weights).
    versions = {v for s in read_jsonl(run_dir / "samples.jsonl") for v in s["policy_versions"]}
    assert max(versions) >= NUM_STEPS - 2
    # The instances' sampling logprobs equal the trainer's under the same version: publication
    # delivered exactly the trainer's weights (fp32 on both sides). The "after" evaluation is
    # sampled by the last published version with the trainer at it, so it always compares (a
    # training batch only where it holds tokens of the trainer's version: with staleness 1 and
    # rollout ahead of training, most hold none, and on a slow machine possibly none at all).
    after = next(e for e in read_jsonl(run_dir / "evaluations.jsonl") if e["when"] == "after")
    assert after["version"] == NUM_STEPS and after["num_compared_tokens"] > 0, after
    assert after["logprob_max_abs_diff"] < 1e-4, after
    diffs = [s["logprob_max_abs_diff"] for s in steps if s["num_current_tokens"] > 0]
    assert all(d < 1e-3 for d in diffs), diffs
    assert max(s["mean_staleness"] for s in steps) <= 2.0  # max_staleness 1 + tail_staleness 1


def test_job_progress_is_followed_through_the_controller_api(run_dir, job_events):
    lost = next(i for i, m in enumerate(job_events) if m.startswith("instance_lost:"))
    assert any(m.startswith("step ") and ": reward " in m for m in job_events[lost:]), job_events


def test_killed_instance_is_restarted_and_rejoins(run_dir):
    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert "instance_lost" in kinds and "instance_restarted" in kinds
    restarted = next(e for e in events if e["kind"] == "instance_restarted")
    # It was brought to the weights current at its restart (LoadWeights checks the version it
    # reports) and rejoined the pool (which the planner may have changed meanwhile).
    published = [s for s in read_jsonl(run_dir / "metrics.jsonl") if s["time_s"] < restarted["time_s"]]
    assert restarted["version"] >= len(published) - 1  # the current version (one may be publishing)
    # The same instance (its name and pool id: nothing rebound), run by a new process.
    lost = next(e for e in events if e["kind"] == "instance_lost")
    assert restarted["message"] == "rollout-0 restarted (worker rollout-0.r1)"
    assert restarted["instance_id"] == lost["instance_id"] == 0


def test_run_folder_has_report_checkpoints_and_tensorboard(run_dir):
    report = (run_dir / "report.md").read_text()
    assert "mean reward" in report and "instance_lost" in report and "device utilisation" in report
    assert "held-out reward gain, paired" in report
    for name in ("reward", "throughput", "occupancy"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 1000
    for step in range(CHECKPOINT_INTERVAL, NUM_STEPS + 1, CHECKPOINT_INTERVAL):
        assert (run_dir / "checkpoints" / f"step_{step:06d}" / "job_state.json").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_every_worker_writes_structured_logs(run_dir):
    by_process = {}
    for path in (run_dir / "logs").glob("*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        by_process.setdefault(path.stem.rsplit("-", 1)[0], []).extend(records)  # <process>-<pid>
    # Two instances at start (three engine processes: the TP-2 one has a second worker) and the
    # restarted one; the train rank; the node agent.
    assert {"agent", "rollout-instance", "train-rank-0"} <= set(by_process), sorted(by_process)
    for records in by_process.values():
        assert all({"time", "level", "logger", "pid", "message"} <= set(r) for r in records)
    assert any("rollout instance serving" in r["message"] for r in by_process["rollout-instance"])
