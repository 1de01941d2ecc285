"""The client's generation calls over one GenerateStream per instance (`MultiplexedGenerate` on the
server, `InstanceClient.generate` on the client), against fake instances: calls started together
share messages and each gets its own tokens; a cancelled or timed-out call is aborted on the
instance while the stream serves on; refusals and early ends map as on a unary call; a stream
that ends fails its calls with their tokens, and the next call opens a new one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from libra.control.aio_server import start_aio_server
from libra.control.config import ControlConfig
from libra.rollout import FinishReason, InstanceClient, InstanceUnavailable, SamplingSpec
from libra.rollout.instance_server import MultiplexedGenerate
from libra.v1 import rollout_pb2, rollout_pb2_grpc
from tests.rollout.conftest import TOKEN, run

HANG = 1
"""A prompt starting with this token makes the fake stream two tokens and hang."""
REFUSE = 2
"""... refuse the request (INVALID_ARGUMENT)."""
CUT = 3
"""... end its stream without a finish reason."""


class StreamFake(MultiplexedGenerate, rollout_pb2_grpc.RolloutInstanceServicer):
    """Answers a prompt p with [p[-1] + 1, p[-1] + 2] (STOP), except for the prompts above; counts
    the calls per GenerateStream message and the calls cancelled on it."""

    def __init__(self):
        self.calls_per_message: list[int] = []
        self.num_cancelled = 0
        self.hanging = asyncio.Event()

    async def GenerateStream(self, request_iterator, context):
        async def counted():
            async for message in request_iterator:
                self.calls_per_message.append(len(message.generate))
                yield message

        async for reply in super().GenerateStream(counted(), context):
            yield reply

    async def Generate(self, request, context):
        first, last = request.prompt_token_ids[0], request.prompt_token_ids[-1]
        if first == REFUSE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt refused by the fake")
        if first == HANG:
            yield rollout_pb2.GenerateChunk(token_ids=[7, 8], logprobs=[-0.5, -0.25], weight_version=2)
            self.hanging.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.num_cancelled += 1
                raise
        if first == CUT:
            yield rollout_pb2.GenerateChunk(token_ids=[9], logprobs=[-1.0], weight_version=2)
            return
        yield rollout_pb2.GenerateChunk(
            token_ids=[last + 1, last + 2],
            logprobs=[-0.1, -0.2],
            weight_version=2,
            finish_reason=rollout_pb2.FINISH_REASON_STOP,
            stop_token_id=last + 2,
        )


async def _serve(servicer, port: int = 0):
    def add(server):
        rollout_pb2_grpc.add_RolloutInstanceServicer_to_server(servicer, server)
        return [rollout_pb2.DESCRIPTOR.services_by_name["RolloutInstance"].full_name]

    server = await start_aio_server(ControlConfig(port=port), TOKEN, add)
    return server, server.port


SAMPLING = SamplingSpec(temperature=0.0, max_tokens=8)


def test_calls_started_together_share_messages_and_each_gets_its_own_tokens():
    fake = StreamFake()
    count = 200

    async def scenario():
        server, port = await _serve(fake)
        client = InstanceClient(f"127.0.0.1:{port}", TOKEN)
        try:
            return await asyncio.gather(
                *(client.generate(f"r{i}", [10, 100 + i], SAMPLING) for i in range(count))
            )
        finally:
            await client.close()
            await server.stop(grace_s=0)

    segments = run(scenario())
    for i, segment in enumerate(segments):
        assert segment.token_ids == [101 + i, 102 + i]
        assert segment.finish_reason == FinishReason.STOP and segment.stop_token_id == 102 + i
        assert [c.logprobs for c in segment.chunks] == [pytest.approx([-0.1, -0.2])]
        assert [c.weight_version for c in segment.chunks] == [2]
    assert sum(fake.calls_per_message) == count
    assert len(fake.calls_per_message) < count / 10  # one message carried many calls


def test_a_cancelled_or_timed_out_call_is_aborted_on_the_instance_and_the_stream_serves_on():
    fake = StreamFake()

    async def scenario():
        server, port = await _serve(fake)
        client = InstanceClient(f"127.0.0.1:{port}", TOKEN)
        try:
            task = asyncio.create_task(client.generate("cancelled", [HANG], SAMPLING))
            await fake.hanging.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            fake.hanging.clear()
            with pytest.raises(InstanceUnavailable, match="DEADLINE_EXCEEDED") as late:
                await client.generate("late", [HANG], SAMPLING, timeout_s=0.5)
            # Both ids are free again: the same ids start new calls on the same stream.
            after = await asyncio.gather(
                client.generate("cancelled", [5], SAMPLING), client.generate("late", [6], SAMPLING)
            )
            await asyncio.sleep(0.1)
            return late.value.partial, after
        finally:
            await client.close()
            await server.stop(grace_s=0)

    partial, after = run(scenario())
    assert partial.token_ids == [7, 8]  # a timed-out call keeps the tokens it received
    assert fake.num_cancelled == 2
    assert [s.token_ids for s in after] == [[6, 7], [7, 8]]
    assert len(fake.calls_per_message) >= 3  # one stream carried them all (it never reopened)


def test_refusals_duplicates_and_early_ends_map_as_on_a_unary_call():
    fake = StreamFake()

    async def scenario():
        server, port = await _serve(fake)
        client = InstanceClient(f"127.0.0.1:{port}", TOKEN)
        try:
            with pytest.raises(ValueError, match="refused the request: prompt refused by the fake"):
                await client.generate("refused", [REFUSE], SAMPLING)
            with pytest.raises(InstanceUnavailable, match="without a finish reason") as cut:
                await client.generate("cut", [CUT], SAMPLING)
            first = asyncio.create_task(client.generate("twice", [HANG], SAMPLING))
            await fake.hanging.wait()
            with pytest.raises(ValueError, match="already live"):
                await client.generate("twice", [5], SAMPLING)
            assert not first.done()  # the live call is untouched
            first.cancel()
            return cut.value.partial, await client.generate("ok", [5], SAMPLING)
        finally:
            await client.close()
            await server.stop(grace_s=0)

    partial, ok = run(scenario())
    assert partial.token_ids == [9]
    assert ok.token_ids == [6, 7]


def test_a_stream_that_ends_fails_its_calls_with_their_tokens_and_the_next_call_reopens():
    first, second = StreamFake(), StreamFake()

    async def scenario():
        server, port = await _serve(first)
        client = InstanceClient(f"127.0.0.1:{port}", TOKEN)
        try:
            task = asyncio.create_task(client.generate("in-flight", [HANG], SAMPLING))
            await first.hanging.wait()
            await asyncio.sleep(0.3)  # the chunk sent before the hang reaches the client
            await server.stop(grace_s=0)
            with pytest.raises(InstanceUnavailable) as lost:
                await task
            server, _ = await _serve(second, port)  # the instance is back on the same address
            return lost.value.partial, await client.generate("again", [5], SAMPLING)
        finally:
            await client.close()
            await server.stop(grace_s=0)

    partial, again = run(scenario())
    assert partial.token_ids == [7, 8]
    assert again.token_ids == [6, 7] and second.calls_per_message == [1]
