"""Check 1: the backend is usable here, and what it reports (devices, hardware profile, the
rollout engine's defaults)."""

from __future__ import annotations

from libra.checks.context import CheckContext
from libra.checks.result import CheckResult

NAME = "backend"


def run(ctx: CheckContext) -> CheckResult:
    backend = ctx.backend
    availability = backend.availability()
    if not availability.available:
        return CheckResult(NAME, False, f"{backend.name} unavailable: {availability.reason}")
    devices = backend.devices()
    kinds = ", ".join(dict.fromkeys(d.kind for d in devices))
    found = f"{backend.name}, {len(devices)} devices ({kinds})"
    values: dict[str, float | int | str] = {"devices": len(devices), "kinds": kinds}
    try:
        # cuda refuses a GPU without a datasheet profile rather than let the planner guess.
        profile = backend.hardware_profile().name
    except RuntimeError as exc:
        return CheckResult(NAME, False, f"{found}, no hardware profile: {exc}", values)
    defaults = backend.engine_defaults
    engine = (
        f"enforce_eager={defaults.enforce_eager}, "
        f"kv_cache_gib={defaults.kv_cache_gib}, gpu_memory_utilization={defaults.gpu_memory_utilization}, "
        f"chunked_prefill={defaults.chunked_prefill}"
    )
    values.update(profile=profile, engine_defaults=engine)
    return CheckResult(NAME, True, f"{found}, profile {profile}, engine {engine}", values)
