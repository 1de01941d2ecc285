"""The job's rescorer: candidate plans simulated on the job's own finished groups, on its cluster,
with the factors the planner reads when it re-scores."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from libra.config import load_config
from libra.job.problem import planning_problem
from libra.job.rescoring import JobRescorer
from libra.planner import Planner, RequestRecord
from libra.planner.plan import BucketPlan, Plan, RolloutInstance, TrainingPlacement
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS, DEFAULT_TRAIN_FACTORS
from libra.planner.training_cost import TrainingConfig
from libra.scheduler.factory import RouterKind
from libra.sim.pools import Layout
from libra.trace import TrajectoryTrace, TurnTrace
from tests.job.test_planning_parts import TINY_LLAMA

GROUP_SIZE = 4


@pytest.fixture
def problem(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = load_config("configs/tiny_cpu.py", ["job.prompts_per_step=2", f"job.group_size={GROUP_SIZE}"])
    return config, planning_problem(config, tmp_path)


def _group(index: int, turns: int, turn_tokens: int) -> list[TrajectoryTrace]:
    """One group whose trajectories call a tool `turns` times, `turn_tokens` tokens a turn."""
    body = tuple(TurnTrace(turn_tokens, "python", 40, tool_latency_s=0.2) for _ in range(turns))
    return [
        TrajectoryTrace(f"g{index}-{j}", f"p{index}", f"g{index}", 200, (*body, TurnTrace(turn_tokens)))
        for j in range(GROUP_SIZE)
    ]


def _plan(num_instances: int, train_dp: int = 1) -> Plan:
    """Training DP `train_dp` on the first devices, `num_instances` TP-1 rollout instances after."""
    devices = range(train_dp, train_dp + num_instances)
    instances = tuple(RolloutInstance(f"rollout-tp1-d{d}", 1, (d,), 0) for d in devices)
    return Plan(
        4,
        TrainingPlacement(TrainingConfig(1, 1, train_dp, 1), first_device=0),
        instances,
        (BucketPlan(1, num_instances, 4096, 0, 0.0),),
        0.0,
        0.0,
    )


PRIORS = (DEFAULT_TRAIN_FACTORS, DEFAULT_ROLLOUT_FACTORS)
SLOW_ROLLOUT = (DEFAULT_TRAIN_FACTORS, dataclasses.replace(DEFAULT_ROLLOUT_FACTORS, memory=0.0085))
"""A calibration that found decoding reads memory at 1 % of the prior's rate."""


def _rescorer(config, problem, factors=PRIORS) -> JobRescorer:
    return JobRescorer(config, problem, lambda: factors)


def test_plans_are_scored_on_the_recorded_groups(problem):
    config, problem = problem
    groups = [_group(index, turns=4, turn_tokens=400) for index in range(6)]
    # At the priors the tiny model decodes fast and training binds: a second train rank pays.
    rescorer = _rescorer(config, problem)
    for group in groups:
        rescorer.record(group)
    one_rank, two_ranks = rescorer([_plan(2), _plan(2, train_dp=2)])
    assert all(math.isfinite(s) and s > 0 for s in (one_rank, two_ranks))
    assert two_ranks > 1.5 * one_rank
    # Deterministic: the same groups and plans score the same.
    assert rescorer([_plan(2), _plan(2, train_dp=2)]) == [one_rank, two_ranks]
    # Where decoding is slow, rollout binds: three instances train more tokens a second than one.
    rescorer = _rescorer(config, problem, SLOW_ROLLOUT)
    for group in groups:
        rescorer.record(group)
    one, three = rescorer([_plan(1), _plan(3)])
    assert three > 1.5 * one


def test_the_groups_and_the_factors_are_read_when_it_scores(problem):
    config, problem = problem
    factors = {"now": PRIORS}
    rescorer = JobRescorer(config, problem, lambda: factors["now"])
    rescorer.record(_group(0, turns=4, turn_tokens=400))
    before = rescorer([_plan(1)])[0]
    # The planner's calibration now says decoding is slow: the same plan scores lower.
    factors["now"] = SLOW_ROLLOUT
    assert rescorer([_plan(1)])[0] < 0.5 * before
    # Newer groups replace the oldest beyond the planner's history.
    for index in range(1, 1 + rescorer.groups.maxlen):
        rescorer.record(_group(index, turns=1, turn_tokens=50))
    assert [group[0].group_id for group in rescorer.groups][0] == "g1"


