"""The elastic hybrid pool at run time: a core train rank's lane to one hybrid replica
(`CoreLane`), the plan executor's handle on it (`LaneControl`), and the hybrid replica's side
(`HybridFollower`, `run_hybrid_replica`; its process: `libra.training.hybrid_worker`).

The core pool is its own torch.distributed world and is never rebuilt; each hybrid replica is a
separate process with its own world, connected to its paired core rank by one TCP channel
(`grad_channel`). Every core rank holds a lane, so a core of DP = D takes up to D hybrid replicas,
hybrid replica D + r pairing with core DP rank r. The protocol follows `libra.training.elastic`:

- REQUESTED: the hybrid process starts (on devices taken from rollout) and says hello.
- FETCHING_STATE: at the next step boundary the core snapshots its state (weights, staleness
  gate; the KL reference when on) and sends it; from that step on it streams every step's batch
  and, after each optimizer step, the stepped weights and the mini-batch's stats.
- ZERO_SYNC: once the hybrid has loaded the snapshot. It runs no forward/backward, contributes
  nothing, and replays each step: the same gate decisions, and the core's stepped weights copied
  in. That is exact lockstep; the core never waits for it (sends are queued on a sender thread).
- ACTIVATING: on request, at a step boundary the core sends `activate` and waits (bounded) for
  the hybrid to answer; the answer comes after the hybrid has replayed every earlier step.
- ACTIVE: at each step boundary the core ranks agree (one all-reduce over the DP group) which
  lanes have an ACTIVE replica; with k of them the global batch is split into D + k DP shares,
  core rank r taking share r and the active hybrids shares D.., in core rank order, exactly as a
  static DP = D + k job splits it. Old logprobs: the hybrid scores its rows, its core rank adds
  them to its own before the DP reduction and sends the reduced table back. Gradients: the hybrid
  sends its share's gradients (already divided by the global token count, as every DP rank's
  are); its core rank adds them into its DDP grad buffers before the DP reduction, the core steps
  its optimizer, and the stepped weights go back. Losses equal a static DP run.
  A hybrid replica holds no optimizer (no fp32 main copy, no Adam moments): it fits on rollout
  devices, and the core's optimizer state, sharded over the core's DP ranks by the distributed
  optimizer, is never touched when a replica joins, fails or leaves.
- Failure: a lost connection, a timeout or a dropped payload while a core rank waits for its
  hybrid's rows or gradients rolls the replica back, and that core rank computes the hybrid's
  share itself for the rest of the step (the fill-in rule: the share returns to the core, the step
  is neither lost nor shortened, and the other core ranks, whose shares were fixed at the
  boundary, notice nothing); from the next boundary on the batch has one share fewer.
- Release: ACTIVE -> RELEASING, the hybrid is told to stop, RELEASED when the channel closes.

A hybrid replica of TP = T is T processes (its own world, TP = T), hybrid TP rank t paired with
the core rank of TP rank t in core DP replica r; each pair has its own channel and exchanges its
own shards (state, gradients). The T lanes of one core replica move as one: at every boundary
they exchange their status (an all-gather over the core replica's TP group) and take the same
transitions, and each payload a lane waits for is agreed over that group, so a failure seen by
any of them rolls all of them back and the whole core replica fills the share in together.

Scope (`HYBRID_POOL_LIMITS`, what the planner is told): PP = 1 (a pipeline hybrid would pair
stage by stage, and a fill-in would need the core replica's whole pipeline; not implemented).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from libra.training.elastic import (
    TERMINAL_STATES,
    ElasticConfig,
    HybridJoin,
    HybridPool,
    HybridPoolLimits,
    PayloadHeader,
    ReplicaState,
)
from libra.training.grad_channel import (
    Channel,
    Listener,
    PeerLost,
    object_from_bytes,
    object_to_bytes,
    tensor_from_bytes,
    tensor_to_bytes,
)
from libra.trajectory import Trajectory

if TYPE_CHECKING:
    from libra.training.engine import StepResult


HYBRID_POOL_LIMITS = HybridPoolLimits(per_core_replica=1, max_core_pipeline_parallel=1)
"""What the lanes pair: one hybrid replica per core DP replica, with the core's TP, on a core of
PP = 1. A plan that grows training past it restarts training instead."""


def paired_core_rank(replica: int, core_dp: int) -> int | None:
    """The core DP rank whose lane hybrid replica `replica` joins (D + r pairs with r), or None
    when no core rank of a core of DP = `core_dp` takes it."""
    rank = replica - core_dp
    return rank if 0 <= rank < core_dp else None


_STATES = list(ReplicaState)
"""A state's number in the status the lanes of one replica exchange."""


