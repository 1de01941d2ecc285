"""The job's Prometheus endpoint (served by the controller process, `job.metrics_port`): per-step
gauges (reward, step/train/publish times, staleness, stale drops, the train/inference logprob
gap); sampled every second, rollout throughput, requests in flight per bucket and per instance,
each instance's tokens/s and KV-cache use, busy and held devices per stage, migrations; counters
of trajectories, instance losses and restarts, and planner decisions and actions by kind, with
the version of the plan last adopted."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from libra.job.recorder import ClusterSample, JobEvent, StepMetrics

FAULT_EVENTS = frozenset({JobEvent.INSTANCE_LOST, JobEvent.INSTANCE_RESTARTED})
"""Counted by `libra_instance_events_total`."""
PLANNER_EVENTS = frozenset(
    {
        JobEvent.PLAN_FAILED,
        JobEvent.PLAN_REPLANNED,
        JobEvent.PLAN_REFUSED,
        JobEvent.PLAN_EXECUTING,
        JobEvent.PLAN_EXECUTED,
        JobEvent.PLAN_APPLIED,
        JobEvent.PLAN_PROPOSED,
        JobEvent.PLAN_REJECTED,
        JobEvent.PLAN_VETOED,
        JobEvent.PLAN_ACTION,
        JobEvent.HYBRID_REQUESTED,
        JobEvent.HYBRID_FETCHING_STATE,
        JobEvent.HYBRID_ZERO_SYNC,
        JobEvent.HYBRID_ACTIVATING,
        JobEvent.HYBRID_ACTIVE,
        JobEvent.HYBRID_RELEASING,
        JobEvent.HYBRID_RELEASED,
        JobEvent.HYBRID_ROLLED_BACK,
        JobEvent.HYBRID_RETIRED,
    }
)
"""Counted by `libra_planner_events_total`: the planner's decisions and actions, and the hybrid
replicas' states."""


class JobMetrics:
    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("libra_policy_version", "Trainer policy version (train steps taken)", registry=r)
        self.reward = Gauge("libra_mean_reward", "Mean reward of the last train batch", registry=r)
        self.step_seconds = Gauge("libra_step_seconds", "Wall time of the last step", ["phase"], registry=r)
        self.staleness = Gauge("libra_mean_staleness", "Mean policy lag of the last batch", registry=r)
        self.dropped = Counter("libra_dropped_stale_total", "Trajectories dropped as too stale", registry=r)
        self.trajectories = Counter("libra_trajectories_trained_total", "Trajectories trained on", registry=r)
        self.tokens_per_s = Gauge("libra_rollout_tokens_per_second", "Generated tokens/s (all instances)",
                                  registry=r)  # fmt: skip
        self.trained_tokens_per_s = Gauge(
            "libra_trained_tokens_per_second",
            "Model tokens trained on per second of the last step",
            registry=r,
        )
        self.in_flight = Gauge("libra_bucket_requests_in_flight", "Requests in flight per bucket", ["bucket"],
                               registry=r)  # fmt: skip
        self.logprob_gap = Gauge("libra_logprob_gap", "Train/inference |logprob diff| of the last step",
                                 ["stat"], registry=r)  # fmt: skip
        self.faults = Counter("libra_instance_events_total", "Rollout instance losses and restarts", ["kind"],
                              registry=r)  # fmt: skip
        labels = ["instance", "tp", "bucket"]
        self.instance_tokens_per_s = Gauge(
            "libra_instance_tokens_per_second", "Generated tokens/s per instance", labels, registry=r
        )
        self.instance_requests = Gauge(
            "libra_instance_requests_in_flight", "Requests in flight per instance", labels, registry=r
        )
        self.instance_kv = Gauge(
            "libra_instance_kv_cache_usage", "KV-cache share in use per instance", labels, registry=r
        )
        self.devices = Gauge(
            "libra_stage_devices", "Devices per stage, busy or held", ["stage", "state"], registry=r
        )
        self.migrations = Counter(
            "libra_migrations_total", "Tool returns routed to another instance", registry=r
        )
        self.planner = Counter(
            "libra_planner_events_total", "Planner decisions, actions and hybrid states", ["kind"], registry=r
        )
        self.plan_version = Gauge("libra_plan_version", "Version of the plan last adopted", registry=r)
        self._migrations_seen = 0
        self._instances_seen: set[tuple[str, str, str]] = set()
        self.server, _ = start_http_server(port, addr=host, registry=r)
        self.port = self.server.server_port

    def on_step(self, m: StepMetrics) -> None:
        self.step.set(m.step)
        self.reward.set(m.mean_reward)
        for phase, seconds in (
            ("total", m.step_time_s),
            ("train", m.train_time_s),
            ("publish", m.publish_time_s),
        ):
            self.step_seconds.labels(phase).set(seconds)
        self.staleness.set(m.mean_staleness)
        self.trained_tokens_per_s.set(m.trained_tokens_per_s)
        if m.num_current_tokens:  # the gap is NaN for steps without a comparable trajectory
            self.logprob_gap.labels("mean").set(m.logprob_abs_diff)
            self.logprob_gap.labels("max").set(m.logprob_max_abs_diff)
        self.dropped.inc(m.num_dropped_stale)
        self.trajectories.inc(m.num_trajectories)

    def on_occupancy(self, sample: ClusterSample) -> None:
        self.tokens_per_s.set(sample.tokens_per_s)
        for bucket, count in sample.buckets.items():
            self.in_flight.labels(bucket).set(count)
        current = {(i, str(s.tp), s.bucket) for i, s in sample.instances.items()}
        for gone in self._instances_seen - current:  # a lost or retired instance leaves the series
            for gauge in (self.instance_tokens_per_s, self.instance_requests, self.instance_kv):
                gauge.remove(*gone)
        self._instances_seen = current
        for instance_id, s in sample.instances.items():
            labels = (instance_id, str(s.tp), s.bucket)
            self.instance_tokens_per_s.labels(*labels).set(s.tokens_per_s)
            self.instance_requests.labels(*labels).set(s.requests)
            self.instance_kv.labels(*labels).set(s.kv_cache_usage)
        for stage, (busy, held) in sample.devices.items():
            self.devices.labels(stage, "busy").set(busy)
            self.devices.labels(stage, "held").set(held)
        self.migrations.inc(max(sample.migrations - self._migrations_seen, 0))
        self._migrations_seen = sample.migrations

    def on_event(self, kind: JobEvent, extra: dict) -> None:
        if kind in FAULT_EVENTS:
            self.faults.labels(kind).inc()
        if kind in PLANNER_EVENTS:
            self.planner.labels(kind).inc()
        if kind == JobEvent.PLAN_APPLIED and "plan_version" in extra:
            self.plan_version.set(extra["plan_version"])

    def close(self) -> None:
        self.server.shutdown()
