"""The elastic hybrid pool's join/release protocol as a pure state machine (no processes, no
clock of its own: every event carries `now`, in seconds of any monotonic clock).

A hybrid replica is a whole DP replica that moves between rollout and training:

    REQUESTED -> FETCHING_STATE -> ZERO_SYNC -> ACTIVATING -> ACTIVE -> RELEASING -> RELEASED
        \\______________\\______________\\____________\\__________\\____________> ROLLED_BACK

- REQUESTED: the planner asked for it; the devices are being handed over from rollout.
- FETCHING_STATE: the replica's process loads the latest training state (weights, step,
  staleness counters) from the core; it holds no optimizer state, which stays with the core.
- ZERO_SYNC: registered in the gradient domain; it contributes nothing (zero gradients) while
  the core keeps stepping, and it takes the core's stepped weights to stay in lockstep.
- ACTIVATING: waits at a step-boundary barrier.
- ACTIVE: its gradients on its share of the global batch are added to its paired core replica's
  before the core's DP reduction; the core steps and sends the weights back.
- RELEASING -> RELEASED: detached from the gradient domain; the devices go back to rollout.
- ROLLED_BACK: cancellation, a timeout or the failure of any of its ranks; the devices go back to
  rollout and the core continues as if the replica had never joined.

The pool's membership epoch counts changes of the gradient domain (a replica registers,
activates or leaves). Every gradient payload carries (step, policy version, epoch); one that does
not match the receiver's is dropped and counted, never applied. Each join gets a generation
number: events reported for an older generation of a replica slot (a cancelled join's
background work finishing late) are ignored and counted.

Also the pool's two words with the planner: `HybridJoin` (what the core answers to a join) and
`HybridPoolLimits` (what the pool can pair with the core, so what the planner may plan).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field


class ReplicaState(enum.Enum):
    REQUESTED = "requested"
    FETCHING_STATE = "fetching_state"
    ZERO_SYNC = "zero_sync"
    ACTIVATING = "activating"
    ACTIVE = "active"
    RELEASING = "releasing"
    RELEASED = "released"
    ROLLED_BACK = "rolled_back"


TERMINAL_STATES = frozenset({ReplicaState.RELEASED, ReplicaState.ROLLED_BACK})
REGISTERED_STATES = frozenset({ReplicaState.ZERO_SYNC, ReplicaState.ACTIVATING, ReplicaState.ACTIVE})
"""States in which the replica is a member of the gradient domain."""

_S = ReplicaState
_FORWARD = {
    _S.REQUESTED: _S.FETCHING_STATE,
    _S.FETCHING_STATE: _S.ZERO_SYNC,
    _S.ZERO_SYNC: _S.ACTIVATING,
    _S.ACTIVATING: _S.ACTIVE,
    _S.ACTIVE: _S.RELEASING,
    _S.RELEASING: _S.RELEASED,
}


class IllegalTransition(RuntimeError):
    """An event that the replica's current state does not allow."""


