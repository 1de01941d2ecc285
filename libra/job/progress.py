"""Live progress of a run: a rich table on a terminal (steps, reward, throughput, bucket
occupancy, the plan in force), or one plain line per step otherwise (logs, CI)."""

from __future__ import annotations

from libra.job.config import JobConfig
from libra.job.recorder import StepMetrics


class Progress:
    def __init__(self, job: JobConfig, run_dir: str, live: bool):
        self.job, self.run_dir = job, run_dir
        self._last: StepMetrics | None = None
        self._occupancy: dict[str, int] = {}
        self._tokens_per_s = 0.0
        self._plan = "-"
        self._live = None
        if live:
            from rich.live import Live

            self._live = Live(self._render(), refresh_per_second=2, transient=False)
            self._live.start()

    def step(self, metrics: StepMetrics, num_steps: int, plan: str) -> None:
        """`plan`: the layout in force (`JobPlanning.layout`), or "static" without the planner."""
        self._last, self._plan = metrics, plan
        if self._live is not None:
            self._live.update(self._render())
        else:
            print(
                f"[libra] step {metrics.step}/{num_steps}  reward {metrics.mean_reward:.3f}  "
                f"tool use {metrics.tool_use_rate:.2f}  "
                f"trained {metrics.num_trajectories} (stale-dropped {metrics.num_dropped_stale})  "
                f"{metrics.trained_tokens_per_s:.0f} trained tok/s "
                f"(rollout {metrics.rollout_tokens_per_s:.0f})  "
                f"step {metrics.step_time_s:.1f} s "
                f"(train {metrics.train_time_s:.1f}, publish {metrics.publish_time_s:.2f})  "
                f"buckets {self._occupancy}  plan {plan}",
                flush=True,
            )

    def occupancy(self, per_bucket: dict[str, int], tokens_per_s: float) -> None:
        self._occupancy, self._tokens_per_s = per_bucket, tokens_per_s
        if self._live is not None:
            self._live.update(self._render())

    def _render(self):
        from rich.table import Table

        table = Table(title=f"libra run — {self.run_dir}", show_header=False)
        m = self._last
        rows = [
            ("step", f"{m.step if m else 0} / {self.job.num_steps}"),
            ("mean reward (last step)", f"{m.mean_reward:.3f}" if m else "-"),
            ("share calling a tool", f"{m.tool_use_rate:.2f}" if m else "-"),
            ("trained throughput (last step)", f"{m.trained_tokens_per_s:.0f} tok/s" if m else "-"),
            ("rollout throughput", f"{self._tokens_per_s:.0f} tok/s now"),
            ("buckets (requests in flight)", "  ".join(f"{k}: {v}" for k, v in self._occupancy.items())),
            (
                "last step",
                f"{m.step_time_s:.1f} s (train {m.train_time_s:.1f} s, publish {m.publish_time_s:.2f} s)"
                if m
                else "-",
            ),
            ("router", self.job.router),
            ("plan", self._plan),
        ]
        for k, v in rows:
            table.add_row(k, v)
        return table

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
