"""Helpers of the agent-loop tests: a pool over given instances, a router that follows a fixed
plan, and the token-continuity check."""

from __future__ import annotations

from collections.abc import Sequence

from libra.rollout import AgentLoop, AgentLoopConfig, CallRecord, InstancePool
from libra.rollout.tools import Calculator
from libra.scheduler import CmlfqConfig, Decision, Reason
from libra.trajectory import Trajectory
from tests.rollout.conftest import TOKEN
from tests.rollout.scripted_model import scripted_chat


class PlannedRouter:
    """A `Router` whose turn k of every trajectory runs on `plan[k]` (the last entry repeats), or
    on the lowest-numbered live instance when that one is gone."""

    def __init__(self, plan: Sequence[int]):
        self.plan = list(plan)
        self.turns: dict[str, int] = {}
        self.instances: set[int] = set()
        self.weights: dict[int, int] = {}
        self.finished: dict[str, int] = {}

    def _decide(self, trajectory_id: str, reason: Reason) -> Decision:
        turn = self.turns[trajectory_id]
        wanted = self.plan[min(turn, len(self.plan) - 1)]
        instance = wanted if wanted in self.instances else min(self.instances, default=None)
        return Decision(
            trajectory_id, 0, instance, reason if instance is not None else Reason.NO_INSTANCE, turn > 0
        )

    def admit(self, trajectory_id, prompt_id):
        self.turns[trajectory_id] = 0
        return self._decide(trajectory_id, Reason.ADMITTED)

    def on_tool_return(self, trajectory_id, state, generated_tokens, context_tokens=0):
        self.turns[trajectory_id] += 1
        return self._decide(trajectory_id, Reason.MIGRATE_UP)

    def on_finish(self, trajectory_id, total_output_tokens):
        self.finished[trajectory_id] = total_output_tokens
        del self.turns[trajectory_id]

    def on_abort(self, trajectory_id):
        del self.turns[trajectory_id]

    def reroute(self, trajectory_id):
        return self._decide(trajectory_id, Reason.REROUTED)

    def add_instance(self, instance_id, bucket, ready=True, weight=1):
        self.instances.add(instance_id)
        self.weights[instance_id] = weight

    def remove_instance(self, instance_id):
        self.instances.discard(instance_id)
        self.weights.pop(instance_id, None)
        return sorted(self.turns)

    def on_instance_lost(self, instance_id):
        return self.remove_instance(instance_id)

    def set_instance_ready(self, instance_id, ready):
        pass

    def set_instance_kv(self, instance_id, used_tokens, capacity_tokens):
        pass


async def make_pool(router, addresses: Sequence[str], worker_ids: Sequence[str] = ()) -> InstancePool:
    """Instance i at addresses[i], started as control-plane worker worker_ids[i] when given."""
    pool = InstancePool(router, TOKEN, CmlfqConfig())
    for instance_id, address in enumerate(addresses):
        await pool.add(instance_id, address, worker_id=worker_ids[instance_id] if worker_ids else "")
    return pool


def make_loop(pool: InstancePool, tokenizer, calls: list[CallRecord] | None = None, **overrides) -> AgentLoop:
    config = AgentLoopConfig(**{"temperature": 0.0, "max_turns": 4, "max_tokens_per_turn": 128, **overrides})
    return AgentLoop(
        pool,
        scripted_chat(tokenizer),
        [Calculator()],
        config,
        on_call=calls.append if calls is not None else None,
    )


def new_trajectory(tokenizer, question: str, trajectory_id: str) -> Trajectory:
    prompt = scripted_chat(tokenizer).prompt_ids([{"role": "user", "content": question}])
    return Trajectory(
        trajectory_id=trajectory_id, prompt_id=question, group_id=question, prompt_token_ids=prompt
    )


def check_continuity(trajectory: Trajectory, calls: Sequence[CallRecord]) -> None:
    """Every call's context is exactly the previous context, the tokens the model produced, and
    tokens appended with loss mask 0 (tool results); the trajectory is the last context plus the
    last output, plus tool results if it ended before another turn. Nothing was re-tokenized."""
    mine = [c for c in calls if c.trajectory_id == trajectory.trajectory_id]
    assert mine, "no calls recorded"
    assert list(mine[0].context_ids) == trajectory.prompt_token_ids
    prompt_len = len(trajectory.prompt_token_ids)
    for before, after in zip(mine, mine[1:], strict=False):
        kept = list(before.context_ids) + list(before.output_ids)
        assert list(after.context_ids[: len(kept)]) == kept
        appended = range(len(kept) - prompt_len, len(after.context_ids) - prompt_len)
        assert all(trajectory.loss_mask[i] == 0 for i in appended)
    last = mine[-1]
    final = list(last.context_ids) + list(last.output_ids)
    assert trajectory.token_ids[: len(final)] == final
    # Only tool results may follow the last call (a trajectory whose next turn found no room).
    assert all(m == 0 for m in trajectory.loss_mask[len(final) - prompt_len :])
    for call in mine:  # the model's tokens are exactly those trained on (loss mask 1)
        start = len(call.context_ids) - prompt_len
        assert all(trajectory.loss_mask[i] == 1 for i in range(start, start + len(call.output_ids)))
    assert sum(trajectory.loss_mask) == sum(len(c.output_ids) for c in mine)