def test_no_finished_group_is_a_clear_error(problem):
    config, problem = problem
    with pytest.raises(ValueError, match="no finished group"):
        _rescorer(config, problem)([_plan(1)])


def test_rescoring_needs_steps(problem):
    config, problem = problem
    off = dataclasses.replace(config, job=dataclasses.replace(config.job, planner_rescore_steps=0))
    with pytest.raises(ValueError, match="planner_rescore_steps"):
        _rescorer(off, problem)
    with pytest.raises(ValueError, match="planner_rescore_steps must be >= 0"):
        load_config("configs/tiny_cpu.py", ["job.planner_rescore_steps=-1"])


def test_the_planner_chooses_its_plan_by_the_jobs_rescorer(problem):
    config, problem = problem
    rescorer = _rescorer(config, problem)
    groups = [_group(index, turns=3, turn_tokens=300) for index in range(6)]
    for group in groups:
        rescorer.record(group)
    history = tuple(RequestRecord.from_trace(t) for group in groups for t in group)
    events = []
    planner = Planner(
        dataclasses.replace(problem, history=history), on_event=events.append, rescorer=rescorer
    )
    adoption = planner.initial_plan()
    (rescoring,) = planner.rescorings
    plans = [plan for plan, _ in rescoring.scored]
    assert len(plans) >= 2 and adoption.plan in plans
    # The scores the planner chose by are the simulation's of those plans on the job's groups.
    assert [score for _, score in rescoring.scored] == rescorer(plans)
    assert "re-scored" in events[-1].message


def test_a_job_on_a_baseline_router_is_simulated_on_that_router(problem):
    config, problem = problem
    least_load = dataclasses.replace(config, job=dataclasses.replace(config.job, router="least_load"))
    rescorer = _rescorer(least_load, problem)
    assert rescorer.policy.router is RouterKind.LEAST_LOAD
    assert not rescorer.config.cmlfq_price_moves
    rescorer.record(_group(0, turns=2, turn_tokens=200))
    assert rescorer([_plan(2)])[0] > 0


def test_the_simulated_cluster_is_the_jobs(problem):
    config, problem = problem
    sim = _rescorer(config, problem).config
    assert sim.cluster == problem.cluster and sim.model == problem.model and sim.batch == problem.batch
    # The planner and the simulation size the engines as they are: max_num_seqs, KV GiB on the CPU.
    assert sim.planner == problem.config
    assert sim.planner.max_decode_batch == config.rollout.instance.max_num_seqs == 64
    assert sim.planner.rollout_kv_bytes_per_device == 2**30  # the CPU backend's 1 GiB per engine
    # The cap as the config states it: left 0, each candidate's simulation derives it for its pool.
    assert sim.cmlfq == config.scheduler and sim.cmlfq.max_queue_length == 0
    assert (sim.staleness_mode, sim.drop_budget, sim.tail_staleness) == (
        config.training.staleness_mode,
        config.training.drop_budget,
        config.training.tail_staleness,
    )


def test_the_simulated_router_has_the_jobs_settings(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    overrides = ["scheduler.draining_fraction=0.5", "scheduler.p90_window=50", "scheduler.demote=true"]
    config = load_config("configs/tiny_cpu.py", [f"job.group_size={GROUP_SIZE}", *overrides])
    sim = _rescorer(config, planning_problem(config, tmp_path)).config
    layout = Layout(TrainingConfig(1, 1, 1, 1), (0,), (), (1, 2), (4096, 8192))
    router = layout.cmlfq_config(sim.cmlfq, max_queue_length=7)
    assert (router.draining_fraction, router.p90_window, router.demote) == (0.5, 50, True)
    assert [(b.tp_size, b.max_remaining_tokens) for b in router.buckets] == [(1, 4096), (2, 8192)]
    assert router.max_queue_length == 7
