"""The job's Prometheus endpoint (served by the controller process, `job.metrics_port`): per-step
gauges (reward, step/train/publish times, staleness, stale drops, the train/inference logprob
gap), rollout throughput and
requests in flight per bucket (sampled every second), and counters of trajectories, instance
losses and restarts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from libra.job.recorder import StepMetrics


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
        self.in_flight = Gauge("libra_bucket_requests_in_flight", "Requests in flight per bucket", ["bucket"],
                               registry=r)  # fmt: skip
        self.logprob_gap = Gauge("libra_logprob_gap", "Train/inference |logprob diff| of the last step",
                                 ["stat"], registry=r)  # fmt: skip
        self.faults = Counter("libra_instance_events_total", "Rollout instance losses and restarts", ["kind"],
                              registry=r)  # fmt: skip
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
        if m.num_current_tokens:  # the gap is NaN for steps without a comparable trajectory
            self.logprob_gap.labels("mean").set(m.logprob_abs_diff)
            self.logprob_gap.labels("max").set(m.logprob_max_abs_diff)
        self.dropped.inc(m.num_dropped_stale)
        self.trajectories.inc(m.num_trajectories)

    def on_occupancy(self, per_bucket: dict[str, int], tokens_per_s: float) -> None:
        self.tokens_per_s.set(tokens_per_s)
        for bucket, count in per_bucket.items():
            self.in_flight.labels(bucket).set(count)

    def on_event(self, kind: str) -> None:
        if kind in ("instance_lost", "instance_restarted"):
            self.faults.labels(kind).inc()

    def close(self) -> None:
        self.server.shutdown()
