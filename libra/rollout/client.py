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

from libra.control.config import ControlConfig
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


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _PendingCall:
    __slots__ = ("segment", "done")

    def __init__(self, done: asyncio.Future):
        self.segment = Segment()
        self.done = done
        """Resolved when the call finishes; an exception when it fails."""


class _GenerateStream:
    """This client's generation calls multiplexed over one GenerateStream call (see
    `MultiplexedGenerate` on the server): a writer task sends the calls started (and cancelled)
    since its last write in one message, a reader task collects each call's chunks into its
    segment and wakes its caller once, at the end. When the stream ends, for any reason, every
    call on it fails with InstanceUnavailable carrying its tokens; the client then opens a new
    stream for later calls."""

    def __init__(self, stub: rollout_pb2_grpc.RolloutInstanceStub, metadata, address: str):
        self.address = address
        self._call = stub.GenerateStream(metadata=metadata)
        self._pending: dict[str, _PendingCall] = {}
        self._to_start: list[rollout_pb2.GenerateRequest] = []
        self._to_cancel: list[str] = []
        self._wake = asyncio.Event()
        self.ended: str | None = None
        """Why the stream ended (None while it serves)."""
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    def start(self, request: rollout_pb2.GenerateRequest) -> _PendingCall:
        if request.request_id in self._pending:
            raise ValueError(
                f"instance {self.address} refused the request: request_id "
                f"{request.request_id!r} is already live"
            )
        pending = self._pending[request.request_id] = _PendingCall(asyncio.get_running_loop().create_future())
        self._to_start.append(request)
        self._wake.set()
        return pending

    def cancel(self, request_id: str) -> None:
        """The caller gave up the call: forget it and abort it on the instance."""
        if self._pending.pop(request_id, None) is not None and self.ended is None:
            self._to_cancel.append(request_id)
            self._wake.set()

    def end(self, reason: str) -> int:
        """Ends the stream and fails every call on it; returns how many there were."""
        if self.ended is None:
            self.ended = reason
            self._call.cancel()
            self._writer.cancel()
        calls = list(self._pending.values())
        self._pending.clear()
        for pending in calls:
            if not pending.done.done():
                pending.done.set_exception(InstanceUnavailable(f"{self.address}: {reason}", pending.segment))
        return len(calls)

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._to_start or self._to_cancel:
                    start, cancel = self._to_start, self._to_cancel
                    self._to_start, self._to_cancel = [], []
                    await self._call.write(rollout_pb2.GenerateStreamRequest(generate=start, cancel=cancel))
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - a broken stream: its calls fail, later ones reopen
            self.end(f"stream write failed: {type(e).__name__}: {e}")

    async def _read(self) -> None:
        reason = "stream ended"
        try:
            async for reply in self._call:
                for event in reply.events:
                    self._on_event(event)
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            reason = "stream closed"
        except Exception as e:  # noqa: BLE001 - whatever ended the stream ends its calls
            reason = f"stream failed: {type(e).__name__}: {e}"
        self.end(reason)

    def _on_event(self, event: rollout_pb2.GenerateStreamEvent) -> None:
        pending = self._pending.get(event.request_id)
        if pending is None:
            return  # cancelled by its caller: what the instance still sent is nobody's
        if event.error_code:
            del self._pending[event.request_id]
            code = _STATUS_CODES.get(event.error_code, grpc.StatusCode.UNKNOWN)
            pending.done.set_exception(_status_error(self.address, code, event.error, pending.segment))
            return
        chunk = convert.chunk_from_proto(event.chunk)
        _collect(pending.segment, chunk)
        if chunk.finish_reason != FinishReason.NONE:
            del self._pending[event.request_id]
            pending.done.set_result(None)


class InstanceClient:
    """Create inside the event loop that uses it. `generate` calls travel on one long-lived
    GenerateStream per client; `stream` (chunks as they arrive) uses a Generate call each."""

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
        self._generate_stream: _GenerateStream | None = None
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
        ended = self._generate_stream.end(reason) if self._generate_stream is not None else 0
        return len(calls) + ended

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
        """The call's chunks as they arrive, on a Generate call of its own (grpc.aio.AioRpcError
        passes through unmapped)."""
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
        far) when the instance fails, the call times out or `fail_calls` ends it, ValueError when
        the instance refuses the request. Cancelling the caller aborts the call on the instance."""
        async with self._slots:
            stream = self._open_stream()
            request = rollout_pb2.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=convert.sampling_to_proto(sampling),
                stream_chunk_tokens=chunk_tokens,
            )
            pending = stream.start(request)
            try:
                if timeout_s is None:
                    await pending.done
                else:
                    async with asyncio.timeout(timeout_s):
                        await pending.done
            except TimeoutError:
                raise InstanceUnavailable(
                    f"{self.address}: DEADLINE_EXCEEDED: no end after {timeout_s} s", pending.segment
                ) from None
            finally:
                if not pending.done.done() or pending.done.cancelled():
                    stream.cancel(request_id)  # the caller was cancelled or timed out
        return pending.segment

    def _open_stream(self) -> _GenerateStream:
        if self._failed is not None:
            raise InstanceUnavailable(f"{self.address}: {self._failed}")
        if self._generate_stream is None or self._generate_stream.ended is not None:
            self._generate_stream = _GenerateStream(self._stub, self._metadata, self.address)
        return self._generate_stream

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
        if self._generate_stream is not None:
            self._generate_stream.end("client closed")
        await self._channel.close()


def _status_error(address: str, code: grpc.StatusCode, details: str, segment: Segment) -> Exception:
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(f"instance {address} refused the request: {details}")
    return InstanceUnavailable(f"{address}: {code.name}: {details}", segment)


def _collect(segment: Segment, chunk: Chunk) -> None:
    if chunk.token_ids:
        segment.chunks.append(chunk)
    if chunk.finish_reason != FinishReason.NONE:
        segment.finish_reason, segment.stop_token_id = chunk.finish_reason, chunk.stop_token_id
