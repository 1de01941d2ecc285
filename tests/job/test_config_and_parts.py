"""The job's pure parts: config validation and overrides, the task stream, the last-turn reward
input, and the report built from a run folder's JSONL files."""

from __future__ import annotations

import dataclasses
import json

import pytest

from libra.config import LibraConfig, load_config
from libra.job.config import JobConfig
from libra.job.recorder import JobEvent
from libra.job.report import write_report
from libra.job.rollouts import TaskStream, _last_model_turn
from libra.job.setup import launch_scheduler
from libra.scheduler import CmlfqRouter, fair_queue_length
from libra.trajectory import Trajectory

CONFIG = "configs/tiny_cpu.py"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(num_steps=0), "job.num_steps"),
        (dict(group_size=1), "job.group_size"),
        (dict(router="fastest"), "job.router"),
        (dict(rollout_tp_sizes="1,2"), "job.rollout_tp_sizes"),
        (dict(rollout_tp_sizes=[1, "2"]), "job.rollout_tp_sizes"),
        (dict(rollout_tp_sizes=(1, 0)), "job.rollout_tp_sizes"),
        (dict(checkpoint_interval=-1), "job.checkpoint_interval"),
    ],
)
def test_bad_job_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        JobConfig(**overrides)


def test_unknown_router_lists_the_allowed_values():
    with pytest.raises(ValueError, match="cmlfq"):
        JobConfig(router="fifo")


def test_config_file_and_overrides():
    config = load_config(
        CONFIG,
        [
            "job.num_steps=3",
            "run_dir=/tmp/x",
            # The trainer scores under the sampling temperature (LibraConfig checks they agree).
            "rollout.agent.temperature=0.5",
            "training.grpo.temperature=0.5",
            "training.lr=0.01",
        ],
    )
    job = config.job
    assert (config.run_dir, job.num_steps, config.rollout.agent.temperature, config.training.lr) == (
        "/tmp/x",
        3,
        0.5,
        0.01,
    )
    assert job.rollout_tp_sizes == () and config.training.train_batch_size == 8 * 8  # () planned
    assert load_config(CONFIG, ["job.rollout_tp_sizes=1,1,2"]).job.rollout_tp_sizes == (1, 1, 2)
    with pytest.raises(ValueError, match="unknown config option 'job.num_stepz'"):
        load_config(CONFIG, ["job.num_stepz=3"])
    with pytest.raises(ValueError, match=r"'job.rollout_tp_sizes': cannot read 'x' as int"):
        load_config(CONFIG, ["job.rollout_tp_sizes=1,x"])


def test_the_train_batch_is_derived_from_the_jobs_and_a_conflict_names_both():
    config = load_config(CONFIG, ["job.group_size=4", "job.prompts_per_step=3"])
    assert config.training.train_batch_size == 12
    assert config.resolved() == config  # idempotent
    assert load_config(CONFIG, ["training.train_batch_size=12", "job.group_size=4", "job.prompts_per_step=3"])
    with pytest.raises(ValueError) as error:
        load_config(CONFIG, ["training.train_batch_size=16", "job.group_size=4"])
    assert (
        "training.train_batch_size (16) must equal job.prompts_per_step x job.group_size (8 x 4 = 32)"
        in str(error.value)
    )
    # A config built in code is completed by the job (GrpoJob calls `resolved`).
    assert LibraConfig().training.train_batch_size is None
    assert LibraConfig().resolved().training.train_batch_size == 64


def test_each_rollout_tp_size_needs_a_scheduler_bucket():
    with pytest.raises(ValueError) as error:
        load_config(CONFIG, ["job.rollout_tp_sizes=1,4"])
    assert (
        "job.rollout_tp_sizes has TP sizes [4] without a bucket; scheduler.buckets have TP sizes [1, 2]"
        in str(error.value)
    )
    assert load_config(CONFIG, ["scheduler.max_queue_length=4"]).scheduler.max_queue_length == 4


