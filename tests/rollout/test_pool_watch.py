"""The pool hears of a dead instance from the control plane, not only from a failed call: an
instance marked lost has its calls in flight ended at once, and a pool that watches a real
controller marks an instance lost the moment the controller reports its worker's end. The
displaced trajectory goes back to the router and finishes on another instance with the tokens it
had; nothing waits for a connection error or a call deadline (the hanging fake keeps its
connection open, and the call deadline is far beyond the test's own time limit)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from libra.control import ClusterClient, WorkerRole, WorkerSpec
from libra.rollout.agent_loop import AgentLoop
from libra.rollout.pool import InstancePool
from libra.trajectory import Outcome
from tests.rollout.conftest import TOKEN, run, start_controller_and_agent
from tests.rollout.fake_instance import HangingInstance, ScriptedInstance, serve_fake
from tests.rollout.helpers import PlannedRouter, check_continuity, make_loop, make_pool, new_trajectory
from tests.rollout.scripted_model import scripted_chat

DYING_TOKENS = [300, 301, 302]
CALL_DEADLINE_S = 600.0
"""The agent loop's rpc_timeout_s: a reroute that waited for it would fail the test's bound."""
REROUTE_BOUND_S = 20.0


@pytest.fixture
def controller_and_agent(tmp_path):
    """A controller and one node agent (heartbeats every 2 s, patient start-up: a busy machine
    neither loses the agent nor fails the test's set-up)."""
    controller, agent, agent_id = start_controller_and_agent(tmp_path)
    yield controller, agent_id
    agent.terminate()  # stops its workers
    agent.wait(timeout=30)
    controller.stop()


class LossRecordingRouter(PlannedRouter):
    def __init__(self, plan):
        super().__init__(plan)
        self.lost: list[tuple[int, list[str]]] = []

    def on_instance_lost(self, instance_id):
        displaced = super().on_instance_lost(instance_id)
        self.lost.append((instance_id, displaced))
        return displaced


async def _answering_instance(tokenizer):
    chat = scripted_chat(tokenizer)
    fake = ScriptedInstance([[303, 304, chat.eos_id]], chat.tool_call_end_id)
    return fake, *(await serve_fake(fake))


def _loop(pool: InstancePool, tokenizer, calls) -> AgentLoop:
    return make_loop(pool, tokenizer, calls, rpc_timeout_s=CALL_DEADLINE_S, stream_chunk_tokens=1)


def _check_rerouted(trajectory, calls, router: LossRecordingRouter, eos_id: int):
    """The trajectory kept the tokens the dying instance had delivered (a chunk still in transit
    when the call is cut is not delivered: the next instance re-prefills from what was kept)."""
    assert trajectory.outcome == Outcome.ANSWERED, trajectory.outcome_reason
    assert router.lost == [(0, ["t"])]  # the router heard of the loss and got the trajectory back
    assert [c.instance_id for c in calls] == [0, 1]
    kept = list(calls[0].output_ids)
    assert calls[0].finish_reason is None and kept and kept == DYING_TOKENS[: len(kept)]
    assert trajectory.response_token_ids == kept + [303, 304, eos_id]
    check_continuity(trajectory, calls)


def test_marking_an_instance_lost_ends_its_calls_in_flight(tokenizer):
    hanging = HangingInstance(DYING_TOKENS)
    calls = []
    router = LossRecordingRouter([0])

    async def scenario():
        hanging_server, hanging_address = await serve_fake(hanging)
        _, answering_server, answering_address = await _answering_instance(tokenizer)
        pool = await make_pool(router, [hanging_address, answering_address])
        try:
            task = asyncio.create_task(
                _loop(pool, tokenizer, calls).run(new_trajectory(tokenizer, "hi", "t"))
            )
            await hanging.streamed.wait()
            await asyncio.sleep(0.1)  # usually lets the last chunk arrive (either way is checked)
            pool.mark_lost(0, "reported dead by the test")
            trajectory = await asyncio.wait_for(task, REROUTE_BOUND_S)
            await asyncio.sleep(0.2)  # let the hanging server see the cancellation
            return trajectory
        finally:
            await pool.close()
            await hanging_server.stop(grace_s=0)
            await answering_server.stop(grace_s=0)

    trajectory = run(scenario())
    _check_rerouted(trajectory, calls, router, scripted_chat(tokenizer).eos_id)
    assert hanging.num_cancelled == 1  # the call was ended from our side, not by a broken socket


def test_a_worker_exit_reported_by_the_controller_reroutes_at_once(tokenizer, controller_and_agent):
    """A real controller and node agent run the instance's worker process (a stand-in that only
    sleeps; the fake instance that serves its calls hangs with its connection open). SIGKILL to
    the worker → the agent reports the exit → the controller's WorkerExited event → the pool
    marks the instance lost and its trajectory finishes on the other instance."""
    controller, agent_id = controller_and_agent
    spec = WorkerSpec(
        worker_id="rollout-0",
        role=WorkerRole.ROLLOUT,
        devices=(0,),
        argv=(sys.executable, "-c", "import time; time.sleep(600)"),
    )
    with ClusterClient(controller.address, TOKEN) as client:
        worker = client.start_worker(agent_id, spec)
    hanging = HangingInstance(DYING_TOKENS)
    calls = []
    router = LossRecordingRouter([0])

    async def scenario():
        hanging_server, hanging_address = await serve_fake(hanging)
        _, answering_server, answering_address = await _answering_instance(tokenizer)
        pool = await make_pool(router, [hanging_address, answering_address], worker_ids=["rollout-0", ""])
        pool.watch_controller(controller.address, TOKEN)
        try:
            task = asyncio.create_task(
                _loop(pool, tokenizer, calls).run(new_trajectory(tokenizer, "hi", "t"))
            )
            await hanging.streamed.wait()
            assert pool.live_ids() == [0, 1]
            os.kill(worker.pid, signal.SIGKILL)
            trajectory = await asyncio.wait_for(task, REROUTE_BOUND_S)
            return trajectory, pool.live_ids(), pool.get(0).lost_reason
        finally:
            await pool.close()
            await hanging_server.stop(grace_s=0)
            await answering_server.stop(grace_s=0)

    trajectory, live, lost_reason = run(scenario())
    _check_rerouted(trajectory, calls, router, scripted_chat(tokenizer).eos_id)
    assert live == [1]
    assert lost_reason == "controller: worker_exited"  # heard from the controller, not a failed call
