"""`PoolRolloutControl`, the plan executor's hands on the rollout pool, called from a thread as the
executor does: over the two real session instances, a cut instance's trajectories finish on the
other one from their kept tokens without a loss, a drain waits for the turns in flight and lets
no new turn land, and restore makes the instance routable again. Fake instances (no engine) cover
bucket thresholds, removal and adding through the job's coroutine.

The session instances are shared with other tests: a cut or drain here only changes this test's
pool (its client and router); the instance processes keep serving (a cut aborts their requests)
and every scenario restores what it withdrew before it closes its pool."""

from __future__ import annotations

import asyncio
import time

import pytest

from libra.planner.controls import RolloutControl
from libra.rollout.plan_control import PlanControlConfig, PoolRolloutControl
from libra.scheduler import CmlfqConfig, CmlfqRouter
from libra.trajectory import Outcome
from tests.rollout.conftest import run
from tests.rollout.fake_instance import ScriptedInstance, serve_fake
from tests.rollout.helpers import check_continuity, make_loop, make_pool, new_trajectory
from tests.rollout.scripted_model import CALCULATOR_QUESTIONS, LONG_ANSWER_QUESTION, scripted_chat

PLAN_IDS = {"rollout-tp1-d0": 0, "rollout-tp1-d1": 1}
LONG_TURN = dict(max_tokens_per_turn=300, stream_chunk_tokens=4)


class SpyRouter(CmlfqRouter):
    """The real router, recording the losses it is told of (a planned cut must be none)."""

    def __init__(self) -> None:
        super().__init__(CmlfqConfig(max_queue_length=3))
        self.losses: list[int] = []

    def on_instance_lost(self, instance_id: int) -> list[str]:
        self.losses.append(instance_id)
        return super().on_instance_lost(instance_id)

    def load_of(self, instance_id: int):
        return next(load for load in self.instance_loads() if load.instance_id == instance_id)


class StartRecorder:
    """Wraps an instance's client: records, at the moment each generation call starts, whether
    the instance was in service (not lost) and ready in the router. The agent loop decides and
    starts a call in one step of the event loop, so this is exact."""

    def __init__(self, pool, instance_id: int):
        self.pool, self.instance_id = pool, instance_id
        self.inner = pool.get(instance_id).client
        self.starts: list[tuple[str, bool, bool]] = []
        pool.get(instance_id).client = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request_id, *args, **kwargs):
        ready = self.pool.router.load_of(self.instance_id).ready
        self.starts.append((request_id, not self.pool.get(self.instance_id).lost, ready))
        return await self.inner.generate(request_id, *args, **kwargs)