@dataclass(frozen=True)
class ElasticConfig:
    """Timeouts of the join/release protocol, in seconds; each bounds the time spent in one
    state (a replica past its deadline is rolled back by `HybridPool.expire`)."""

    request_timeout_s: float = 120.0
    """REQUESTED: handing the devices over from rollout and starting the replica's process."""
    fetch_timeout_s: float = 300.0
    """FETCHING_STATE: loading the training state."""
    activation_timeout_s: float = 60.0
    """ACTIVATING: every rank of the replica passing the step-boundary barrier."""
    release_timeout_s: float = 60.0
    """RELEASING: stopping the replica's process."""
    gradient_timeout_s: float = 30.0
    """ACTIVE: how long the core waits for the replica's gradient in one step before rolling the
    replica back and completing the step without it."""

    def __post_init__(self) -> None:
        for name in (
            "request_timeout_s",
            "fetch_timeout_s",
            "activation_timeout_s",
            "release_timeout_s",
            "gradient_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"elastic.{name} must be > 0, got {getattr(self, name)}")

    def timeout_of(self, state: ReplicaState) -> float | None:
        return {
            _S.REQUESTED: self.request_timeout_s,
            _S.FETCHING_STATE: self.fetch_timeout_s,
            _S.ACTIVATING: self.activation_timeout_s,
            _S.RELEASING: self.release_timeout_s,
        }.get(state)


@dataclass(frozen=True)
class PayloadHeader:
    """What every gradient payload says about itself."""

    replica: int
    step: int
    policy_version: int
    epoch: int


@dataclass
class HybridReplica:
    replica: int
    generation: int
    state: ReplicaState
    entered_at: float
    """`now` of the last transition (deadlines count from it)."""
    reason: str = ""
    """Why it was rolled back (empty otherwise)."""
    fetched_step: int | None = None
    """The training step of the state it loaded."""
    active_from_step: int | None = None
    """The first step its gradients count in."""


@dataclass
class HybridPool:
    """Every hybrid replica slot of one training job, and the gradient domain's epoch."""

    config: ElasticConfig = field(default_factory=ElasticConfig)
    epoch: int = 0
    replicas: dict[int, HybridReplica] = field(default_factory=dict)
    dropped_payloads: Counter = field(default_factory=Counter)
    """Dropped gradient payloads by reason: not_active, epoch, step, version."""
    ignored_events: int = 0
    """Events of an older generation of a replica slot."""
    _generations: Counter = field(default_factory=Counter)

    # -- join ------------------------------------------------------------------------------------

    def request_join(self, replica: int, now: float) -> int:
        """A new join of `replica` (any previous one must have ended). Returns its generation."""
        if replica < 0:
            raise ValueError(f"replica must be >= 0, got {replica}")
        current = self.replicas.get(replica)
        if current is not None and current.state not in TERMINAL_STATES:
            raise IllegalTransition(
                f"replica {replica} is {current.state.name}: a new join needs RELEASED or ROLLED_BACK"
            )
        self._generations[replica] += 1
        generation = self._generations[replica]
        self.replicas[replica] = HybridReplica(replica, generation, _S.REQUESTED, now)
        return generation

    def start_fetch(self, replica: int, generation: int, now: float) -> bool:
        """The replica's process is up: REQUESTED -> FETCHING_STATE."""
        return self._advance(replica, generation, _S.REQUESTED, now)

    def state_fetched(self, replica: int, generation: int, step: int, now: float) -> bool:
        """It holds the training state of `step` and is registered: FETCHING_STATE -> ZERO_SYNC
        (a membership change)."""
        if self._advance(replica, generation, _S.FETCHING_STATE, now):
            self.replicas[replica].fetched_step = step
            return True
        return False

    def begin_activation(self, replica: int, generation: int, now: float) -> bool:
        """At a step boundary: ZERO_SYNC -> ACTIVATING."""
        return self._advance(replica, generation, _S.ZERO_SYNC, now)

    def activated(self, replica: int, generation: int, first_step: int, now: float) -> bool:
        """Every rank passed the barrier; its gradients count from `first_step` on:
        ACTIVATING -> ACTIVE (a membership change)."""
        if self._advance(replica, generation, _S.ACTIVATING, now):
            self.replicas[replica].active_from_step = first_step
            return True
        return False

    # -- release and rollback --------------------------------------------------------------------

    def request_release(self, replica: int, generation: int, now: float) -> bool:
        """ACTIVE -> RELEASING (leaves the gradient domain: a membership change). A replica that
        has not become ACTIVE yet is cancelled instead (`cancel`)."""
        return self._advance(replica, generation, _S.ACTIVE, now)

    def released(self, replica: int, generation: int, now: float) -> bool:
        """Its process stopped and its devices are back with rollout: RELEASING -> RELEASED."""
        return self._advance(replica, generation, _S.RELEASING, now)

    def cancel(self, replica: int, generation: int, now: float, reason: str = "cancelled") -> bool:
        return self.roll_back(replica, generation, now, reason)

    def roll_back(self, replica: int, generation: int, now: float, reason: str) -> bool:
        """Cancellation, a timeout or a failed rank: any live state -> ROLLED_BACK."""
        r = self._current(replica, generation)
        if r is None:
            return False
        if r.state in TERMINAL_STATES:
            raise IllegalTransition(f"replica {replica} is {r.state.name}: it cannot be rolled back")
        if r.state in REGISTERED_STATES:
            self.epoch += 1
        r.state, r.entered_at, r.reason = _S.ROLLED_BACK, now, reason
        return True

    def expire(self, now: float) -> list[int]:
        """Rolls back every replica past its state's deadline; returns them."""
        expired = []
        for r in self.replicas.values():
            timeout = self.config.timeout_of(r.state)
            if timeout is not None and now - r.entered_at > timeout:
                self.roll_back(r.replica, r.generation, now, f"timeout in {r.state.name}")
                expired.append(r.replica)
        return expired

    # -- gradient payloads -----------------------------------------------------------------------

    def accept_payload(self, header: PayloadHeader, step: int, policy_version: int) -> bool:
        """Whether a gradient payload may be added in the receiver's `step` at `policy_version`:
        the sender must be ACTIVE (and active from this step on), and step, version and epoch must
        all match. A rejected payload is counted under the first reason that applies."""
        r = self.replicas.get(header.replica)
        if r is None or r.state is not _S.ACTIVE or step < (r.active_from_step or 0):
            reason = "not_active"
        elif header.epoch != self.epoch:
            reason = "epoch"
        elif header.step != step:
            reason = "step"
        elif header.policy_version != policy_version:
            reason = "version"
        else:
            return True
        self.dropped_payloads[reason] += 1
        return False

    def active_replicas(self) -> list[int]:
        return sorted(r.replica for r in self.replicas.values() if r.state is _S.ACTIVE)

    def state_of(self, replica: int) -> ReplicaState:
        if replica not in self.replicas:
            raise KeyError(f"replica {replica} never joined")
        return self.replicas[replica].state

    # -- internals -------------------------------------------------------------------------------

    def _current(self, replica: int, generation: int) -> HybridReplica | None:
        r = self.replicas.get(replica)
        if r is None:
            raise IllegalTransition(f"replica {replica} never joined")
        if generation != r.generation:
            self.ignored_events += 1
            return None
        return r

    def _advance(self, replica: int, generation: int, expected: ReplicaState, now: float) -> bool:
        r = self._current(replica, generation)
        if r is None:
            return False
        if r.state is not expected:
            raise IllegalTransition(
                f"replica {replica}: {r.state.name} -> {_FORWARD[expected].name} is not allowed "
                f"(needs {expected.name})"
            )
        r.state, r.entered_at = _FORWARD[expected], now
        if r.state in (_S.ZERO_SYNC, _S.ACTIVE, _S.RELEASING):
            self.epoch += 1
        return True


@dataclass(frozen=True)
class HybridJoin:
    """What the core answers to a join request: the join's generation (events of older
    generations are ignored) and the addresses of the lanes the replica connects to, one per TP
    rank of the core replica it pairs with (TP rank t of the replica connects to the t-th)."""

    generation: int
    lane_addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.lane_addresses:
            raise ValueError("HybridJoin needs the address of at least one lane")


@dataclass(frozen=True)
class HybridPoolLimits:
    """What the runtime's elastic hybrid pool can pair with the core: a plan that grows training
    beyond it restarts training instead of joining hybrid replicas (`libra.planner.diff`), and is
    priced as a restart. The planner is told it as `planner.hybrid_pool`; the defaults bound
    nothing: the design's k-replica pool (the simulator). The job sets what `libra.training.hybrid`
    supports (`HYBRID_POOL_LIMITS`): one hybrid per core replica, on a core of PP = 1 (any TP)."""

    per_core_replica: int | None = None
    """Most hybrid replicas per core replica (None: no bound)."""
    max_core_pipeline_parallel: int | None = None
    """Largest PP of a core replica that takes hybrid replicas (None: any)."""

    def __post_init__(self) -> None:
        for name in ("per_core_replica", "max_core_pipeline_parallel"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"planner.hybrid_pool.{name} must be >= 0 or None, got {value}")

    def allows(self, core_replicas: int, core_pipeline_parallel: int, hybrids: int) -> bool:
        """Whether `hybrids` replicas may join a core of `core_replicas` replicas of PP =
        `core_pipeline_parallel`."""
        if hybrids == 0:
            return True
        if (
            self.max_core_pipeline_parallel is not None
            and core_pipeline_parallel > self.max_core_pipeline_parallel
        ):
            return False
        return self.per_core_replica is None or hybrids <= self.per_core_replica * core_replicas