def test_a_cap_left_0_is_derived_at_launch_from_the_trajectories_in_flight_and_the_pools_weight(caplog):
    """8 prompts x 4 trajectories, launched up to 2 versions ahead: 96 in flight over TP-1, TP-1
    and TP-2 instances weighing 1, 1 and 3 -> ceil(96 / 5) = 20 per unit of weight. A cap the
    config sets is kept; the router refuses one left unresolved."""
    weights = {1: 1, 2: 3}.__getitem__
    config = load_config(
        CONFIG,
        [
            "job.prompts_per_step=8",
            "job.group_size=4",
            "training.max_staleness=2",
            "job.rollout_tp_sizes=1,1,2",
            "scheduler.max_queue_length=0",
        ],
    )
    assert launch_scheduler(config, weights).max_queue_length == 20
    assert launch_scheduler(config, weights).buckets == config.scheduler.buckets
    # 64 in flight launched 1 version ahead: a fair share of 13, under the 16 set by hand.
    kept = load_config(
        CONFIG,
        [
            "job.prompts_per_step=8",
            "job.group_size=4",
            "job.rollout_tp_sizes=1,1,2",
            "scheduler.max_queue_length=16",
        ],
    )
    assert kept.training.max_staleness == 1
    assert launch_scheduler(kept, weights).max_queue_length == kept.scheduler.max_queue_length == 16
    assert "below the fair share" not in caplog.text
    low = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_queue_length=3))
    assert launch_scheduler(low, weights).max_queue_length == 3  # kept, with a warning
    assert "max_queue_length 3 per unit of weight is below the fair share of the 96" in caplog.text
    caplog.clear()
    one_size = dataclasses.replace(low, job=dataclasses.replace(low.job, rollout_tp_sizes=(1, 1, 1)))
    launch_scheduler(one_size, weights)
    least_load = dataclasses.replace(low, job=dataclasses.replace(low.job, router="least_load"))
    launch_scheduler(least_load, weights)
    assert "below the fair share" not in caplog.text  # one bucket, or a router that moves nobody
    # 0.25 x 80 x 5 >= 96: the pool would always count as draining.
    high = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_queue_length=80))
    assert launch_scheduler(high, weights).max_queue_length == 80
    assert "max_queue_length 80 per unit of weight is so far above the fair share" in caplog.text
    # A job derives it unless told; the embedded CPU default runs as the accelerator configs do.
    assert LibraConfig().scheduler.max_queue_length == load_config(CONFIG, []).scheduler.max_queue_length == 0
    # Never below the original's 3, however large the pool.
    assert (
        fair_queue_length(10, 100) == 3 and fair_queue_length(96, 5) == 20 and fair_queue_length(96, 0) == 96
    )
    with pytest.raises(ValueError, match="max_queue_length is 0"):
        CmlfqRouter(config.scheduler)
    with pytest.raises(ValueError, match="max_queue_length must be in 0.."):
        load_config(CONFIG, ["scheduler.max_queue_length=-1"])


def test_task_stream_is_a_seeded_permutation_per_epoch_and_resumable():
    tasks = [f"task{i}" for i in range(7)]
    stream = TaskStream(tasks, seed=3)
    first_epoch = [stream.next()[0] for _ in range(7)]
    assert sorted(first_epoch) == list(range(7))
    rest = [stream.next()[0] for _ in range(5)]
    resumed = TaskStream(tasks, seed=3, position=7)
    assert [resumed.next()[0] for _ in range(5)] == rest
    with pytest.raises(ValueError, match="at least one task"):
        TaskStream([], seed=0)


def test_last_model_turn_stops_at_the_tool_result():
    t = Trajectory("t", "p", "g", [1, 2])
    t.append([10, 11], [-0.1, -0.2], 0)
    t.append([20, 21, 22], None, 0)  # a tool result (loss mask 0)
    t.append([30, 31], [-0.3, -0.4], 1)
    assert _last_model_turn(t) == [30, 31]


