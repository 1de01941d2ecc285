"""The job's rollout-instance process: the rollout component's `RolloutInstance` service plus a
`WeightLoader` service that switches the engine to a new policy version.

    python -m libra.job.instance_worker --model DIR --address-file F [instance_server options]

Why a separate entry point: the rollout instance (`libra.rollout.instance_server`) does not yet
expose a way to load weights (Resume only re-tags the version), and the shared-memory publisher
of `libra.sync` has no instance-side RPC yet. Until it has, the job publishes each version as an
HF safetensors folder and this process reloads it in place with vLLM's `reload_weights`
(0.02-0.1 s for the tiny model, PLATFORM.md): pause (requests in flight are preempted) → reload → resume
with the new version, which also resets the prefix cache (KV of the old weights must not be
reused). Tokens sampled before and after the switch are tagged with their own version.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import grpc

from libra.config import ControlConfig
from libra.control.aio_server import start_aio_server
from libra.control.auth import TOKEN_ENV, read_token_file
from libra.rollout.config import InstanceConfig
from libra.rollout.engine import InstanceEngine
from libra.rollout.instance_server import RolloutInstanceServicer, build_parser
from libra.rollout.types import PauseMode
from libra.v1 import job_pb2, job_pb2_grpc, rollout_pb2, rollout_pb2_grpc

logger = logging.getLogger(__name__)


class WeightLoaderServicer(job_pb2_grpc.WeightLoaderServicer):
    def __init__(self, engine: InstanceEngine):
        self._engine = engine
        self._lock = asyncio.Lock()

    async def LoadWeights(self, request, context):
        if not request.directory or not any(Path(request.directory).glob("*.safetensors")):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"directory {request.directory!r} holds no *.safetensors"
            )
        async with self._lock:  # one switch at a time: versions must be applied in order
            started = time.perf_counter()
            # ABORT, not KEEP: a kept request would continue on KV computed by the old weights, so
            # its next tokens would come from neither version. Aborted requests end PREEMPTED, the
            # agent loop resubmits them with the tokens they kept, and the re-prefill runs on the
            # new weights.
            await self._engine.pause(PauseMode.ABORT)
            try:
                # TODO(job): use the engine's own load RPC once the rollout instance has one; this
                # reaches into the AsyncLLM the engine wraps.
                await self._engine._engine.collective_rpc(
                    "reload_weights", kwargs={"weights_path": request.directory}
                )
            except Exception as e:  # noqa: BLE001 - the engine keeps serving its old version
                await self._engine.resume()
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"reload failed: {e}")
            version = await self._engine.resume(request.version)
        return job_pb2.LoadWeightsReply(version=version, seconds=time.perf_counter() - started)


async def serve(
    config: InstanceConfig, control: ControlConfig, token: str, port: int, address_file: str | None
) -> int:
    engine = InstanceEngine(config).start()

    def add_servicers(server: grpc.aio.Server) -> list[str]:
        rollout_pb2_grpc.add_RolloutInstanceServicer_to_server(RolloutInstanceServicer(engine), server)
        job_pb2_grpc.add_WeightLoaderServicer_to_server(WeightLoaderServicer(engine), server)
        return [
            rollout_pb2.DESCRIPTOR.services_by_name["RolloutInstance"].full_name,
            job_pb2.DESCRIPTOR.services_by_name["WeightLoader"].full_name,
        ]

    server = await start_aio_server(control, token, add_servicers, port=port)
    address = f"{control.host}:{server.port}"
    if address_file:
        tmp = Path(address_file).with_suffix(".tmp")
        tmp.write_text(address + "\n")
        tmp.rename(address_file)
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = read_token_file(args.token_file) if args.token_file else os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"no token: pass --token-file or set {TOKEN_ENV}", file=sys.stderr)
        return 2
    config = InstanceConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
    )
    exit_code = asyncio.run(serve(config, ControlConfig(host=args.host), token, args.port, args.address_file))
    # vLLM leaves non-daemon threads behind after shutdown(); the engine is stopped, so leave now.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    sys.exit(main())
