"""The one place a router is built from its kind, for the job and the simulator alike, so that the
simulator's validation replays the routing the job ran."""

from __future__ import annotations

import enum

from libra.scheduler.baselines import LeastLoadRouter, LengthMlfqRouter, RoundRobinRouter
from libra.scheduler.cmlfq import CmlfqRouter
from libra.scheduler.config import CmlfqConfig
from libra.scheduler.interface import Router


class RouterKind(enum.StrEnum):
    CMLFQ = "cmlfq"
    """C-MLFQ over the TP buckets."""
    LEAST_LOAD = "least_load"
    """Baseline: the ready instance with the fewest live trajectories per unit of capacity."""
    ROUND_ROBIN = "round_robin"
    """Baseline: ready instances in turn."""
    LENGTH_MLFQ = "length_mlfq"
    """Baseline: demotion by tokens generated so far."""


_ROUTERS: dict[RouterKind, type] = {
    RouterKind.CMLFQ: CmlfqRouter,
    RouterKind.LEAST_LOAD: LeastLoadRouter,
    RouterKind.ROUND_ROBIN: RoundRobinRouter,
    RouterKind.LENGTH_MLFQ: LengthMlfqRouter,
}


def make_router(kind: RouterKind | str, config: CmlfqConfig) -> Router:
    """A router of `kind` over the buckets of `config` (the baselines place by load, but register
    each instance in its TP size's bucket as C-MLFQ does)."""
    return _ROUTERS[RouterKind(kind)](config)
