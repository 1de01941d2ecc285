"""The RolloutInstance gRPC service (asyncio) over an `InstanceEngine`, and the instance process:
token-in/token-out generation, pause/resume, stats, and loading published weight versions.

Run as a worker: `python -m libra.rollout.instance_server --spec JSON`, an `InstanceSpec`
(`spec.to_argv()`; the token from its `token_file` or LIBRA_TOKEN). Once serving, it writes
`host:port` to the address file (atomically), so a launcher that asked for any free port learns
which one. It exits when
the engine dies, so that its node agent reports the worker's exit and the controller notices.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from libra.backends import BackendConfig, get_backend
from libra.control.aio_server import start_aio_server
from libra.control.auth import TOKEN_ENV, read_token_file
from libra.control.config import ControlConfig
from libra.control.convert import InvalidArgument
from libra.launch_spec import ArgvSpec
from libra.logs import configure_logging
from libra.rollout import convert
from libra.rollout.config import InstanceConfig
from libra.rollout.engine import EngineInputError, InstanceEngine
from libra.v1 import rollout_pb2, rollout_pb2_grpc

logger = logging.getLogger(__name__)

PROFILE_ENV = "LIBRA_INSTANCE_PROFILE"
"""When set, the instance runs its event loop (gRPC service, engine wrapper, vLLM's frontend)
under cProfile and writes the stats to this path when it stops (diagnostics: the rollout
benchmark's --profile)."""


class _CallRefused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _StreamedCallContext:
    """What a `Generate` handler sees of its call when it runs inside `GenerateStream`: `abort`
    ends that call alone, with an error event, instead of the whole stream."""

    __slots__ = ()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _CallRefused(code, details)


class MultiplexedGenerate:
    """`GenerateStream` over the servicer's own `Generate`: each call on the stream runs that
    handler in a task of its own, exactly as a unary-stream call would, and its chunks go back as
    events. A servicer mixes this in beside `RolloutInstanceServicer` (test fakes too, so that
    they serve the client's streamed path).

    Why a stream: a grpc.aio unary-stream call costs ~0.5 ms of CPU in setup, auth, handler and
    trailers (client and server together), per generation call; on the stream a call is one
    entry in a message. Events of calls that finish in the same engine step, and calls the
    client starts together, share one message: the writer sends what accumulated while it was
    writing the previous one."""

    async def GenerateStream(self, request_iterator, context):
        calls: dict[str, asyncio.Task] = {}
        outbox: list[rollout_pb2.GenerateStreamEvent] = []
        ready = asyncio.Event()

        async def run_call(request: rollout_pb2.GenerateRequest) -> None:
            request_id = request.request_id
            try:
                finished = False
                async for chunk in self.Generate(request, _StreamedCallContext()):
                    outbox.append(rollout_pb2.GenerateStreamEvent(request_id=request_id, chunk=chunk))
                    ready.set()
                    finished = chunk.finish_reason != rollout_pb2.FINISH_REASON_UNSPECIFIED
                if not finished:  # a unary call's client would see its stream end early
                    outbox.append(
                        _error_event(
                            request_id, grpc.StatusCode.UNKNOWN, "the call ended without a finish reason"
                        )
                    )
            except _CallRefused as e:
                outbox.append(_error_event(request_id, e.code, e.details))
            except asyncio.CancelledError:
                raise  # a cancel, or the stream ended: the client wants nothing more of it
            except Exception as e:  # noqa: BLE001 - one call's bug must not end the stream's others
                logger.exception("generate %s failed", request_id)
                outbox.append(_error_event(request_id, grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))
            finally:
                if calls.get(request_id) is asyncio.current_task():
                    del calls[request_id]
                ready.set()

        async def read_requests() -> None:
            try:
                async for message in request_iterator:
                    for request in message.generate:
                        if request.request_id in calls:
                            outbox.append(
                                _error_event(
                                    request.request_id,
                                    grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request_id {request.request_id!r} is already live",
                                )
                            )
                            ready.set()
                        else:
                            calls[request.request_id] = asyncio.create_task(run_call(request))
                    for request_id in message.cancel:
                        task = calls.pop(request_id, None)
                        if task is not None:
                            task.cancel()
            finally:
                ready.set()  # the client is done sending (or gone): the writer checks for the end

        reader = asyncio.create_task(read_requests())
        try:
            while True:
                await ready.wait()
                ready.clear()
                if outbox:
                    events = outbox[:]
                    outbox.clear()
                    yield rollout_pb2.GenerateStreamReply(events=events)
                if reader.done() and (reader.cancelled() or reader.exception() is not None or not calls):
                    break
        finally:
            reader.cancel()
            for task in calls.values():
                task.cancel()  # each aborts its engine request (Generate's CancelledError path)


def _error_event(request_id: str, code: grpc.StatusCode, details: str) -> rollout_pb2.GenerateStreamEvent:
    return rollout_pb2.GenerateStreamEvent(request_id=request_id, error_code=code.value[0], error=details)


class RolloutInstanceServicer(MultiplexedGenerate, rollout_pb2_grpc.RolloutInstanceServicer):
    def __init__(self, engine: InstanceEngine):
        self._engine = engine

    async def Generate(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        if request.stream_chunk_tokens < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream_chunk_tokens must be >= 0")
        try:
            sampling = convert.sampling_from_proto(request.sampling)
            stream = self._engine.generate(
                request.request_id, list(request.prompt_token_ids), sampling, request.stream_chunk_tokens
            )
            async for chunk in stream:
                yield convert.chunk_to_proto(chunk)
        except (InvalidArgument, EngineInputError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.CancelledError:
            # The client went away (or cancelled): free the engine's slot at once.
            await self._engine.abort([request.request_id])
            raise
        except Exception as e:  # noqa: BLE001 - engine death reaches the caller as UNAVAILABLE
            if not self._engine.errored:
                raise
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine dead: {e}")

    async def Abort(self, request, context):
        return rollout_pb2.AbortReply(num_aborted=await self._engine.abort(list(request.request_ids)))

    async def Pause(self, request, context):
        try:
            mode = convert.pause_mode_from_proto(request.mode)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return rollout_pb2.PauseReply(num_in_flight=await self._engine.pause(mode))

    async def Resume(self, request, context):
        version = request.weight_version if request.HasField("weight_version") else None
        return rollout_pb2.ResumeReply(weight_version=await self._engine.resume(version))

    async def Stats(self, request, context):
        return convert.stats_to_proto(self._engine.stats())

    async def LoadWeights(self, request, context):
        try:
            load = convert.load_request_from_proto(request)
            result = await self._engine.load_version(load)
        except (InvalidArgument, EngineInputError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not result.ok:
            logger.warning(
                "load of version %d failed, still on %d: %s", load.version, result.version, result.error
            )
        return convert.load_result_to_proto(result)

    async def ReadWeights(self, request, context):
        ranks = await self._engine.read_weights(list(request.names))
        return rollout_pb2.ReadWeightsReply(ranks=ranks, weight_version=self._engine.weight_version)


def freeze_startup_heap() -> None:
    """Moves every object alive after start-up (vLLM, torch and transformers modules: ~600k) out
    of the garbage collector's reach, as vLLM's own API server does after its start-up
    (`vllm.utils.gc_utils.freeze_gc_heap`). Without it, each full collection while serving walks
    them all (~0.1-0.2 s on this 2-core host; the instance's cProfile showed ~0.46 s of them over
    five benchmark runs of 144 calls, landing in whatever allocated at the time)."""
    gc.collect()
    gc.freeze()


class _GcClock:
    """Collections and their seconds per generation (diagnostics: `PROFILE_ENV`)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._started

    def __str__(self) -> str:
        return ", ".join(f"gen{g}: {self.count[g]} collections {self.seconds[g]:.3f} s" for g in range(3))


async def serve(
    config: InstanceConfig, control: ControlConfig, token: str, port: int, address_file: str | None
) -> int:
    engine = InstanceEngine(config).start()
    freeze_startup_heap()

    def add_servicers(server: grpc.aio.Server) -> list[str]:
        rollout_pb2_grpc.add_RolloutInstanceServicer_to_server(RolloutInstanceServicer(engine), server)
        return [rollout_pb2.DESCRIPTOR.services_by_name["RolloutInstance"].full_name]

    server = await start_aio_server(control, token, add_servicers, port=port)
    address = f"{control.host}:{server.port}"
    if address_file:
        tmp = Path(address_file).with_suffix(".tmp")
        tmp.write_text(address + "\n")
        tmp.rename(address_file)
    logger.info("rollout instance serving %s on %s", config.model, address)
    print(f"rollout instance serving on {address}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    exit_code = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            if engine.errored:
                logger.error("the engine died; exiting so the node agent reports it")
                exit_code = 1
                break
    await server.stop(grace_s=1.0)
    engine.shutdown()
    return exit_code


@dataclass(frozen=True)
class InstanceSpec(ArgvSpec):
    """How to start one rollout instance: its engine, and its gRPC service with `control`'s
    settings (TLS among them) on `host`."""

    module = "libra.rollout.instance_server"
    instance: InstanceConfig
    backend: BackendConfig
    """Whose `engine_defaults` fill the instance's unset engine settings."""
    control: ControlConfig = field(default_factory=ControlConfig)
    host: str = "127.0.0.1"
    port: int = 0
    """0: any free port (see `address_file`)."""
    address_file: str | None = None
    """Written with `host:port` once serving."""
    token_file: str | None = None
    """The run's bearer token; default: LIBRA_TOKEN."""


def main(argv: list[str] | None = None) -> int:
    spec = InstanceSpec.from_argv(sys.argv[1:] if argv is None else argv)
    configure_logging("rollout-instance")
    token = read_token_file(spec.token_file) if spec.token_file else os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"no token: set the spec's token_file or {TOKEN_ENV}", file=sys.stderr)
        return 2
    profile_path = os.environ.get(PROFILE_ENV)
    if profile_path:
        import cProfile

        gc_clock = _GcClock()
        gc.callbacks.append(gc_clock)
        profiler = cProfile.Profile()
        profiler.enable()
    control = dataclasses.replace(spec.control, host=spec.host)
    backend = get_backend(spec.backend.name, **spec.backend.options())
    instance = spec.instance.for_backend(backend)
    exit_code = asyncio.run(serve(instance, control, token, spec.port, spec.address_file))
    if profile_path:
        profiler.disable()
        profiler.dump_stats(profile_path)
        Path(profile_path + ".gc").write_text(f"{gc_clock}\n")
    # vLLM leaves non-daemon threads behind after shutdown(); the engine is stopped, so leave now.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    sys.exit(main())
