"""The simulator as the planner's rescorer, and Libra held against every homogeneous pool."""

from __future__ import annotations

import pytest

from libra.sim.config import POLICIES
from libra.sim.loop import WorkloadWindow, preflight_history, simulate
from libra.sim.metrics import SimResult, StepRecord
from libra.sim.pools import build_layout
from libra.sim.report import speedup_lines
from libra.sim.rescoring import (
    RESCORE_GROUP_OFFSET,
    STATIC_PLAN,
    rescore_warmup_steps,
    rescored_initial_plan,
    simulated_rescorer,
)
from libra.sim.runner import run_comparison
from libra.sim.workloads import WorkloadGenerator
from tests.sim.helpers import tiny_config


def test_the_initial_plan_is_the_candidate_that_simulates_fastest():
    config = tiny_config(planner_rescore_steps=3)
    history = preflight_history(config)
    plan, rescoring = rescored_initial_plan(config, history)
    scores = [score for _, score in rescoring.scored]
    assert len(scores) >= 2 and scores == sorted(scores, reverse=True)
    assert plan.layout_key == rescoring.scored[0][0].layout_key
    # Each score is the plan's own short run, repeated here independently: its trained tokens
    # over steps 1-2, from the end of step 0 (the warm-up: the launch runs 1 version ahead) to the
    # end of step 2.
    short = tiny_config(num_steps=3)
    window = WorkloadWindow(first_group=RESCORE_GROUP_OFFSET, held_progress=0.0)
    for candidate, score in rescoring.scored:
        run = simulate(
            short, STATIC_PLAN, build_layout(short, STATIC_PLAN, history, candidate), history, window
        )
        first, *steady = run.steps
        assert sum(s.tokens for s in run.steps) == run.output_tokens
        steady_rate = sum(s.tokens for s in steady) / (steady[-1].ended_at - first.ended_at)
        assert steady_rate == pytest.approx(score, rel=1e-12)


def test_the_rescorer_reads_the_runs_history_and_progress_when_called():
    config = tiny_config(planner_rescore_steps=2)
    history = preflight_history(config)
    plan, _ = rescored_initial_plan(config, history)
    now = {"progress": 0.0}
    rescore = simulated_rescorer(config, lambda: history, lambda: now["progress"])
    early = rescore([plan])
    now["progress"] = 1.0  # turns are longer at the end of the drift: fewer trajectories per second
    late = rescore([plan])
    assert early != late


def test_a_held_window_draws_fresh_groups_at_one_drift():
    window = WorkloadWindow(first_group=RESCORE_GROUP_OFFSET, held_progress=0.7)
    assert window.progress(0, 10) == window.progress(9, 10) == 0.7
    assert WorkloadWindow().progress(3, 10) == pytest.approx(0.3)
    config = tiny_config()
    generator = WorkloadGenerator(config.workload)

    # The offset is beyond any run's groups: the rescorer's first group is not a run's group 0
    # under another name.
    def shapes(group):
        return [(t.prompt_id, t.prompt_tokens, t.turns) for t in group]

    assert shapes(generator.group(RESCORE_GROUP_OFFSET, 0.7)) != shapes(generator.group(0, 0.7))


def test_libra_is_held_against_the_best_homogeneous_pool_with_hindsight():
    config = tiny_config(
        planner_rescore_steps=2,
        policies=("homogeneous_tp1", "homogeneous_tp2", "homogeneous_tp4", "homogeneous_tp8", "libra"),
    )
    comparison = run_comparison(config, log=lambda line: None)
    assert comparison.initial_rescoring is not None
    assert set(comparison.skipped) == {"homogeneous_tp8"}
    best = comparison.best_hindsight()
    rates = {
        n: comparison.results[n].trained_tokens_per_s
        for n in ("homogeneous_tp1", "homogeneous_tp2", "homogeneous_tp4")
    }
    assert best == max(rates, key=rates.get)
    for name in rates:  # every pool of one TP size, on the planned split
        layout_tps = {
            i.tp
            for i in build_layout(
                config, POLICIES[name], preflight_history(config), comparison.initial_plan
            ).instances
        }
        assert layout_tps == {int(name.removeprefix("homogeneous_tp"))}
    line = next(line for line in speedup_lines(comparison) if "with hindsight" in line)
    assert best in line and f"{comparison.speedup('libra', best):.2f}x" in line


def test_a_replanning_run_hands_its_planner_a_rescorer_reading_the_run():
    config = tiny_config(planner_rescore_steps=2, num_steps=3)
    history = preflight_history(config)
    plan, _ = rescored_initial_plan(config, history)
    built = []

    def factory(read_history, read_progress):  # spy: the real rescorer, recording what it reads
        built.append((read_history, read_progress))
        return simulated_rescorer(config, read_history, read_progress)

    policy = POLICIES["libra"]
    simulate(config, policy, build_layout(config, policy, history, plan), history, rescorer=factory)
    ((read_history, read_progress),) = built
    assert len(read_history()) == config.history_size  # the run's history, as it stands now
    assert read_progress() == pytest.approx(1.0)  # the run ended at step 3 of 3


def _step(step: int, started_at: float, ended_at: float, tokens: int) -> StepRecord:
    return StepRecord(step, started_at, ended_at, ended_at - started_at, 0.0, 0.0, 0.0, 8, tokens)


def test_the_steady_rate_leaves_the_warm_up_out():
    # A run that waited 100 s for its first batch, then trained 1,000 tokens every 10 s.
    steps = [_step(0, 100.0, 110.0, 300), _step(1, 110.0, 120.0, 1000), _step(2, 120.0, 130.0, 1000)]
    run = SimResult("p", "c", 8, 3, 130.0, 30, 2300, {}, [], steps)
    assert run.trained_tokens_per_s == pytest.approx(2300 / 130)
    assert run.steady_trained_tokens_per_s(0) == pytest.approx(2300 / 130)
    assert run.steady_trained_tokens_per_s(1) == pytest.approx(2000 / 20)
    assert run.steady_trained_tokens_per_s(2) == pytest.approx(1000 / 10)
    with pytest.raises(ValueError, match="warmup_steps"):
        run.steady_trained_tokens_per_s(-1)
    assert run.steady_trained_tokens_per_s(3) == 0.0  # stalled within its warm-up
    # One step per version the launch runs ahead, at most half; none on-policy.
    assert [rescore_warmup_steps(n, 2) for n in (1, 2, 3, 5, 8)] == [0, 1, 1, 2, 2]
    assert rescore_warmup_steps(30, 0) == 0
    with pytest.raises(ValueError, match="num_steps >= 1"):
        rescore_warmup_steps(0, 2)
