"""The discrete-event core: a clock, an event heap, simulated rollout instances, and a real
`Router` (C-MLFQ or a baseline) deciding where every turn runs.

Events are (time, sequence number, callback): the sequence number makes ties deterministic (first
scheduled, first run), so a run is a pure function of its config and seed. The RL loop
(`libra.sim.loop`) schedules its own events (training steps, weight publication, plan changes)
on the same heap and is told, through `on_finish`, when a trajectory completes.

A trajectory's life: `start` -> router.admit -> a (chunked) prefill and decode on the chosen
instance -> at the end of each turn either the end (router.on_finish) or a tool call; when the tool returns
(after its traced latency) router.on_tool_return says where the next turn runs. An ended turn's
KV stays in its instance's prefix cache only until other sequences need the room
(`libra.sim.instance`). On the same instance only the tool result is prefilled if the prefix is
still cached when the turn is admitted, the whole context otherwise; elsewhere the whole context
is re-prefilled, or its KV moved, per `MovementCosts.migration` -- moved only while the old
instance still caches it (looked up when the tool returns: the transfer starts then). Each
instance reports its KV in use to the router whenever it changes (the job's engines report theirs
once a second, from their stats).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field, replace

from libra.planner.rollout_cost import RolloutCostModel
from libra.scheduler.config import BucketConfig, CmlfqConfig
from libra.scheduler.interface import Decision, FairQueueLength, Router, reprice
from libra.scheduler.tool_state import ToolReturnState
from libra.sim.instance import Instance, Sequence, StepCoefficients
from libra.trace import TrajectoryTrace


@dataclass(eq=False)
class LiveTrajectory:
    key: int
    trace: TrajectoryTrace
    started_at: float
    turn: int = 0
    generated: int = 0
    """Output tokens of completed turns."""
    context: float = 0.0
    instance: int | None = None
    """Where its next (or current) turn runs, as the router decided."""
    cached_on: int | None = None
    """The instance holding its prefix in cache (where its last turn ran)."""
    carried: float = 0.0
    """Tokens of the current turn generated before it was cut (kept; the turn resumes)."""
    versions: list[int] = field(default_factory=list)
    """Policy version of each turn."""
    finished_at: float | None = None
    aborted: bool = False
    tag: int = 0
    """The loop's own mark (e.g. the round it was launched in)."""

    @property
    def trajectory_id(self) -> str:
        return self.trace.trajectory_id

    @property
    def oldest_version(self) -> int | None:
        return min(self.versions) if self.versions else None


