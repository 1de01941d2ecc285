"""An in-process transformers engine that stands in for a rollout instance under the real
`AgentLoop`, for evaluating a small policy without starting vLLM.

The agent loop talks to instances through a pool (`get(id).client.generate(...)`, `router`,
`changed`, loss handling). `LocalPool` offers that surface over one `LocalGreedyInstance`, so the
loop's own code parses tool calls, runs the real tools and appends the result tokens exactly as in
RL; only the token generator differs (transformers instead of vLLM, which give the same greedy
tokens in fp32: PLATFORM.md).

Batching: every trajectory of an evaluation is its own asyncio task, each waiting on its own
generation call. The instance gathers the calls that arrive while the previous batch runs (and
waits briefly for the ones still running tools), then generates them together with left padding in
a worker thread, so the event loop keeps running tool calls meanwhile.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from libra.rollout.types import Chunk, FinishReason, SamplingSpec, Segment
from libra.scheduler import CmlfqConfig, LeastLoadRouter

INSTANCE_ID = 0


@dataclass
class _Request:
    context: list[int]
    sampling: SamplingSpec
    done: asyncio.Future


class LocalGreedyInstance:
    """Greedy decoding with a transformers causal LM, duck-typed as an `InstanceClient`.

    Only temperature 0 is served (evaluation is greedy); anything else is refused with ValueError,
    as an instance refuses a bad request.
    """

    def __init__(self, model, pad_token_id: int, max_model_len: int, gather_wait_s: float = 0.05):
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len
        self.gather_wait_s = gather_wait_s
        self.num_generated_tokens = 0
        self._pending: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        chunk_tokens: int = 0,
        timeout_s: float | None = None,
    ) -> Segment:
        if sampling.temperature != 0:
            raise ValueError(
                f"the local engine decodes greedily only, got temperature={sampling.temperature}"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id}: {len(prompt_token_ids)} tokens fill max_model_len")
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._serve())
        request = _Request(list(prompt_token_ids), sampling, loop.create_future())
        self._pending.append(request)
        self._wakeup.set()
        return await request.done

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            # Trajectories whose tool call is still running join this batch if they finish soon.
            await asyncio.sleep(self.gather_wait_s)
            self._wakeup.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            try:
                segments = await asyncio.to_thread(self._generate_batch, batch)
            except Exception as e:  # noqa: BLE001 - the callers get the failure, the server goes on
                for request in batch:
                    request.done.set_exception(e)
                continue
            for request, segment in zip(batch, segments, strict=True):
                request.done.set_result(segment)

    def _generate_batch(self, batch: list[_Request]) -> list[Segment]:
        import torch

        stop_ids = sorted({t for r in batch for t in r.sampling.stop_token_ids})
        max_new = max(min(r.sampling.max_tokens, self.max_model_len - len(r.context)) for r in batch)
        width = max(len(r.context) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):  # left padding: every row's next token is at the end
            input_ids[row, width - len(request.context) :] = torch.tensor(request.context)
            attention[row, width - len(request.context) :] = 1
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=stop_ids or None,
                pad_token_id=self.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new_ids = out.sequences[:, width:].tolist()
        logprobs = torch.stack(out.logits, dim=1).log_softmax(-1)
        return [self._segment(request, new_ids[row], logprobs[row]) for row, request in enumerate(batch)]

    def _segment(self, request: _Request, new_ids: list[int], logprobs_TV) -> Segment:
        """Cuts a row's output at its first stop token (kept, as vLLM keeps it) or its own
        max_tokens; what the batch generated past that belongs to no one."""
        limit = min(request.sampling.max_tokens, self.max_model_len - len(request.context))
        stops = set(request.sampling.stop_token_ids)
        tokens, finish, stop_id = [], FinishReason.LENGTH, -1
        for token in new_ids[:limit]:
            tokens.append(token)
            if token in stops:
                finish, stop_id = FinishReason.STOP, token
                break
        token_logprobs = [float(logprobs_TV[i, t]) for i, t in enumerate(tokens)]
        self.num_generated_tokens += len(tokens)
        chunk = Chunk(tokens, token_logprobs, weight_version=0, finish_reason=finish, stop_token_id=stop_id)
        return Segment([chunk] if tokens else [], finish, stop_id)


@dataclass
class _Pooled:
    instance_id: int
    client: LocalGreedyInstance
    max_model_len: int
    lost: bool = False


class LocalPool:
    """The `InstancePool` surface the agent loop uses, over one local instance that never fails."""

    def __init__(self, instance: LocalGreedyInstance):
        self.router = LeastLoadRouter(CmlfqConfig())
        self.router.add_instance(INSTANCE_ID, 0)
        self._pooled = _Pooled(INSTANCE_ID, instance, instance.max_model_len)
        self.changed = asyncio.Event()
        self.waiting = 0  # its one instance is never full to the router, nobody waits for room

    def room_freed(self) -> None:
        """Nothing waits for room here (see `InstancePool.room_freed`)."""

    def get(self, instance_id: int) -> _Pooled:
        if instance_id != INSTANCE_ID:
            raise KeyError(f"the local pool has only instance {INSTANCE_ID}, not {instance_id}")
        return self._pooled

    def live_ids(self) -> list[int]:
        return [INSTANCE_ID]

    async def confirm_lost(self, instance_id: int) -> bool:
        return False

    def mark_lost(self, instance_id: int, reason: str) -> list[str]:
        raise RuntimeError(f"the local instance cannot be lost ({reason})")

    async def close(self) -> None:
        await self._pooled.client.close()