class TimedCalls(list):
    """The agent loop's call records, with the time each call ended (`ended_at`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ended_at: list[float] = []

    def append(self, record) -> None:
        super().append(record)
        self.ended_at.append(time.monotonic())


async def _no_add(plan_id: str, worker_id: str, tp: int, address: str) -> int:
    raise AssertionError(f"no instance is added in this test ({plan_id})")


def _workload(tokenizer, prefix: str, num_long: int, num_calc: int):
    long = [new_trajectory(tokenizer, LONG_ANSWER_QUESTION, f"{prefix}-long{i}") for i in range(num_long)]
    calc = [
        new_trajectory(
            tokenizer,
            f"What is {CALCULATOR_QUESTIONS[i % 3]}?",
            f"{prefix}-calc{i}-{CALCULATOR_QUESTIONS[i % 3]}",
        )
        for i in range(num_calc)
    ]
    return long + calc


def _check_answers(trajectories, tokenizer, long_reference: list[int] | None) -> None:
    for trajectory in trajectories:
        assert trajectory.outcome == Outcome.ANSWERED, (trajectory.trajectory_id, trajectory.outcome_reason)
        if "-long" in trajectory.trajectory_id:
            assert trajectory.response_token_ids == long_reference
        else:
            expression = trajectory.trajectory_id.rsplit("-", 1)[1]
            text = tokenizer.decode(trajectory.response_token_ids, skip_special_tokens=False)
            assert text.endswith(f"The answer is {int(eval(expression))}.<|im_end|>")  # own reference


async def _generated_on(pool, instance_id: int) -> int:
    return (await pool.get(instance_id).client.stats()).num_generated_tokens


async def _routable_again(pool, control, tokenizer, instance_id: int, prefix: str) -> list:
    """Restores the instance from a thread, then runs a batch: returns its calls."""
    await asyncio.to_thread(control.restore, next(p for p, i in PLAN_IDS.items() if i == instance_id))
    calls = []
    trajectories = await make_loop(pool, tokenizer, calls).run_all(_workload(tokenizer, prefix, 0, 4))
    _check_answers(trajectories, tokenizer, None)
    return calls


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cut_instance_hands_its_trajectories_to_the_other_with_their_tokens(instances, tokenizer):
    calls = []

    async def scenario():
        router = SpyRouter()
        pool = await make_pool(router, [i.address for i in instances])
        try:
            recorder = StartRecorder(pool, 0)
            control = PoolRolloutControl(pool, asyncio.get_running_loop(), _no_add, PLAN_IDS)
            reference = await make_loop(pool, tokenizer, **LONG_TURN).run(
                new_trajectory(tokenizer, LONG_ANSWER_QUESTION, "reference")
            )
            loop = make_loop(pool, tokenizer, calls, **LONG_TURN)
            baseline = await _generated_on(pool, 0)
            task = asyncio.create_task(loop.run_all(_workload(tokenizer, "cut", 8, 6)))
            # Cut once instance 0 is well into its long turns (they run ~170 tokens each).
            deadline = time.monotonic() + 30
            while await _generated_on(pool, 0) - baseline < 40 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            num_cut = await asyncio.to_thread(control.cut, "rollout-tp1-d0")
            trajectories = await task
            cut_state = (pool.get(0).lost, pool.get(0).withdrawn, pool.live_ids(), list(router.losses))
            after_restore = await _routable_again(pool, control, tokenizer, 0, "again")
            return reference, num_cut, trajectories, recorder.starts, cut_state, after_restore, pool
        finally:
            await pool.close()

    reference, num_cut, trajectories, starts, cut_state, after_restore, pool = run(scenario())
    assert reference.outcome == Outcome.ANSWERED and len(reference.response_token_ids) > 100
    assert num_cut >= 1
    assert cut_state == (True, True, [1], [])  # out of service, withdrawn, and no loss reported
    _check_answers(trajectories, tokenizer, reference.response_token_ids)
    cut_calls = [c for c in calls if c.finish_reason is None]
    assert cut_calls and {c.instance_id for c in cut_calls} == {0}
    assert any(c.output_ids for c in cut_calls), "no call was cut mid-turn with tokens to keep"
    for trajectory in trajectories:
        mine = [c for c in calls if c.trajectory_id == trajectory.trajectory_id]
        cut_at = next((k for k, c in enumerate(mine) if c.finish_reason is None), None)
        if cut_at is not None:  # everything after the cut ran on the other instance
            assert [c.instance_id for c in mine[cut_at + 1 :]] and all(
                c.instance_id == 1 for c in mine[cut_at + 1 :]
            )
        check_continuity(trajectory, calls)
    assert all(in_service for _, in_service, _ in starts), "a call started on the cut instance"
    assert 0 in {c.instance_id for c in after_restore}  # routable again, through a fresh client
    assert not pool.get(0).lost and not pool.get(0).withdrawn


@pytest.mark.multiprocess
@pytest.mark.slow
def test_drain_waits_for_the_turns_in_flight_and_lets_no_new_turn_land(instances, tokenizer):
    calls = TimedCalls()

    async def scenario():
        router = SpyRouter()
        pool = await make_pool(router, [i.address for i in instances])
        try:
            recorder = StartRecorder(pool, 0)
            control = PoolRolloutControl(pool, asyncio.get_running_loop(), _no_add, PLAN_IDS)
            loop = make_loop(pool, tokenizer, calls, **LONG_TURN)
            reference = await make_loop(pool, tokenizer, **LONG_TURN).run(
                new_trajectory(tokenizer, LONG_ANSWER_QUESTION, "reference")
            )
            task = asyncio.create_task(loop.run_all(_workload(tokenizer, "drain", 4, 8)))
            while not recorder.starts:
                await asyncio.sleep(0.005)
            drain_started = time.monotonic()
            left = await asyncio.to_thread(control.drain, "rollout-tp1-d0", 60.0)
            drained_in = time.monotonic() - drain_started
            load = router.load_of(0)
            trajectories = await task
            after_restore = await _routable_again(pool, control, tokenizer, 0, "again")
            return reference, left, drained_in, drain_started, load, trajectories, recorder, after_restore
        finally:
            await pool.close()

    reference, left, drained_in, drain_started, load, trajectories, recorder, after_restore = run(scenario())
    assert left == 0 and load.active == 0 and not load.ready
    assert drained_in < 60
    _check_answers(trajectories, tokenizer, reference.response_token_ids)
    # It waited for turns in flight on instance 0: some ended only after the drain began.
    assert any(
        c.instance_id == 0 and end > drain_started for c, end in zip(calls, calls.ended_at, strict=True)
    )
    assert all(c.finish_reason is not None for c in calls), "a drain must not cut a call"
    drain_starts = [s for s in recorder.starts if s[0].startswith("drain-")]
    assert all(ready for _, _, ready in drain_starts), "a turn started on the draining instance"
    # A trajectory whose first turn was on instance 0 when the drain began took its next one on 1.
    moved = {c.trajectory_id for c in calls if c.instance_id == 0} & {
        c.trajectory_id for c in calls if c.instance_id == 1
    }
    assert moved
    for trajectory in trajectories:
        check_continuity(trajectory, calls)
    assert 0 in {c.instance_id for c in after_restore}
    assert recorder.pool.router.losses == []


# -- without an engine --------------------------------------------------------------------------


def test_thresholds_removal_and_adding_through_the_jobs_coroutine(tokenizer):
    chat = scripted_chat(tokenizer)
    fake = ScriptedInstance([[chat.eos_id]], chat.tool_call_end_id)

    async def scenario():
        server, address = await serve_fake(fake)
        router = SpyRouter()
        pool = await make_pool(router, [address, address])
        added = []

        async def add_instance(plan_id: str, worker_id: str, tp: int, address: str) -> int:
            added.append((plan_id, worker_id, tp))
            await pool.add(7, address, tp_size=tp)
            return 7

        control = PoolRolloutControl(
            pool,
            asyncio.get_running_loop(),
            add_instance,
            PLAN_IDS,
            config=PlanControlConfig(call_timeout_s=5),
        )
        assert isinstance(control, RolloutControl)  # the executor's protocol
        try:
            with pytest.raises(RuntimeError, match="another thread"):
                control.cut("rollout-tp1-d0")  # on the pool's own loop it would deadlock
            await asyncio.to_thread(control.set_bucket_thresholds, ((1, 500), (2, 9000)))
            thresholds = (router.thresholds, [b.name for b in pool.buckets])
            with pytest.raises(ValueError, match="tp_size=1"):
                await asyncio.to_thread(control.set_bucket_thresholds, ((2, 9000),))
            unchanged = router.thresholds
            await asyncio.to_thread(control.cut, "rollout-tp1-d0")
            await asyncio.to_thread(control.remove_instance, "rollout-tp1-d0")
            with pytest.raises(LookupError, match="rollout-tp1-d0"):
                control.pool_id("rollout-tp1-d0")
            await asyncio.to_thread(control.add_instance, "rollout-tp1-d2", "worker-tp1-d2", 1, address)
            answered = await make_loop(pool, tokenizer).run(new_trajectory(tokenizer, "hi", "t"))
            loads = {load.instance_id: load.ready for load in router.instance_loads()}
            return thresholds, unchanged, added, control.pool_id("rollout-tp1-d2"), answered, loads, pool
        finally:
            await pool.close()
            await server.stop(grace_s=0)

    thresholds, unchanged, added, new_id, answered, loads, pool = run(scenario())
    assert thresholds == ([500, 9000], ["short", "medium"])
    assert unchanged == [500, 9000]  # a refused plan changes nothing
    assert added == [("rollout-tp1-d2", "worker-tp1-d2", 1)] and new_id == 7
    assert loads == {1: True, 7: True}  # the removed instance is gone from the router
    assert pool.live_ids() == [1, 7] and pool.get(0).lost  # its id still answers, out of service
    assert answered.outcome == Outcome.ANSWERED
    assert pool.router.losses == []
