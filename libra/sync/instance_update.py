"""Driving a version switch on one vLLM engine: stage on every rank, commit only if all staged,
roll back every rank if any commit failed, reset the prefix cache on success.

`apply_version` drives a `vllm.LLM` (tests, offline use: call it between `generate` calls);
`apply_version_async` drives the rollout instance's `AsyncLLM`, which the caller pauses first and
resumes afterwards with the version this returns (pause -> load -> reset prefix cache -> resume).
Either way, on failure the engine keeps computing with its old version, and the result says why,
so the controller can retry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from libra.sync.load_request import LoadRequest


@dataclass(frozen=True)
class LoadResult:
    ok: bool
    version: int
    """The version the engine runs after the call (the old one when ok is False)."""
    error: str = ""
    stage_seconds: float = 0.0
    """Slowest rank's fetch + verify."""
    commit_seconds: float = 0.0
    """Slowest rank's copy into the live params."""
    seconds: float = 0.0
    """Wall time of the whole switch as the caller measured it (a rollout instance: pause ->
    resume); 0 where the caller does not set it."""
    num_preempted: int = 0
    """Requests in flight that the switch preempted (a rollout instance)."""


def _failure(results: list[dict[str, Any]]) -> str:
    return "; ".join(f"rank {r['rank']}: {r['error']}" for r in results if not r["ok"])


def _slowest(results: list[dict[str, Any]]) -> float:
    return max((r["seconds"] for r in results), default=0.0)


def _plain(request: LoadRequest | Mapping[str, Any]) -> dict[str, Any]:
    """The request as `collective_rpc` carries it to the workers (plain data)."""
    return request.to_dict() if isinstance(request, LoadRequest) else dict(request)


def apply_version(llm: Any, request: LoadRequest | Mapping[str, Any], fail_after: int = -1) -> LoadResult:
    """Loads `Publication.load_request(tp)` into a `vllm.LLM` started with the Libra worker
    extension. `fail_after` >= 0 injects a failure into the commit (tests)."""
    request = _plain(request)
    version = int(request["version"])
    staged = llm.collective_rpc("libra_stage", args=(request,))
    if not all(r["ok"] for r in staged):
        current = llm.collective_rpc("libra_weight_version")[0]
        return LoadResult(False, current, _failure(staged), _slowest(staged))
    committed = llm.collective_rpc("libra_commit", args=(version, fail_after))
    if not all(r["ok"] for r in committed):
        current = llm.collective_rpc("libra_rollback", args=(version,))[0]
        return LoadResult(False, current, _failure(committed), _slowest(staged), _slowest(committed))
    llm.reset_prefix_cache()  # cached KV was computed by the old weights
    return LoadResult(True, version, "", _slowest(staged), _slowest(committed))


async def apply_version_async(engine: Any, request: LoadRequest | Mapping[str, Any]) -> LoadResult:
    """The same for a paused `AsyncLLM` (`vllm.v1.engine.async_llm`)."""
    request = _plain(request)
    version = int(request["version"])
    staged = await engine.collective_rpc("libra_stage", args=(request,))
    if not all(r["ok"] for r in staged):
        current = (await engine.collective_rpc("libra_weight_version"))[0]
        return LoadResult(False, current, _failure(staged), _slowest(staged))
    committed = await engine.collective_rpc("libra_commit", args=(version,))
    if not all(r["ok"] for r in committed):
        current = (await engine.collective_rpc("libra_rollback", args=(version,)))[0]
        return LoadResult(False, current, _failure(committed), _slowest(staged), _slowest(committed))
    await engine.reset_prefix_cache()
    return LoadResult(True, version, "", _slowest(staged), _slowest(committed))
