"""An asyncio client of one rollout instance (the controller side of RolloutInstance).

A failed or cut stream raises `InstanceUnavailable` carrying the tokens received before the
failure, so the agent loop keeps them and resumes elsewhere; a refused request raises ValueError.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libra.config import ControlConfig
from libra.rollout import convert
from libra.rollout.types import Chunk, FinishReason, InstanceStats, PauseMode, SamplingSpec, Segment
from libra.sync.instance_update import LoadResult
from libra.sync.load_request import LoadRequest
from libra.v1 import rollout_pb2, rollout_pb2_grpc

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    # A dead instance's connection must fail fast, not wait for reconnection back-off.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class InstanceUnavailable(Exception):
    """The instance could not finish the call (died, unreachable, engine dead)."""

    def __init__(self, message: str, partial: Segment | None = None):
        super().__init__(message)
        self.partial = partial or Segment()


def open_aio_channel(address: str, config: ControlConfig | None = None) -> grpc.aio.Channel:
    if config is not None and config.tls_cert_file:
        root = Path(config.tls_ca_file or config.tls_cert_file).read_bytes()
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root), options=_CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)


MAX_CONCURRENT_CALLS = 512
"""Generation calls in flight per instance. Beyond ~1,000 concurrent streams on one channel,
grpc.aio cancels some of them (measured: ~11 % of 2,000); the engine batches at most
`max_num_seqs` (256 by default) anyway, so calls past the cap wait here at no cost."""


class InstanceClient:
    """Create inside the event loop that uses it."""

    def __init__(
        self,
        address: str,
        token: str,
        config: ControlConfig | None = None,
        max_concurrent_calls: int = MAX_CONCURRENT_CALLS,
    ):
        self.address = address
        self._slots = asyncio.Semaphore(max_concurrent_calls)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._channel = open_aio_channel(address, config)
        self._stub = rollout_pb2_grpc.RolloutInstanceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._calls: set[grpc.aio.UnaryStreamCall] = set()
        self._failed: str | None = None
        """Why `fail_calls` ended this client's calls; set once, never cleared."""

    def fail_calls(self, reason: str) -> int:
        """Ends every generation call in flight, and refuses new ones, with InstanceUnavailable
        (carrying the tokens each had received). For an instance known dead from elsewhere (the
        control plane): its callers resume elsewhere at once instead of waiting for the
        connection to fail or the deadline. Returns the number of calls ended."""
        self._failed = reason
        calls = list(self._calls)
        for call in calls:
            call.cancel()
        return len(calls)

    def _open_generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        chunk_tokens: int,
        timeout_s: float | None,
    ) -> grpc.aio.UnaryStreamCall:
        if self._failed is not None:
            raise InstanceUnavailable(f"{self.address}: {self._failed}")
        request = rollout_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=convert.sampling_to_proto(sampling),
            stream_chunk_tokens=chunk_tokens,
        )
        call = self._stub.Generate(request, metadata=self._metadata, timeout=timeout_s)
        self._calls.add(call)
        return call

    def _failed_by_us(self) -> bool:
        """Whether a CancelledError came from `fail_calls` (the call was cancelled under a task
        nobody is cancelling), not from the caller's task being cancelled."""
        task = asyncio.current_task()
        return self._failed is not None and (task is None or task.cancelling() == 0)

    async def stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        chunk_tokens: int = 0,
        timeout_s: float | None = None,
    ) -> AsyncIterator[Chunk]:
        """The call's chunks as they arrive. gRPC errors pass through (`generate` maps them)."""
        async with self._slots:
            call = self._open_generate(request_id, prompt_token_ids, sampling, chunk_tokens, timeout_s)
            finished = False
            try:
                async for msg in call:
                    yield convert.chunk_from_proto(msg)
                finished = True
            except asyncio.CancelledError:
                if self._failed_by_us():
                    raise InstanceUnavailable(f"{self.address}: {self._failed}") from None
                raise
            finally:
                self._calls.discard(call)
                if not finished:
                    call.cancel()  # the consumer stopped early: abort the request on the instance

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        chunk_tokens: int = 0,
        timeout_s: float | None = None,
    ) -> Segment:
        """One generation call, collected. Raises InstanceUnavailable (with the tokens received so
        far) when the instance fails or `fail_calls` ends it, ValueError when it refuses the
        request. Reads the call directly rather than through `stream`: one async generator less
        per call on the hot path."""
        segment = Segment()
        async with self._slots:
            call = self._open_generate(request_id, prompt_token_ids, sampling, chunk_tokens, timeout_s)
            try:
                async for msg in call:
                    _collect(segment, convert.chunk_from_proto(msg))
            except grpc.aio.AioRpcError as e:
                raise self._call_error(e, segment) from None
            except asyncio.CancelledError:
                if self._failed_by_us():
                    raise InstanceUnavailable(f"{self.address}: {self._failed}", segment) from None
                raise
            finally:
                self._calls.discard(call)
                if not call.done():
                    call.cancel()  # the caller was cancelled or failed: abort the request on the instance
        if segment.finish_reason == FinishReason.NONE:
            raise InstanceUnavailable(f"{self.address}: stream ended without a finish reason", segment)
        return segment

    def _call_error(self, error: grpc.aio.AioRpcError, segment: Segment) -> Exception:
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return ValueError(f"instance {self.address} refused the request: {error.details()}")
        return InstanceUnavailable(f"{self.address}: {error.code().name}: {error.details()}", segment)

    async def abort(self, request_ids: list[str]) -> int:
        reply = await self._stub.Abort(
            rollout_pb2.AbortRequest(request_ids=request_ids), metadata=self._metadata
        )
        return reply.num_aborted

    async def pause(self, mode: PauseMode = PauseMode.KEEP) -> int:
        reply = await self._stub.Pause(rollout_pb2.PauseRequest(mode=int(mode)), metadata=self._metadata)
        return reply.num_in_flight

    async def resume(self, weight_version: int | None = None) -> int:
        request = rollout_pb2.ResumeRequest()
        if weight_version is not None:
            request.weight_version = weight_version
        return (await self._stub.Resume(request, metadata=self._metadata)).weight_version

    async def load_weights(self, request: LoadRequest, timeout_s: float | None = 300.0) -> LoadResult:
        """Switches the instance to a published version. A failed transfer is a result with
        ok=False (the instance runs its old version); a malformed request raises ValueError."""
        try:
            reply = await self._stub.LoadWeights(
                convert.load_request_to_proto(request), metadata=self._metadata, timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"instance {self.address} refused the load: {e.details()}") from None
            raise InstanceUnavailable(f"{self.address}: {e.code().name}: {e.details()}") from None
        return convert.load_result_from_proto(reply)

    async def read_weights(
        self, names: list[str] | None = None, timeout_s: float | None = 120.0
    ) -> list[dict]:
        """Per TP rank, the instance's params as its engine computes with them (name -> CPU
        tensor; verification and tests)."""
        from safetensors.torch import load

        reply = await self._stub.ReadWeights(
            rollout_pb2.ReadWeightsRequest(names=names or []), metadata=self._metadata, timeout=timeout_s
        )
        return [load(blob) for blob in reply.ranks]

    async def stats(self, timeout_s: float | None = 10.0) -> InstanceStats:
        reply = await self._stub.Stats(rollout_pb2.StatsRequest(), metadata=self._metadata, timeout=timeout_s)
        return convert.stats_from_proto(reply)

    async def is_serving(self, timeout_s: float = 2.0) -> bool:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()


def _collect(segment: Segment, chunk: Chunk) -> None:
    if chunk.token_ids:
        segment.chunks.append(chunk)
    if chunk.finish_reason != FinishReason.NONE:
        segment.finish_reason, segment.stop_token_id = chunk.finish_reason, chunk.stop_token_id