# -- training state over the channel -----------------------------------------------------------


def export_state(engine) -> dict:
    """Everything a replica needs to continue in lockstep; copies, so the core may step on."""
    state = {
        "params": {name: p.detach().clone() for name, p in engine.model.named_parameters()},
        "gate": engine.gate.state_dict(),
    }
    if engine.ref_model is not None:
        state["reference"] = {n: p.detach().clone() for n, p in engine.ref_model.named_parameters()}
    return state


def load_state(engine, state: dict) -> None:
    with torch.no_grad():
        params = dict(engine.model.named_parameters())
        if set(params) != set(state["params"]):
            raise RuntimeError(f"state does not fit the model: {sorted(set(params) ^ set(state['params']))}")
        for name, tensor in state["params"].items():
            params[name].copy_(tensor)
        if engine.ref_model is not None:
            for name, p in engine.ref_model.named_parameters():
                p.copy_(state["reference"][name])
    engine.weights_changed()
    engine.gate.load_state_dict(state["gate"], release_in_flight=False)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One host tensor of them all (gathered tensor by tensor: no second copy on the device)."""
    return torch.cat([t.detach().reshape(-1).cpu() for t in tensors])


def _copy_flat(flat: torch.Tensor, into: Sequence[torch.Tensor], add: bool = False) -> None:
    """Copies (or adds) a `_flat` payload into tensors shaped as the sender's were."""
    if flat.numel() != sum(t.numel() for t in into):
        raise ValueError(f"payload of {flat.numel()} values for {sum(t.numel() for t in into)}")
    if into:
        flat = flat.to(into[0].device)  # one transfer, not one per tensor
    with torch.no_grad():
        for target, part in zip(into, flat.split([t.numel() for t in into]), strict=True):
            part = part.view_as(target).to(target.dtype)
            target.add_(part) if add else target.copy_(part)


# -- the core side -----------------------------------------------------------------------------


@dataclass
class LaneCounters:
    accepted_payloads: int = 0
    """Hybrid logprob tables and gradients added in."""
    filled_in_shares: int = 0
    """Hybrid payloads (a logprob table, a mini-batch's gradients) the core computed itself
    after a failure."""
    rollbacks: list[str] = field(default_factory=list)


