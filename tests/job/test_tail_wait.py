"""How the job's loop waits for the groups a step must train on, per staleness mode, on a
stand-in for the loop (a namespace with the attributes `GrpoJob._collect_finished` reads: a fake
for this unit test; the real loop runs it in the job tests)."""

from __future__ import annotations

import asyncio
import types

import pytest

from libra.job.loop import GrpoJob
from libra.training.config import TrainingConfig
from libra.training.staleness import StalenessGate


async def _collect(mode: str) -> set[int]:
    gate = StalenessGate(max_staleness=0, batch_size=4)
    gate.state.num_consumed = 3  # 3 slots trained so far; none dropped as too stale

    async def group(index: int, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return index

    loop = types.SimpleNamespace(
        config=types.SimpleNamespace(training=TrainingConfig(staleness_mode=mode, drop_budget=0.5)),
        job=types.SimpleNamespace(group_size=2),
        gate=gate,
        # Both launched at version 0, the trainer's: the next step must train on them.
        launched={0: types.SimpleNamespace(started_version=0), 1: types.SimpleNamespace(started_version=0)},
        in_flight={0: asyncio.create_task(group(0, 0.01)), 1: asyncio.create_task(group(1, 0.5))},
        finished={},
    )
    await GrpoJob._collect_finished(loop)
    for task in loop.in_flight.values():
        task.cancel()
    return set(loop.finished)


@pytest.mark.parametrize(
    ("mode", "finished"),
    [
        ("wait", {0, 1}),  # every due group
        # Dropping both (4 slots) would make 4 of 7 > 50 %; once the first is in, dropping the
        # other (2 of 5) fits, so the step need not wait for it.
        ("budget", {0}),
        ("drop", {0}),  # the first to finish, nothing more (the other takes 0.5 s)
    ],
)
def test_the_loop_waits_for_due_groups_by_mode(mode, finished):
    assert asyncio.run(_collect(mode)) == finished
