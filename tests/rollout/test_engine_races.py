"""`InstanceEngine` against a fake vLLM engine whose add_request can be held before it knows the
request's id (vLLM processes the input first): a Pause in ABORT mode or an Abort landing in that
window still ends the call (PREEMPTED / ABORT) instead of leaving it waiting in a paused engine.
Under load this window is real: the instance tests hung on it once in a full run."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from libra.backends import get_backend
from libra.rollout.config import InstanceConfig
from libra.rollout.engine import InstanceEngine
from libra.rollout.types import FinishReason, PauseMode, SamplingSpec
from tests.rollout.conftest import run


class _Queue:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self._items: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        self._items.put_nowait(item)

    def get_nowait(self):
        return None if self._items.empty() else self._items.get_nowait()

    async def get(self):
        return await self._items.get()


class FakeAsyncLLM:
    """Holds add_request on `taking_in` before registering the id, as vLLM's input processing
    does; abort of an id it does not hold does nothing (as vLLM's)."""

    errored = False

    def __init__(self):
        self.taking_in = asyncio.Event()
        self.held: dict[str, _Queue] = {}

    async def add_request(self, request_id, prompt, params):
        await self.taking_in.wait()
        queue = _Queue(f"{request_id}-internal")
        self.held[request_id] = self.held[queue.request_id] = queue
        return queue

    async def abort(self, request_ids, internal: bool = False):
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            queue = self.held.pop(request_id, None)
            if queue is not None:
                completion = SimpleNamespace(
                    token_ids=[], logprobs=[], weight_versions=[], finish_reason="abort", stop_reason=None
                )
                queue.put(SimpleNamespace(finished=True, outputs=[completion]))

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        pass


@pytest.mark.parametrize("interrupt", ["pause", "abort"])
def test_an_interrupt_before_vllm_knows_the_request_still_ends_it(interrupt):
    async def scenario():
        engine = InstanceEngine(InstanceConfig(model="fake").for_backend(get_backend("cpu")))
        engine._engine = fake = FakeAsyncLLM()

        async def call():
            return [c async for c in engine.generate("r", [1, 2, 3], SamplingSpec(max_tokens=4))]

        task = asyncio.create_task(call())
        while "r" not in engine._requests:
            await asyncio.sleep(0)
        if interrupt == "pause":
            assert await engine.pause(PauseMode.ABORT) == 1
        else:
            assert await engine.abort(["r"]) == 1
        fake.taking_in.set()  # vLLM now registers the request
        return await asyncio.wait_for(task, 10)

    chunks = run(scenario())
    expected = FinishReason.PREEMPTED if interrupt == "pause" else FinishReason.ABORT
    assert [c.finish_reason for c in chunks] == [expected]