class CoreLane:
    """The engine's `GradientPeer` on a core rank: drives one hybrid replica slot through the
    join/release protocol at step boundaries (`begin_step`) and adds its contributions."""

    def __init__(
        self,
        engine,
        config: ElasticConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: str = "127.0.0.1",
        *,
        token: str,
    ):
        """`host`: where the lane listens for its hybrid replica (the rank's routable address);
        `token`: the run's, which the replica must prove it holds (`grad_channel`)."""
        if not HYBRID_POOL_LIMITS.allows(engine.info.dp_size, engine.info.pp_size, 1):
            raise ValueError(
                f"the elastic hybrid pool runs with a core of PP=1 for now, got PP={engine.info.pp_size}"
            )
        self.engine = engine
        self.pool = HybridPool(config or ElasticConfig())
        self.clock = clock
        self.listener = Listener(token, host)
        self.counters = LaneCounters()
        self._replica: int | None = None
        self._generation = 0
        self._channel: Channel | None = None
        self._hello: Channel | None = None
        """The hybrid's connection once it said hello, until the replica's ranks agree to fetch."""
        self._loaded_step: int | None = None
        """The step the hybrid acknowledged loading the state of (FETCHING_STATE)."""
        self._activation_requested = False
        self._release_requested = False
        self._step = 0
        self._minibatch = 0
        self._last_meta: dict = {}
        self._core_share = (engine.info.dp_rank, engine.info.dp_size)
        self._hybrid_share: tuple[int, int] | None = None
        """The share of this step that belongs to the paired hybrid replica (None: no share)."""
        engine.peer = self

    @property
    def address(self) -> str:
        return self.listener.address

    def state(self) -> ReplicaState | None:
        return None if self._replica is None else self.pool.state_of(self._replica)

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def replica(self) -> int | None:
        """The replica slot's last join (None: none was requested)."""
        return self._replica

    # -- requests (from the controller) ----------------------------------------------------------

    def request_join(self, replica: int) -> int:
        rank, size = self.engine.info.dp_rank, self.engine.info.dp_size
        if paired_core_rank(replica, size) != rank:
            raise ValueError(
                f"core DP rank {rank} of {size} pairs with hybrid replica {size + rank}, not {replica}"
            )
        self._generation = self.pool.request_join(replica, self.clock())
        self._replica = replica
        self._activation_requested = self._release_requested = False
        self._loaded_step = None
        return self._generation

    def cancel_join(self, generation: int, reason: str) -> bool:
        """Rolls back the join of `generation` now (its worker could not start). False when that
        join is no longer the current one or has already ended."""
        if self._replica is None or generation != self._generation:
            return False
        if self.state() in (ReplicaState.RELEASED, ReplicaState.ROLLED_BACK):
            return False
        self._roll_back(reason)
        return True

    def request_activation(self) -> None:
        self._activation_requested = True

    def request_release(self) -> None:
        self._release_requested = True

    # -- the step boundary -----------------------------------------------------------------------

    def begin_step(self, step: int, batch: Sequence[Trajectory]) -> None:
        """Advances the replica's protocol between two train steps, agrees the step's DP shares
        with the other core ranks (every core rank calls this before every train step), then
        hands the batch of `step` to a registered replica. Never waits on the replica except at
        the activation barrier (bounded by `activation_timeout_s`)."""
        self._step, self._minibatch = step, 0
        self._boundary()
        active = self.state() is ReplicaState.ACTIVE
        self._agree_shares(active)
        if self._channel is not None:
            meta = {"step": step, "version": self.engine.version, "epoch": self.pool.epoch}
            meta["active"] = active
            meta["share"] = self._hybrid_share
            self._channel.send("step", meta, object_to_bytes(list(batch)))

    def _agree_shares(self, active: bool) -> None:
        """This step's shares: core rank r takes share r; the active hybrids take shares D..,
        in the order of their core ranks."""
        rank, size = self.engine.info.dp_rank, self.engine.info.dp_size
        actives = [int(active)]
        if size > 1:
            flags = torch.zeros(size, dtype=torch.int64, device=self.engine.device)
            flags[rank] = int(active)
            dist.all_reduce(flags, group=self.engine._dp_group)
            actives = flags.tolist()
        count = size + sum(actives)
        self._core_share = (rank, count)
        self._hybrid_share = (size + sum(actives[:rank]), count) if active else None

    # A hybrid replica of TP = T is T processes, each paired with the core rank of the same TP
    # rank. The T lanes of one replica move together: each boundary they exchange their local
    # status (one all-gather over the core replica's TP group, whatever their states) and take
    # the same transitions from it; a failure seen by one of them rolls all of them back.

    def _boundary(self) -> None:
        self._poll()
        if self._replica is not None and self.state() not in TERMINAL_STATES:
            self._roll_back_expired()
        view = self._gather(self._status())
        newest = max(row[0] for row in view)
        if newest == 0 or self._generation != newest:
            return  # no join yet, or this rank's request for the newest one has not arrived
        current = [row for row in view if row[0] == newest]
        states = {_STATES[row[1]] for row in current}
        state = self.state()
        if ReplicaState.ROLLED_BACK in states:
            if state is not ReplicaState.ROLLED_BACK:
                self._roll_back(f"another rank of hybrid replica {self._replica} rolled back")
            return
        if len(current) < len(view) or len(states) != 1 or state in TERMINAL_STATES:
            return  # a rank still waits for its request; or nothing left to do
        now = self.clock()
        hello, loaded, release, activate = (all(row[k] for row in current) for k in range(2, 6))
        if state is ReplicaState.REQUESTED and hello:
            self._attempt(self._send_state)
        elif state is ReplicaState.FETCHING_STATE and loaded:
            self.pool.state_fetched(self._replica, self._generation, self._loaded_step, now)
            state = ReplicaState.ZERO_SYNC
        if release:
            self._release(state, now)
        elif state is ReplicaState.ZERO_SYNC and activate:
            self._attempt(self._activate)
            active = self.state() is ReplicaState.ACTIVE
            if not self._replica_agrees(active) and active:
                self._roll_back(f"another rank of hybrid replica {self._replica} failed to activate")

    def _status(self) -> list[int]:
        """[generation, state, hello accepted, state loaded, release requested, activation
        requested] of this rank's lane."""
        state = self.state()
        return [
            self._generation,
            -1 if state is None else _STATES.index(state),
            int(self._hello is not None),
            int(self._loaded_step is not None),
            int(self._release_requested),
            int(self._activation_requested),
        ]

    def _poll(self) -> None:
        """This rank's progress without a transition: a hello accepted (REQUESTED), the state's
        load acknowledged (FETCHING_STATE). A broken peer rolls the replica back here."""
        state = self.state()
        if state is ReplicaState.REQUESTED and self._hello is None:
            self._attempt(self._accept_hello)
        elif state is ReplicaState.FETCHING_STATE and self._loaded_step is None:
            self._attempt(self._poll_loaded)

    def _accept_hello(self) -> None:
        channel = self.listener.poll()
        if channel is None:
            return
        hello = channel.recv(timeout_s=self.pool.config.request_timeout_s)
        if hello.kind != "hello" or hello.meta.get("generation") != self._generation:
            channel.close()  # a cancelled join's process: not ours
            self.pool.ignored_events += 1
            return
        self._hello = channel

    def _poll_loaded(self) -> None:
        frame = self._channel.poll()
        if frame is None:
            return
        if frame.kind != "state_loaded":
            raise PeerLost(f"expected state_loaded, got {frame.kind}")
        self._loaded_step = frame.meta["step"]

    def _send_state(self) -> None:
        self._channel, self._hello = self._hello, None
        self.pool.start_fetch(self._replica, self._generation, self.clock())
        # The state before this step; every later step streams after it, in order.
        self._channel.send("state", {"step": self._step}, object_to_bytes(export_state(self.engine)))

    def _activate(self) -> None:
        self.pool.begin_activation(self._replica, self._generation, self.clock())
        self._channel.send("activate", {"first_step": self._step})
        reply = self._channel.recv(timeout_s=self.pool.config.activation_timeout_s)
        if reply.kind != "activated":
            raise PeerLost(f"expected activated, got {reply.kind}")
        self.pool.activated(self._replica, self._generation, self._step, self.clock())

    def _attempt(self, action: Callable[[], None]) -> None:
        """Runs one exchange with the hybrid; a lost or late peer rolls the replica back."""
        try:
            action()
        except (PeerLost, TimeoutError) as e:
            self._roll_back(f"{type(e).__name__}: {e}")

    def _gather(self, row: list[int]) -> list[list[int]]:
        """`row` of every rank of this core replica (its TP group), in TP rank order."""
        if self.engine.info.tp_size == 1:
            return [row]
        mine = torch.tensor(row, dtype=torch.int64, device=self.engine.device)
        rows = [torch.zeros_like(mine) for _ in range(self.engine.info.tp_size)]
        dist.all_gather(rows, mine, group=self.engine._tp_group)
        return [r.tolist() for r in rows]

    def _replica_agrees(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank of this core replica."""
        return all(row[0] for row in self._gather([int(flag)]))

    def _release(self, state: ReplicaState, now: float) -> None:
        if state is ReplicaState.ACTIVE:
            self.pool.request_release(self._replica, self._generation, now)
            self._channel.send("release")
            self._channel.close()
            self._channel = None
            self.pool.released(self._replica, self._generation, self.clock())
        else:  # not active yet: a release is a cancellation
            self._roll_back("cancelled by release before ACTIVE")

    def _roll_back_expired(self) -> None:
        if self.pool.expire(self.clock()):
            self.counters.rollbacks.append(self.pool.replicas[self._replica].reason)
            self._close()

    def _roll_back(self, reason: str) -> None:
        self.pool.roll_back(self._replica, self._generation, self.clock(), reason)
        self.counters.rollbacks.append(reason)
        self._close()

    def _close(self) -> None:
        for channel in (self._channel, self._hello):
            if channel is not None:
                channel.close()
        self._channel = self._hello = None

    # -- GradientPeer ----------------------------------------------------------------------------

    def share(self) -> tuple[int, int]:
        return self._core_share

    def computes(self) -> bool:
        return True

    def defers_reduction(self) -> bool:
        return self._hybrid_share is not None  # a hybrid (or its fill-in) adds to this step

    def add_logprobs(self, out: torch.Tensor, fill_in) -> torch.Tensor:
        if self._hybrid_share is None:
            return out
        theirs = self._receive("logprobs")
        return out + (fill_in(self._hybrid_share) if theirs is None else theirs.view_as(out).to(out.device))

    def logprobs_reduced(self, out: torch.Tensor) -> torch.Tensor:
        if self._hybrid_share is not None and self._channel is not None:
            self._channel.send("logprobs_sum", {}, tensor_to_bytes(out))
        return out

    def step(self, engine, stats: torch.Tensor, fill_in) -> tuple[torch.Tensor, float]:
        if self._hybrid_share is not None:
            theirs = self._receive("grads")
            if theirs is None:
                stats = stats + fill_in(self._hybrid_share)
            else:
                # Added before the DP reduction, in the order a two-rank sum would add them.
                _copy_flat(theirs, engine.main_grads(), add=True)
                stats = stats + torch.tensor(
                    self._last_meta["stats"], dtype=torch.float64, device=stats.device
                )
        stats, grad_norm = engine.reduce_and_step(stats)
        if self._channel is not None:  # streaming since the snapshot (FETCHING_STATE on)
            meta = {
                "stats": stats.tolist(),
                "grad_norm": grad_norm,
                "step": self._step,
                "minibatch": self._minibatch,
            }
            self._channel.send("stepped", meta, tensor_to_bytes(_flat(engine.trainable_parameters())))
        self._minibatch += 1
        return stats, grad_norm

    def _receive(self, kind: str) -> torch.Tensor | None:
        """The hybrid's payload of `kind` for this step and mini-batch, or None when the replica
        failed (lost, timed out: rolled back now, or earlier in this step) and the core fills in.
        Stale payloads are dropped and counted, and the wait goes on until the deadline."""
        payload = self._receive_own(kind) if self._channel is not None else None
        if not self._replica_agrees(payload is not None):
            if self._channel is not None:
                self._roll_back(
                    f"{kind} of step {self._step}: another rank of hybrid replica {self._replica} failed"
                )
            self.counters.filled_in_shares += 1
            return None
        return payload

    def _receive_own(self, kind: str) -> torch.Tensor | None:
        """This rank's peer's payload (None: rolled back)."""
        deadline = self.clock() + self.pool.config.gradient_timeout_s
        try:
            while True:
                frame = self._channel.recv(timeout_s=max(deadline - self.clock(), 0.0))
                header = PayloadHeader(
                    replica=frame.meta.get("replica", -1),
                    step=frame.meta.get("step", -1),
                    policy_version=frame.meta.get("version", -1),
                    epoch=frame.meta.get("epoch", -1),
                )
                fresh = self.pool.accept_payload(header, self._step, self.engine.version)
                if fresh and frame.kind == kind and frame.meta.get("minibatch") == self._minibatch:
                    self.counters.accepted_payloads += 1
                    self._last_meta = frame.meta
                    return tensor_from_bytes(frame.body)
                if fresh:  # right step and epoch, wrong message: the protocol is broken
                    self.pool.dropped_payloads["step"] += 1
        except (PeerLost, TimeoutError) as e:
            self._roll_back(f"{kind} of step {self._step}: {type(e).__name__}: {e}")
            return None


# -- the hybrid side ---------------------------------------------------------------------------


class HybridFollower:
    """The engine's `GradientPeer` on a hybrid replica: replays the core in ZERO_SYNC, takes its
    share when ACTIVE."""

    def __init__(self, channel: Channel, replica: int, timeout_s: float = 600.0):
        self.channel, self.replica, self.timeout_s = channel, replica, timeout_s
        self.step_meta: dict = {}
        self._minibatch = 0

    def begin_step(self, meta: dict) -> None:
        self.step_meta, self._minibatch = meta, 0

    def _header(self, **extra) -> dict:
        m = self.step_meta
        return {
            "replica": self.replica,
            "step": m["step"],
            "version": m["version"],
            "epoch": m["epoch"],
            **extra,
        }

    def share(self) -> tuple[int, int]:
        return tuple(self.step_meta["share"]) if self.step_meta.get("active") else (0, 1)

    def computes(self) -> bool:
        return bool(self.step_meta.get("active"))

    def defers_reduction(self) -> bool:
        return True  # the core reduces this replica's gradients; it never does

    def add_logprobs(self, out: torch.Tensor, fill_in) -> torch.Tensor:
        self.channel.send("logprobs", self._header(minibatch=self._minibatch), tensor_to_bytes(out))
        return out

    def logprobs_reduced(self, out: torch.Tensor) -> torch.Tensor:
        return tensor_from_bytes(self._expect("logprobs_sum").body).view_as(out).to(out.device)

    def step(self, engine, stats: torch.Tensor, fill_in) -> tuple[torch.Tensor, float]:
        if self.computes():
            meta = self._header(minibatch=self._minibatch, stats=stats.tolist())
            self.channel.send("grads", meta, tensor_to_bytes(_flat(engine.main_grads())))
        stepped = self._expect("stepped")
        _copy_flat(tensor_from_bytes(stepped.body), engine.trainable_parameters())
        self._minibatch += 1
        return torch.tensor(stepped.meta["stats"], dtype=torch.float64), float(stepped.meta["grad_norm"])

    def _expect(self, kind: str):
        frame = self.channel.recv(timeout_s=self.timeout_s)
        if frame.kind != kind:
            raise RuntimeError(f"hybrid replica {self.replica} expected {kind}, got {frame.kind}")
        return frame


def run_hybrid_replica(engine, address: str, replica: int, generation: int, token: str, on_step=None) -> int:
    """The hybrid replica's loop: connect to its core rank's lane (each proving the run's
    `token`), fetch the state, replay or train each streamed step, activate on request, stop on
    release. `on_step(step, result)` sees every step. Returns the steps run."""
    channel = Channel.connect(address, token)
    channel.send("hello", {"replica": replica, "generation": generation})
    follower = HybridFollower(channel, replica)
    state = follower._expect("state")
    load_state(engine, object_from_bytes(state.body))
    channel.send("state_loaded", {"step": state.meta["step"]})
    engine.peer = follower
    num_steps = 0
    try:
        while True:
            frame = channel.recv(timeout_s=follower.timeout_s)
            if frame.kind == "step":
                follower.begin_step(frame.meta)
                result = engine.train_step(object_from_bytes(frame.body))
                num_steps += 1
                if on_step is not None:
                    on_step(frame.meta["step"], result)
            elif frame.kind == "activate":
                channel.send("activated", {"first_step": frame.meta["first_step"]})
            elif frame.kind == "release":
                return num_steps
            else:
                raise RuntimeError(f"hybrid replica {replica}: unexpected {frame.kind}")
    finally:
        engine.peer = None
        channel.close()


# -- the plan executor's handle on a lane ------------------------------------------------------


class LaneControl:
    """`HybridControl` (`libra.planner.controls`) over an in-process `CoreLane`, for a plan
    executor running in another thread of the same process.

    The executor's requests and the training loop's step boundaries are serialised by one lock:
    `run_step` holds it across `begin_step` and the train step, so a join or release lands between
    two steps, as the lane's protocol requires (a request waits at most one step). Where the core
    rank is its own process, the same three requests travel as RPCs to it instead."""

    def __init__(self, lane: CoreLane):
        self.lane = lane
        self._lock = threading.Lock()

    def run_step(self, step: int, batch: Sequence[Trajectory]) -> tuple[ReplicaState | None, StepResult]:
        """`begin_step` then the engine's train step, with no request in between. Returns the
        replica's state during the step (after the boundary) and the step's result."""
        with self._lock:
            self.lane.begin_step(step, batch)
            state = self.lane.state()
            return state, self.lane.engine.train_step(batch)

    def request_join(self, replica: int) -> HybridJoin:
        with self._lock:
            return HybridJoin(self.lane.request_join(replica), (self.lane.address,))

    def cancel_join(self, replica: int, generation: int, reason: str) -> None:
        with self._lock:
            self.lane.cancel_join(generation, reason)

    def request_release(self, replica: int) -> None:
        with self._lock:
            self.lane.request_release()
