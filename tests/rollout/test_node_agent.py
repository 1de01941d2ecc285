"""A rollout instance started like any worker (the controller's StartWorker through a node agent),
killed mid-generation: the controller notices, and every trajectory it held finishes elsewhere
with the tokens it would have had anyway (greedy), none lost."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from libra.control import WorkerState
from libra.rollout import InstanceClient
from libra.scheduler import LeastLoadRouter
from libra.trajectory import Outcome
from tests.control.helpers import wait_for
from tests.rollout.conftest import TOKEN, run
from tests.rollout.helpers import check_continuity, make_loop, make_pool, new_trajectory
from tests.rollout.scripted_model import LONG_ANSWER_QUESTION

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

QUESTIONS = (LONG_ANSWER_QUESTION,) * 4 + ("What is 12+7?", "What is 3*45?")
"""Long single turns (certain to be in flight when the instance dies) and two-turn tool calls."""
LOOP_OVERRIDES = dict(max_turns=4, max_tokens_per_turn=300, stream_chunk_tokens=8)


def test_killed_instance_hands_back_its_trajectories(instances, rollout_cluster, tokenizer):
    started = rollout_cluster.agent_instance
    controller, status = started.controller, started.status
    address = started.address()
    calls = []

    async def scenario():
        # Reference: the same trajectories on the session instances alone.
        pool = await make_pool(LeastLoadRouter(), [i.address for i in instances])
        reference = await make_loop(pool, tokenizer, **LOOP_OVERRIDES).run_all(
            [new_trajectory(tokenizer, q, f"ref-{i}") for i, q in enumerate(QUESTIONS)]
        )
        await pool.close()

        pool = await make_pool(LeastLoadRouter(), [i.address for i in instances] + [address])
        victim = InstanceClient(address, TOKEN)
        task = asyncio.ensure_future(
            make_loop(pool, tokenizer, calls, **LOOP_OVERRIDES).run_all(
                [new_trajectory(tokenizer, q, f"t-{i}") for i, q in enumerate(QUESTIONS)]
            )
        )
        while (await victim.stats()).num_generated_tokens < 8:
            await asyncio.sleep(0.002)
        os.killpg(status.pid, signal.SIGKILL)  # the instance (frontend and engine) dies at once
        trajectories = await task
        await victim.close()
        await pool.close()
        return reference, trajectories, pool

    reference, trajectories, pool = run(scenario())
    assert [t.outcome for t in trajectories] == [r.outcome for r in reference]
    assert all(t.outcome == Outcome.ANSWERED for t in trajectories), [t.outcome_reason for t in trajectories]
    for got, expected in zip(trajectories, reference, strict=True):
        assert got.response_token_ids == expected.response_token_ids
        check_continuity(got, calls)
    cut = [c for c in calls if c.instance_id == 2 and c.finish_reason is None]
    assert cut, "no trajectory was in flight on the killed instance"
    assert pool.live_ids() == [0, 1]
    worker = wait_for(
        lambda: next(
            (
                w
                for w in controller.cluster.snapshot().workers
                if w.spec.worker_id == "rollout-2" and w.state.ended
            ),
            None,
        ),
        what="the controller to record the worker's end",
    )
    assert worker.state == WorkerState.EXITED and worker.exit_code == -signal.SIGKILL
