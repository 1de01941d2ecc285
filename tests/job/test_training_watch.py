"""The loop's side of losing the train ranks (issue #22), with fakes standing in for the workers:
whether the loop waits for rollouts when the watchdog reports the ranks gone or a call to them
fails first, the job ends at once with one `TrainingLost` naming the ranks and the checkpoint, and
one `training_lost` event. The real processes are `test_training_lost.py`'s."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import pytest

from libra.config import load_config
from libra.job.loop import GrpoJob, TrainingLost
from libra.job.recorder import RunRecorder, read_jsonl


class _FakeTrainRanks:
    """Stands in for `TrainRankGroup`: the watchdog's event and the lost ranks' description."""

    def __init__(self):
        self.gone = asyncio.Event()

    def lost(self) -> list[str]:
        return ["train rank train-0 on agent agent-1 (10.0.0.1): the agent is lost"]


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


def _job(tmp_path) -> GrpoJob:
    config = load_config("configs/tiny_cpu.py", [f"run_dir={tmp_path}"])
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "job_state.json").write_text(json.dumps({"version": 2}))
    job = GrpoJob(config)
    job.workers = SimpleNamespace(train_ranks=_FakeTrainRanks())
    job.recorder = RunRecorder(tmp_path)
    return job


def test_a_loss_while_the_loop_waits_for_rollouts_ends_the_job_at_once(tmp_path):
    job = _job(tmp_path)
    waiting = asyncio.Event()

    async def train_loop():
        job._doing = "the rollout of step 3"
        waiting.set()
        await asyncio.Event().wait()  # every instance is gone: the batch never fills

    job._train_loop = train_loop

    async def run():
        main = asyncio.create_task(job._train_until_done_or_lost())
        await waiting.wait()
        job.workers.train_ranks.gone.set()
        return await asyncio.wait_for(main, timeout=5)

    with pytest.raises(TrainingLost) as lost:
        asyncio.run(run())
    message = str(lost.value)
    assert message.startswith("training lost during the rollout of step 3 at version 0: train rank train-0")
    assert "step_000002, version 2" in message and "(the call failed" not in message
    job.recorder.close()
    (event,) = read_jsonl(tmp_path / "events.jsonl")
    assert event["kind"] == "training_lost" and event["checkpoint"].endswith("step_000002")


def test_a_failed_call_before_the_watchdog_is_recorded_once(tmp_path):
    job = _job(tmp_path)

    async def train_loop():
        with job._train_ranks_call("the train step"):
            raise _Unavailable()

    job._train_loop = train_loop

    async def run():
        main = asyncio.create_task(job._train_until_done_or_lost())
        await asyncio.sleep(0)
        job.workers.train_ranks.gone.set()  # the watchdog notices too, a moment later
        return await main

    with pytest.raises(TrainingLost, match=r"during the train step .* UNAVAILABLE: connection refused"):
        asyncio.run(run())
    job.recorder.close()
    assert [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")] == ["training_lost"]


def test_a_loop_that_finishes_is_not_a_loss(tmp_path):
    job = _job(tmp_path)

    async def train_loop():
        job.workers.train_ranks.gone.set()  # e.g. the ranks stopped as the job ends

    job._train_loop = train_loop
    asyncio.run(job._train_until_done_or_lost())
    job.recorder.close()
    assert read_jsonl(tmp_path / "events.jsonl") == []