class RolloutCluster:
    def __init__(
        self,
        router: Router,
        cmlfq_config: CmlfqConfig,
        cost: RolloutCostModel,
        max_batch: int,
        migration: str = "reprefill",
        kv_move_bandwidth_bytes_per_s: float = 0.0,
        token_budget: int | Callable[[int], int] = 2048,
        trajectories_in_flight: int = 0,
    ):
        self.router = router
        self._queue_length = (
            FairQueueLength(router, trajectories_in_flight, cmlfq_config.max_queue_length)
            if trajectories_in_flight
            else None
        )
        """The router's cap, derived again from the pool's weight whenever an instance joins
        (loading) or leaves (`FairQueueLength`); None: `cmlfq_config`'s is kept (the cap of
        `cmlfq_config` is the launch value either way: the router holds the current one)."""
        self.cmlfq_config = cmlfq_config
        self.cost = cost
        self.max_batch = max_batch
        self.token_budget = token_budget
        """Tokens per engine step of an instance (vLLM's max_num_batched_tokens): one for all,
        or a function of the instance's TP size."""
        self.migration = migration
        self.kv_move_bandwidth_bytes_per_s = kv_move_bandwidth_bytes_per_s
        self.now = 0.0
        self._heap: list = []
        self._counter = 0
        self.instances: dict[int, Instance] = {}
        self.retired: list[Instance] = []
        self.live: dict[int, LiveTrajectory] = {}
        self._by_id: dict[str, int] = {}
        self.unplaced: set[int] = set()
        self._turn_due: set[int] = set()
        """Unplaced trajectories with a turn to run as soon as they are placed: one cut mid-decode
        (it resumes), or one admitted or back from a tool while no instance was ready. (The
        others unplaced are in a tool call: their tool return places them.)"""
        self._next_key = 0
        self._next_instance = 0
        self.version = 0
        """The policy version rollout instances serve (turns take it when they start)."""
        self.on_finish: Callable[[LiveTrajectory], None] = lambda traj: None
        self._coefficients: dict[int, StepCoefficients] = {}
        self._weights: dict[int, int] = {}
        self.num_migrations = 0
        self.num_turns = 0
        self.migration_s = 0.0
        self._evicted_move_tokens = 0.0
        """Context tokens re-prefilled under `kv_move` because the old instance had evicted them."""
        self._kv_reported: dict[int, int] = {}
        """Instance id -> the KV tokens last reported to the router."""

    # The clock.

    def schedule(self, time: float, callback: Callable, *args) -> None:
        heapq.heappush(self._heap, (time, self._counter, callback, args))
        self._counter += 1

    def run_until(self, done: Callable[[], bool]) -> None:
        """Processes events in time order until `done()` or nothing is left."""
        heap = self._heap
        while heap and not done():
            time, _, callback, args = heapq.heappop(heap)
            self.now = time
            callback(*args)

    # Instances.

    def coefficients(self, tp: int) -> StepCoefficients:
        if tp not in self._coefficients:
            self._coefficients[tp] = StepCoefficients.of(self.cost, tp)
        return self._coefficients[tp]

    def weight(self, tp: int) -> int:
        """A TP-tp instance's router weight (`RolloutCostModel.router_weight`), once per size:
        the derived cap sums the pool's at every change of it."""
        if tp not in self._weights:
            self._weights[tp] = self.cost.router_weight(tp)
        return self._weights[tp]

    def add_instance(
        self, name: str, tp: int, bucket: int, devices: tuple[int, ...], ready_at: float
    ) -> Instance:
        inst = Instance(
            self._next_instance,
            name,
            tp,
            bucket,
            devices,
            self.coefficients(tp),
            self.max_batch,
            self.token_budget(tp) if callable(self.token_budget) else self.token_budget,
            ready_at=ready_at,
            clock=self.now,
        )
        self._next_instance += 1
        self.instances[inst.instance_id] = inst
        ready = ready_at <= self.now
        self.router.add_instance(inst.instance_id, bucket, ready=ready, weight=self.weight(tp))
        self._fit_queue_length()
        if ready:
            self.reroute_unplaced()  # those an earlier removal left waiting
        else:
            self.schedule(ready_at, self._instance_ready, inst)
        return inst

    def _instance_ready(self, inst: Instance) -> None:
        if inst.retired:
            return
        # Every instance ready by now takes its share of the waiting trajectories, not the first
        # one whose event happens to run first.
        ready = [i for i in self.instances.values() if i.ready_at <= self.now]
        for each in ready:
            self.router.set_instance_ready(each.instance_id, True)
        self._fit_queue_length()
        self.reroute_unplaced()
        for each in ready:
            self._reschedule(each)

    def remove_instance(self, instance_id: int) -> None:
        """Stops an instance now: its in-flight turns are cut (they keep their tokens) and every
        trajectory placed there is rerouted."""
        inst = self.instances.pop(instance_id)
        self._kv_reported.pop(instance_id, None)
        inst.advance(self.now)
        inst.retired = True
        inst.epoch += 1
        self.retired.append(inst)
        for seq in inst.take_all():
            traj = self.live[seq.key]
            turn_output = traj.trace.turns[traj.turn].output_tokens
            traj.carried = max(0.0, turn_output - max(seq.left, 0.0))
            traj.context = seq.context if seq.context > traj.context else traj.context
            traj.cached_on = None
            self._turn_due.add(seq.key)
        for trajectory_id in self.router.remove_instance(instance_id):
            key = self._by_id[trajectory_id]
            self.live[key].instance = None
            self.unplaced.add(key)
        self._fit_queue_length()
        self.reroute_unplaced()

    def _fit_queue_length(self) -> None:
        """The derived cap for the pool a plan runs: the instances that serve and those still
        loading, as the job's pool counts the instances its plan is starting
        (`InstancePool.expect`). Counting only those that serve, a re-plan that replaced most of
        the pool piled every trajectory onto the few left -- 470 queued on each of 2 TP-4
        instances while 8 new TP-8 ones loaded, and still there minutes after they served."""
        if self._queue_length is not None:
            self._queue_length.follow(sum(self.weight(i.tp) for i in self.instances.values()))

    def update_buckets(self, buckets: SequenceOf[BucketConfig], instance_buckets: Mapping[int, int]) -> int:
        """A re-plan changed the buckets (`Router.update_buckets`). The router decides every live
        trajectory again; one it moves leaves its old instance now -- a turn in flight is cut,
        keeping its tokens, and resumes on the new instance (re-prefill) -- and one in a tool
        call runs its next turn there. Returns how many moved."""
        for instance_id, bucket in instance_buckets.items():
            self.instances[instance_id].bucket = bucket
        moved = self.router.update_buckets(buckets, instance_buckets)
        self.cmlfq_config = replace(self.cmlfq_config, buckets=tuple(buckets))
        for decision in moved:
            traj = self.live[self._by_id[decision.trajectory_id]]
            old = self.instances.get(traj.instance) if traj.instance is not None else None
            was_running = old is not None and self._cut_from(old, traj)
            traj.instance = decision.instance_id
            if was_running:
                self._run_turn(traj)
        return len(moved)

    def reprice(self, price: Callable[[tuple[BucketConfig, ...]], tuple[BucketConfig, ...]]) -> None:
        """The buckets' speeds as `price` gives them now, set as the job sets them after each
        step (`CmlfqRouter.set_bucket_speeds`): nobody is decided again. Nothing for a router
        without speeds."""
        self.cmlfq_config = reprice(self.router, self.cmlfq_config, price)

    def _cut_from(self, inst: Instance, traj: LiveTrajectory) -> bool:
        """Takes `traj`'s turn off `inst` (decoding or queued); False if it was not there."""
        inst.advance(self.now)
        seq = inst.remove(traj.key)
        if seq is None:
            return False
        turn_output = traj.trace.turns[traj.turn].output_tokens
        traj.carried = max(0.0, turn_output - max(seq.left, 0.0))
        traj.context = max(traj.context, seq.context)
        traj.cached_on = None
        inst.admit_waiting()
        self._reschedule(inst)
        return True

    def publish(self, version: int) -> None:
        """Instances serve `version` from now on: turns that start take it, and every prefix cache
        is emptied (the job's engines reset theirs on a weight update)."""
        self.version = version
        for inst in self.instances.values():
            inst.advance(self.now)
            inst.drop_prefix_cache()
            self._reschedule(inst)

    def reroute_unplaced(self) -> None:
        for key in sorted(self.unplaced):
            traj = self.live[key]
            decision = self.router.reroute(traj.trajectory_id)
            if decision.instance_id is None:
                continue
            self.unplaced.discard(key)
            traj.instance = decision.instance_id
            if key in self._turn_due:
                self._turn_due.discard(key)
                self._run_turn(traj)

    def _reschedule(self, inst: Instance) -> None:
        inst.epoch += 1
        at = inst.next_completion()
        if at is not None:
            self.schedule(at, self._on_instance_tick, inst, inst.epoch)
        self._report_kv(inst)

    def _report_kv(self, inst: Instance) -> None:
        """Tells the router the KV the instance holds or reserves plus what its queue waits to be
        admitted with (`Router.set_instance_kv`); every admission, end of turn and enqueue passes
        through `_reschedule`. The evictable prefix cache is not counted: it gives way."""
        used = round(inst.kv_tokens + inst.queued_kv)
        if self._kv_reported.get(inst.instance_id) != used:
            self._kv_reported[inst.instance_id] = used
            self.router.set_instance_kv(inst.instance_id, used, inst.coefficients.token_capacity)

    # Trajectories.

    def start(self, trace: TrajectoryTrace, tag: int = 0) -> LiveTrajectory:
        key = self._next_key
        self._next_key += 1
        traj = LiveTrajectory(key, trace, self.now, context=float(trace.prompt_tokens), tag=tag)
        self.live[key] = traj
        self._by_id[trace.trajectory_id] = key
        self._follow(traj, self.router.admit(trace.trajectory_id, trace.prompt_id))
        return traj

    def abort(self, traj: LiveTrajectory) -> None:
        """Cancels a live trajectory (tail batching's over-provisioned ones)."""
        if traj.key not in self.live:
            return
        if traj.instance is not None and traj.instance in self.instances:
            inst = self.instances[traj.instance]
            inst.advance(self.now)
            inst.remove(traj.key)
            inst.admit_waiting()
            self._reschedule(inst)
        traj.aborted = True
        self.router.on_abort(traj.trajectory_id)
        self._forget(traj)

    def _forget(self, traj: LiveTrajectory) -> None:
        del self.live[traj.key]
        del self._by_id[traj.trajectory_id]
        self.unplaced.discard(traj.key)
        self._turn_due.discard(traj.key)
        # Its room goes to those waiting for it while instances load, as the job's pool wakes
        # them (`InstancePool.room_freed`); otherwise nobody waits for room.
        if self.unplaced and any(i.ready_at > self.now for i in self.instances.values()):
            self.reroute_unplaced()

    def _follow(self, traj: LiveTrajectory, decision: Decision) -> None:
        traj.instance = decision.instance_id
        if decision.instance_id is None:
            self.unplaced.add(traj.key)
            self._turn_due.add(traj.key)
            return
        self._run_turn(traj)

    def _run_turn(self, traj: LiveTrajectory) -> None:
        inst = self.instances[traj.instance]
        turn = traj.trace.turns[traj.turn]
        payload = float(traj.trace.turns[traj.turn - 1].payload_tokens) if traj.turn else 0.0
        cached = move_s = 0.0
        if traj.turn == 0 and traj.carried == 0 and traj.cached_on is None:
            new_tokens = float(traj.trace.prompt_tokens)
        elif traj.cached_on == inst.instance_id:
            # The instance looks the prefix up when it admits the turn, and prefills it again if
            # it was evicted by then.
            new_tokens, cached = payload, traj.context - payload
        else:
            self.num_migrations += 1
            new_tokens = traj.context
            if self._moves_kv(traj, inst):
                # A KV transfer runs over the links, not in the engine's steps: the turn joins
                # the instance's queue when its KV has arrived.
                new_tokens, move_s = payload, self._kv_move_s(traj, inst)
            elif self.migration == "kv_move" and traj.cached_on in self.instances:  # evicted there
                self._evicted_move_tokens += traj.context - payload
        if len(traj.versions) == traj.turn:  # a cut turn resumes under the version it began with
            traj.versions.append(self.version)
        inst.advance(self.now)
        left = turn.output_tokens - traj.carried
        inst.enqueue(
            Sequence(traj.key, traj.context, left, new_tokens, not_before=self.now + move_s, cached=cached)
        )
        self._reschedule(inst)

    def _moves_kv(self, traj: LiveTrajectory, inst: Instance) -> bool:
        """Whether `traj`'s KV reaches `inst` by a transfer: only under `kv_move`, and only from
        a live instance that still caches it (a stopped instance's cache is gone, and an entry
        may have been evicted: re-prefill)."""
        if self.migration != "kv_move" or traj.cached_on in (None, inst.instance_id):
            return False
        source = self.instances.get(traj.cached_on)
        if source is None:
            return False
        source.advance(self.now)  # its evictions up to now
        return source.holds_prefix(traj.key)

    def _kv_move_s(self, traj: LiveTrajectory, inst: Instance) -> float:
        """The context's KV from its holder to `inst`: the full KV (every KV head once; a TP
        group splits or replicates heads, but the bytes leaving the source are one copy) over
        min(source TP, target TP) device links in parallel -- NVLink/HCCS inside a node, the
        NICs across nodes -- or the configured bandwidth per link."""
        m = self.cost.model
        source = self.instances[traj.cached_on]
        # The context already counts the tool return, which is prefilled on `inst`, not moved.
        payload = float(traj.trace.turns[traj.turn - 1].payload_tokens) if traj.turn else 0.0
        held = max(traj.context - payload, 0.0)
        kv_bytes = held * 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.bytes_per_param
        links = min(source.tp, inst.tp)
        bandwidth = self.kv_move_bandwidth_bytes_per_s
        if bandwidth <= 0:
            profile, dpn = self.cost.cluster.profile, self.cost.cluster.devices_per_node
            same_node = source.devices[0] // dpn == inst.devices[0] // dpn
            bandwidth = (
                profile.intra_node_bandwidth_bytes_per_s
                if same_node
                else profile.inter_node_bandwidth_bytes_per_s
            )
        seconds = kv_bytes / (links * bandwidth)
        self.migration_s += seconds
        return seconds

    def _on_instance_tick(self, inst: Instance, epoch: int) -> None:
        if epoch != inst.epoch or inst.retired:
            return
        inst.advance(self.now)
        finished = inst.pop_finished()
        inst.admit_waiting()
        self._reschedule(inst)
        for seq in finished:
            traj = self.live.get(seq.key)
            if traj is not None:  # not aborted by an earlier completion's consequences
                self._end_turn(traj, seq, inst)

    def _end_turn(self, traj: LiveTrajectory, seq: Sequence, inst: Instance) -> None:
        turn = traj.trace.turns[traj.turn]
        self.num_turns += 1
        traj.generated += turn.output_tokens
        traj.context = float(traj.trace.prompt_tokens + traj.generated) + sum(
            t.payload_tokens for t in traj.trace.turns[: traj.turn]
        )
        traj.carried = 0.0
        traj.cached_on = inst.instance_id
        if traj.turn == len(traj.trace.turns) - 1:
            traj.finished_at = self.now
            self.router.on_finish(traj.trajectory_id, traj.generated)
            self._forget(traj)
            self.on_finish(traj)
            return
        self.schedule(self.now + turn.tool_latency_s, self._tool_returned, traj)

    def _tool_returned(self, traj: LiveTrajectory) -> None:
        if traj.key not in self.live:  # aborted while the tool ran
            return
        turn = traj.trace.turns[traj.turn]
        held = traj.context  # what its instance holds; the return is prefilled wherever it goes
        traj.context += turn.payload_tokens
        traj.turn += 1
        state = ToolReturnState.of(turn.tool, turn.status, turn.payload_tokens, self.cmlfq_config)
        if traj.instance is None:  # displaced while the tool ran; the router places it again
            self.unplaced.discard(traj.key)
        decision = self.router.on_tool_return(traj.trajectory_id, state, traj.generated, round(held))
        self._follow(traj, decision)

    # Accounting.

    def all_instances(self) -> list[Instance]:
        return list(self.instances.values()) + self.retired

    @property
    def prefix_evictions(self) -> int:
        """Prefix-cache entries evicted, on every instance (a finished trajectory's costs nothing)."""
        return sum(i.evictions for i in self.all_instances())

    @property
    def evicted_prefill_tokens(self) -> float:
        """Tokens prefilled again because a prefix was evicted: by the instance a turn was queued
        on before it was admitted, or, under `kv_move`, by the one it would have moved from."""
        return self._evicted_move_tokens + sum(i.evicted_prefill_tokens for i in self.all_instances())

    def settle(self) -> None:
        """Advances every instance to now (before reading busy times)."""
        for inst in self.instances.values():
            inst.advance(self.now)