def test_report_from_run_folder(tmp_path):
    rows = []
    for step in range(1, 7):
        rows.append(
            dict(
                step=step,
                time_s=10.0 * step,
                mean_reward=0.1 * step,
                num_trajectories=16,
                num_dropped_stale=0,
                generated_tokens=500,
                rollout_tokens_per_s=100.0 + step,
                trained_tokens_per_s=50.0,
                step_time_s=10.0,
                train_time_s=2.0,
                publish_time_s=0.1,
                loss=0.0,
                pg_loss=0.0,
                entropy=1.0,
                grad_norm=0.5,
                mean_turns=2.0,
                tool_use_rate=0.5,
                mean_staleness=0.5,
                logprob_abs_diff=1e-6,
                logprob_max_abs_diff=1e-6 * step,
                num_current_tokens=100 if step > 1 else 0,
            )
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    occupancy = [
        {"time_s": t, "buckets": {"short": t % 3, "long": 0}, "tokens_per_s": 90.0, "instances": {},
         "migrations": t // 10, "devices": {"rollout": [t % 2, 2], "train": [t % 4 == 0, 1]}}
        for t in range(60)
    ]  # fmt: skip
    (tmp_path / "occupancy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in occupancy))
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"time_s": 20.0, "kind": "instance_lost", "message": "x"}) + "\n"
    )
    evaluations = [
        {"when": when, "version": version, "num_tasks": 32, "samples_per_task": 4, "mean_reward": reward,
         "tool_use_rate": tools}
        for when, version, reward, tools in (("before", 0, 0.0625, 0.7), ("after", 6, 0.25, 0.95))
    ]  # fmt: skip
    (tmp_path / "evaluations.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    # Samples 0-7 solved before, 4-35 after: 28 gained, 4 lost of the 128 seeded pairs; the
    # unseeded ones (a user agent's, 128-135) pair with nothing.
    solved = {"before": range(8), "after": range(4, 36)}
    samples = [
        {"when": when, "version": version, "task": i // 4, "sample": i % 4,
         "seed": 1000 + i if i < 128 else None,
         "reward": float(i in solved[when] or (when == "after" and i >= 128))}
        for when, version in (("before", 0), ("after", 6))
        for i in range(136)
    ]  # fmt: skip
    (tmp_path / "evaluation_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    report = write_report(tmp_path).read_text()
    assert "first 5 steps: 0.300; last 5 steps: 0.400" in report
    assert (
        "held-out before (version 0, 32 tasks x 4, never trained on): reward 0.062, tool use 0.70" in report
    )
    assert "held-out after (version 6, 32 tasks x 4, never trained on): reward 0.250, tool use 0.95" in report
    # Mean difference 24/128; its standard deviation sqrt((32 - 128 * 0.1875^2) / 127) = 0.4653,
    # over sqrt(128): 0.0411.
    assert (
        "paired (the same seeded samples before and after): +0.188 ± 0.041 (one standard error over" in report
    )
    assert "128 samples); 28 samples gained, 4 lost" in report
    assert "instance_lost" in report and report.count("\n| ") == 6 + 2
    assert "logprob gap over 5 steps (500 tokens): mean 1.0e-06, max 6.0e-06" in report
    # Rollout: 30 busy device-samples of 120 held; train: 15 of 60.
    assert "device utilisation (60 1 s samples, busy / held): rollout 25 %, train 25 %" in report
    assert "migrations (tool returns routed to another instance): 5" in report
    for name in ("reward", "throughput", "occupancy"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000


def test_prometheus_endpoint_serves_the_step_metrics():
    import urllib.request

    from libra.job.prometheus import JobMetrics
    from libra.job.recorder import ClusterSample, InstanceSample, StepMetrics

    def sample(instances: dict, migrations: int) -> ClusterSample:
        return ClusterSample(
            {"short": 5, "long": 1}, 123.0, instances, migrations, {"rollout": (2, 3), "train": (1, 1)}
        )

    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10).read().decode()

    metrics = JobMetrics(port=0)
    try:
        values = dict.fromkeys(StepMetrics.__dataclass_fields__, 0)
        metrics.on_step(StepMetrics(**{**values, "step": 3, "mean_reward": 0.25, "num_dropped_stale": 2}))
        two = {"0": InstanceSample(2, "long", 1, 80.0, 0.5), "1": InstanceSample(1, "short", 5, 43.0, 0.25)}
        metrics.on_occupancy(sample(two, 4))
        metrics.on_event(JobEvent.INSTANCE_LOST, {})
        metrics.on_event(JobEvent.PLAN_APPLIED, {"plan_version": 2})
        metrics.on_event(JobEvent.PLAN_REJECTED, {"plan_version": 2})
        text = scrape()
        metrics.on_occupancy(sample({"1": two["1"]}, 7))  # instance 0 gone, three more migrations
        later = scrape()
    finally:
        metrics.close()
    for line in (
        "libra_policy_version 3.0",
        "libra_mean_reward 0.25",
        "libra_dropped_stale_total 2.0",
        'libra_bucket_requests_in_flight{bucket="short"} 5.0',
        "libra_rollout_tokens_per_second 123.0",
        'libra_instance_events_total{kind="instance_lost"} 1.0',
        'libra_instance_tokens_per_second{bucket="long",instance="0",tp="2"} 80.0',
        'libra_instance_requests_in_flight{bucket="short",instance="1",tp="1"} 5.0',
        'libra_instance_kv_cache_usage{bucket="long",instance="0",tp="2"} 0.5',
        'libra_stage_devices{stage="rollout",state="busy"} 2.0',
        'libra_stage_devices{stage="train",state="held"} 1.0',
        "libra_migrations_total 4.0",
        'libra_planner_events_total{kind="plan_applied"} 1.0',
        'libra_planner_events_total{kind="plan_rejected"} 1.0',
        "libra_plan_version 2.0",
    ):
        assert line in text, line
    assert "libra_migrations_total 7.0" in later
    assert 'instance="0"' not in later
    assert 'libra_instance_tokens_per_second{bucket="short",instance="1",tp="1"} 43.0' in later


def test_events_are_recorded_under_their_kinds_string(tmp_path):
    from libra.job.planning import HYBRID_STATE_EVENTS
    from libra.job.recorder import RunRecorder, read_jsonl
    from libra.training.elastic import ReplicaState

    recorder = RunRecorder(tmp_path)
    recorder.event(JobEvent.HYBRID_ROLLED_BACK, "hybrid replica 1 rolled back", replica=1)
    recorder.close()
    (row,) = read_jsonl(tmp_path / "events.jsonl")
    assert (row["kind"], row["replica"]) == ("hybrid_rolled_back", 1) and type(row["kind"]) is str
    # Every state a hybrid lane reports has its event kind.
    assert set(HYBRID_STATE_EVENTS) == set(ReplicaState)
