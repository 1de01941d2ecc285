"""Fake rollout instances for agent-loop tests that need no engine: gRPC servers (in the test's
event loop) that answer `Generate` from a script, so that every path is deterministic. They serve
`GenerateStream` (the client's `generate`) through the server's `MultiplexedGenerate`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from libra.control.aio_server import start_aio_server
from libra.control.config import ControlConfig
from libra.rollout.instance_server import MultiplexedGenerate
from libra.v1 import rollout_pb2, rollout_pb2_grpc
from tests.rollout.conftest import TOKEN


class ScriptedInstance(MultiplexedGenerate, rollout_pb2_grpc.RolloutInstanceServicer):
    """Plays model turn k (k = the number of `</tool_call>` tokens already in the context, so
    turn k follows the k-th tool result) like an engine with a context window of
    `engine_max_model_len` tokens: it emits the turn's tokens until the turn ends (STOP on its
    last token), `max_tokens` is reached, or the context fills the window (both LENGTH, the
    way vLLM reports either). `Stats` reports `reported_max_model_len` (default: the engine's),
    which the pool trusts."""

    def __init__(
        self,
        turns: Sequence[Sequence[int]],
        tool_call_end_id: int,
        engine_max_model_len: int = 512,
        reported_max_model_len: int | None = None,
    ):
        self.turns = [list(t) for t in turns]
        self.tool_call_end_id = tool_call_end_id
        self.engine_max_model_len = engine_max_model_len
        self.reported_max_model_len = reported_max_model_len or engine_max_model_len
        self.requests: list[rollout_pb2.GenerateRequest] = []

    def turn_for(self, request) -> list[int]:
        """The scripted turn answering `request`: turn k after k tool calls in its context."""
        calls = list(request.prompt_token_ids).count(self.tool_call_end_id)
        return self.turns[min(calls, len(self.turns) - 1)]

    async def Generate(self, request, context):
        self.requests.append(request)
        turn = self.turn_for(request)
        room = self.engine_max_model_len - len(request.prompt_token_ids)
        limit = min(request.sampling.max_tokens, room)
        tokens = turn[:limit]
        finished = len(tokens) == len(turn)
        yield rollout_pb2.GenerateChunk(
            token_ids=tokens,
            logprobs=[-0.25] * len(tokens),
            weight_version=1,
            finish_reason=rollout_pb2.FINISH_REASON_STOP if finished else rollout_pb2.FINISH_REASON_LENGTH,
            stop_token_id=tokens[-1] if finished else -1,
        )

    async def Stats(self, request, context):
        return rollout_pb2.InstanceStats(
            max_model_len=self.reported_max_model_len, tensor_parallel_size=1, model="scripted-fake"
        )


class HangingInstance(MultiplexedGenerate, rollout_pb2_grpc.RolloutInstanceServicer):
    """Streams `tokens` one per chunk, then hangs with the connection open (an instance whose
    process is gone from the control plane's view, but whose socket does not fail). Counts the
    calls the client cancelled."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self.streamed = asyncio.Event()
        self.num_cancelled = 0

    async def Generate(self, request, context):
        for token in self.tokens:
            yield rollout_pb2.GenerateChunk(token_ids=[token], logprobs=[-0.5], weight_version=1)
        self.streamed.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise

    async def Stats(self, request, context):
        return rollout_pb2.InstanceStats(max_model_len=512, tensor_parallel_size=1, model="hanging-fake")


async def serve_fake(servicer: rollout_pb2_grpc.RolloutInstanceServicer):
    """Starts `servicer` on a free loopback port; returns (server, address)."""

    def add(server):
        rollout_pb2_grpc.add_RolloutInstanceServicer_to_server(servicer, server)
        return [rollout_pb2.DESCRIPTOR.services_by_name["RolloutInstance"].full_name]

    server = await start_aio_server(ControlConfig(port=0), TOKEN, add)
    return server, f"127.0.0.1:{server.port}"
