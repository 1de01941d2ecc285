"""One rollout instance's engine: vLLM's `AsyncLLM`, token-in/token-out, with pause/resume and the
policy version of every token it produces.

Requests arrive as token ids (`TokensPrompt`); nothing is detokenized. Each generation call yields
`Chunk`s of new tokens with their sampling logprobs, each chunk produced by one weight version
(Pause → weights change → Resume with a new version), so a trajectory resumed across an update
knows which policy sampled each token.

A call that wants its tokens only at the end (`chunk_tokens == 0`, the agent loop's default) asks
vLLM for FINAL_ONLY outputs: the request's coroutine wakes once per call instead of once per
token (most of the rollout path's CPU overhead over vLLM). vLLM's output processor still ends an
aborted FINAL_ONLY request with one output holding every token and logprob produced so far
(`OutputProcessor.abort_requests`), and labels each token with the engine core's weight version
at the step that sampled it (`CompletionOutput.weight_versions`), so partial rollout and
per-token versions need no per-token wake-up. Streamed calls (`chunk_tokens > 0`) use DELTA
outputs.

Weights change through `load_version`: the engine runs with libra.sync's worker extension, which
stages a published version on every TP rank, verifies it, and commits it only when all staged
(`libra.sync.instance_update`).

vLLM must be configured before it is imported (PLATFORM.md): `configure_vllm_env` sets the
variables and must run first in the process.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from libra.rollout.config import InstanceConfig
from libra.rollout.types import Chunk, FinishReason, InstanceStats, PauseMode, SamplingSpec
from libra.sync.instance_update import LoadResult, apply_version_async
from libra.sync.load_request import LoadRequest
from libra.sync.vllm_loader import WORKER_EXTENSION

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class EngineInputError(ValueError):
    """A request the engine cannot take (empty or over-long prompt, duplicate id)."""


def configure_vllm_env(config: InstanceConfig) -> None:
    """The environment vLLM needs for `config` (resolved: `InstanceConfig.for_backend`), set
    before vLLM is imported; explicit values win."""
    _require_resolved(config)
    if config.kv_cache_gib is not None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The model runner inside the engine-core process instead of a third process: ~2.5 s less
    # start-up and half the memory on the CPU. (vLLM's v1 engine core always runs in a process of
    # its own; at TP 1 on a GPU its executor runs there anyway, at TP > 1 in worker processes.)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _require_resolved(config: InstanceConfig) -> None:
    if not config.engine_settings_decided:
        raise ValueError(
            "the rollout instance's engine settings are not resolved for a backend: "
            "use InstanceConfig.for_backend(backend)"
        )


def engine_args(config: InstanceConfig):
    """The `AsyncEngineArgs` an instance runs `config` with (also what the rollout benchmark's
    direct side runs: vLLM's defaults differ, e.g. max_num_seqs 128 instead of our 256)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(config))


def engine_kwargs(config: InstanceConfig) -> dict[str, object]:
    """`engine_args`' arguments, from a resolved `config` (`InstanceConfig.for_backend`)."""
    _require_resolved(config)
    kwargs: dict[str, object] = dict(
        model=config.model,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        tensor_parallel_size=config.tensor_parallel_size,
        max_num_seqs=config.max_num_seqs,
        enforce_eager=config.enforce_eager,
        enable_chunked_prefill=config.chunked_prefill,
        seed=config.seed,
        disable_log_stats=False,
        worker_extension_cls=WORKER_EXTENSION,
        # The logprobs of the distribution each token was sampled from (after temperature),
        # not of the raw logits: RL's importance ratios need the behaviour policy.
        logprobs_mode="processed_logprobs",
    )
    if config.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    return kwargs


class EngineStatsLogger:
    """A vLLM stat logger that remembers the scheduler's last KV-cache usage and counts the tokens
    each engine step generates (per step, not per output: FINAL_ONLY requests report their tokens
    only at the end, and Stats must see generation progress while they run), and the steps and
    prefilled prompt tokens (how full each step's batch was; the rollout benchmark compares them
    with direct vLLM's)."""

    def __init__(self, stats_window_s: float):
        self.kv_cache_usage = 0.0
        self.num_generated = 0
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.recent: collections.deque[tuple[float, int]] = collections.deque()
        self._window_s = stats_window_s

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self.num_steps += 1
            self.num_prompt_tokens += iteration_stats.prompt_token_stats.computed
        if iteration_stats is not None and iteration_stats.num_generation_tokens:
            now = time.monotonic()
            self.num_generated += iteration_stats.num_generation_tokens
            self.recent.append((now, iteration_stats.num_generation_tokens))
            while self.recent and self.recent[0][0] < now - self._window_s:
                self.recent.popleft()

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def keep_only_stat_logger(engine: AsyncLLM, ours: EngineStatsLogger) -> None:
    """Drops the stat loggers vLLM adds beside ours (its console logger and Prometheus metrics):
    an instance reports through Stats, nobody scrapes it, and Prometheus' per-step histograms took
    ~0.8 ms of the frontend's CPU per engine step (cProfile of the rollout benchmark: 0.49 s over
    578 steps, a quarter of the output handler's 2.0 s)."""
    manager = getattr(engine, "logger_manager", None)
    if manager is None:  # stats disabled: nothing to drop (and Stats sees no KV usage)
        return
    kept = [s for s in manager.stat_loggers if ours in getattr(s, "per_engine_stat_loggers", {}).values()]
    if len(kept) != 1:
        raise RuntimeError(f"vLLM's stat loggers changed shape: {manager.stat_loggers}")
    manager.stat_loggers = kept


class _Request:
    __slots__ = ("preempted", "abort_requested")

    def __init__(self) -> None:
        self.preempted = False
        self.abort_requested = False


class InstanceEngine:
    """Wraps one `AsyncLLM`. Create and use it inside the asyncio loop that serves it."""

    def __init__(self, config: InstanceConfig):
        if not config.model:
            raise ValueError("rollout.instance.model must name a model folder")
        _require_resolved(config)
        self.config = config
        self.weight_version = 0
        self.paused = False
        self._engine: AsyncLLM | None = None
        self._stats_logger = EngineStatsLogger(config.stats_window_s)
        self._requests: dict[str, _Request] = {}
        self._started_at = time.monotonic()
        self._load_lock = asyncio.Lock()

    def start(self) -> InstanceEngine:
        configure_vllm_env(self.config)
        from vllm.v1.engine.async_llm import AsyncLLM

        self._engine = AsyncLLM.from_engine_args(
            engine_args(self.config), stat_loggers=[lambda *a, **k: self._stats_logger]
        )
        keep_only_stat_logger(self._engine, self._stats_logger)
        self._started_at = time.monotonic()
        return self

    @property
    def errored(self) -> bool:
        return self._engine is not None and self._engine.errored

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    @staticmethod
    def _sampling_params(sampling: SamplingSpec, room: int, final_only: bool):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=min(sampling.max_tokens, room),
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,  # the sampled token's logprob only
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
        )

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, chunk_tokens: int = 0
    ) -> AsyncIterator[Chunk]:
        """Generates one call's tokens. Yields a chunk once `chunk_tokens` new tokens are ready (0:
        only at the end), whenever the weight version changes, and at the end (`finish_reason` set).
        An aborted or preempted call ends with the tokens it produced."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        assert self._engine is not None, "start() first"
        room = self.config.max_model_len - len(prompt_token_ids)
        if not prompt_token_ids:
            raise EngineInputError("prompt_token_ids must not be empty")
        if room < 1:
            raise EngineInputError(
                f"prompt of {len(prompt_token_ids)} tokens leaves no room in "
                f"max_model_len={self.config.max_model_len}"
            )
        if request_id in self._requests:
            raise EngineInputError(f"request_id {request_id!r} is already live")
        final_only = chunk_tokens == 0
        state = self._requests[request_id] = _Request()
        try:
            try:
                # vLLM's add_request processes the input (in a thread) before it knows the id: an
                # abort (or a Pause in ABORT mode) landing meanwhile finds nothing to abort, and
                # the request would then wait in a paused engine forever. Repeat such an abort
                # once vLLM holds the request.
                queue = await self._engine.add_request(
                    request_id,
                    TokensPrompt(prompt_token_ids=prompt_token_ids),
                    self._sampling_params(sampling, room, final_only),
                )
            except VLLMClientError as e:
                # The caller's input (sampling, token ids), not the instance's failure: a client
                # that counted it as one would take a healthy instance out of its pool.
                raise EngineInputError(f"vLLM refused the request: {e}") from None
            if state.abort_requested:
                await self._engine.abort(queue.request_id, internal=True)
            outputs = self._outputs(queue)
            stream = (
                self._final_chunks(outputs, state)
                if final_only
                else self._delta_chunks(outputs, state, chunk_tokens)
            )
            async for chunk in stream:
                yield chunk
        finally:
            del self._requests[request_id]

    async def _outputs(self, queue) -> AsyncIterator:
        """The request's outputs from vLLM's per-request queue, read as `AsyncLLM.generate` reads
        them (until the finished one); a reader that goes away early aborts the request."""
        finished = False
        try:
            while not finished:
                output = queue.get_nowait() or await queue.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                await self._engine.abort(queue.request_id, internal=True)
            raise

    async def _final_chunks(self, outputs, state: _Request) -> AsyncIterator[Chunk]:
        """FINAL_ONLY: one output at the end (or at an abort) with all tokens, split into chunks by
        the weight-version labels vLLM recorded per token."""
        async for output in outputs:
            if not output.finished:
                continue
            completion = output.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = _sampled_logprobs(token_ids, completion.logprobs)
            chunks = [
                Chunk(token_ids[start:end], logprobs[start:end], version)
                for version, start, end in self._version_runs(completion.weight_versions, len(token_ids))
            ] or [Chunk([], [], self.weight_version)]
            chunks[-1].finish_reason, chunks[-1].stop_token_id = _finish(completion, state.preempted)
            for chunk in chunks:
                yield chunk
            return
        # The stream ended without a finish reason: the engine dropped the request.
        yield Chunk(
            [], [], self.weight_version, FinishReason.PREEMPTED if state.preempted else FinishReason.ABORT
        )

    def _version_runs(self, spans, num_tokens: int) -> list[tuple[int, int, int]]:
        """(version, start, end) runs of a finished output's tokens. Tokens without a label (none
        reported) belong to the version now loaded: the engine's label changes only in `resume`."""
        if not spans:
            return [(self.weight_version, 0, num_tokens)] if num_tokens else []
        return [
            (_version_of_label(span.version), span.start, span.end) for span in spans if span.end > span.start
        ]

    async def _delta_chunks(self, outputs, state: _Request, chunk_tokens: int) -> AsyncIterator[Chunk]:
        """DELTA: new tokens after every step, flushed every `chunk_tokens` and whenever the
        version changes."""
        pending = Chunk([], [], self.weight_version)
        async for output in outputs:
            completion = output.outputs[0]
            if self.weight_version != pending.weight_version:
                if pending.token_ids:
                    yield pending
                pending = Chunk([], [], self.weight_version)
            new_ids = list(completion.token_ids)
            pending.token_ids.extend(new_ids)
            pending.logprobs.extend(_sampled_logprobs(new_ids, completion.logprobs))
            if completion.finish_reason is not None:
                pending.finish_reason, pending.stop_token_id = _finish(completion, state.preempted)
                yield pending
                return
            if len(pending.token_ids) >= chunk_tokens:
                yield pending
                pending = Chunk([], [], self.weight_version)
        # The stream ended without a finish reason: the engine dropped the request.
        pending.finish_reason = FinishReason.PREEMPTED if state.preempted else FinishReason.ABORT
        yield pending

    async def abort(self, request_ids: list[str]) -> int:
        live = [r for r in request_ids if r in self._requests]
        for request_id in live:
            self._requests[request_id].abort_requested = True
        if live:
            await self._engine.abort(live)
        return len(live)

    async def pause(self, mode: PauseMode) -> int:
        """Stops scheduling; returns the number of requests in flight. In ABORT mode they end
        PREEMPTED; in KEEP mode they wait for `resume`."""
        in_flight = list(self._requests)
        self.paused = True
        if mode == PauseMode.ABORT:
            for request_id in in_flight:
                self._requests[request_id].preempted = True
            await self.abort(in_flight)
        await self._engine.pause_generation(mode="keep", clear_cache=False)
        # Let the generate() coroutines take the outputs of the last steps before the version can
        # change, so those tokens are tagged with the version that produced them.
        for _ in range(10):
            await asyncio.sleep(0)
        return len(in_flight)

    async def resume(self, weight_version: int | None = None) -> int:
        if weight_version is not None and weight_version != self.weight_version:
            self.weight_version = weight_version
            # The engine core labels every token it samples from now on with this version (the
            # label FINAL_ONLY calls split their tokens by); it changes only while paused.
            await self._engine.update_weight_version(str(weight_version))
            await self._engine.reset_prefix_cache()  # cached KV of old weights must not be reused
        await self._engine.resume_generation()
        self.paused = False
        return self.weight_version

    async def load_version(self, request: LoadRequest) -> LoadResult:
        """Switches to a published version: pause → stage and commit on every rank → resume
        tagged with the new version; on any failure resume with the old one (the loader never
        leaves a rank half-loaded, see `libra.sync.vllm_loader`). One load at a time, so that
        versions are applied in order."""
        assert self._engine is not None, "start() first"
        if request.tp_size != self.config.tensor_parallel_size:
            raise EngineInputError(
                f"load request has {request.tp_size} ranks, "
                f"this instance runs TP={self.config.tensor_parallel_size}"
            )
        async with self._load_lock:
            if request.version <= self.weight_version:
                raise EngineInputError(
                    f"version {request.version} is not newer than the loaded {self.weight_version}"
                )
            started = time.perf_counter()
            # ABORT, not KEEP: a kept request would continue on KV computed by the old weights, so
            # its next tokens would come from neither version. Aborted requests end PREEMPTED; the
            # agent loop resubmits them with the tokens they kept, and their re-prefill runs on
            # the new weights.
            num_preempted = await self.pause(PauseMode.ABORT)
            try:
                result = await apply_version_async(self._engine, request)
            except Exception as error:  # noqa: BLE001 - an RPC failure: the workers kept their version
                result = LoadResult(False, self.weight_version, f"{type(error).__name__}: {error}")
            # On failure the workers report the version they still run: the old one.
            await self.resume(result.version if result.ok else self.weight_version)
            return dataclasses.replace(
                result, seconds=time.perf_counter() - started, num_preempted=num_preempted
            )

    async def read_weights(self, names: list[str] | None = None) -> list[bytes]:
        """Per TP rank, its params as the engine computes with them (safetensors bytes; see
        `libra.sync.vllm_loader.read_param`). Verification only: it moves the whole model."""
        assert self._engine is not None, "start() first"
        return await self._engine.collective_rpc("libra_read_params", args=(names or None,))

    def stats(self) -> InstanceStats:
        now = time.monotonic()
        window = min(self.config.stats_window_s, max(now - self._started_at, 1e-3))
        recent = sum(n for t, n in self._stats_logger.recent if t >= now - window)
        return InstanceStats(
            num_active_requests=len(self._requests),
            kv_cache_usage=self._stats_logger.kv_cache_usage,
            generated_tokens_per_s=recent / window,
            num_generated_tokens=self._stats_logger.num_generated,
            weight_version=self.weight_version,
            paused=self.paused,
            max_model_len=self.config.max_model_len,
            tensor_parallel_size=self.config.tensor_parallel_size,
            model=self.config.model,
            num_engine_steps=self._stats_logger.num_steps,
            num_prompt_tokens=self._stats_logger.num_prompt_tokens,
        )


def _finish(completion, preempted: bool) -> tuple[FinishReason, int]:
    if completion.finish_reason == "stop":
        stop = completion.stop_reason
        return FinishReason.STOP, stop if isinstance(stop, int) else -1
    if completion.finish_reason == "length":
        return FinishReason.LENGTH, -1
    return (FinishReason.PREEMPTED if preempted else FinishReason.ABORT), -1


INITIAL_VERSION_LABEL = "default"
"""vLLM's weight-version label before any is set: the checkpoint the engine started on (version 0)."""


def _version_of_label(label: str) -> int:
    return 0 if label == INITIAL_VERSION_LABEL else int(label)


def _sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """The sampled token's logprob at each position (requested with logprobs=0)."""
    return [lp[t].logprob for t, lp in zip(token_ids, logprobs or [], strict=True)]
