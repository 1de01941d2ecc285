"""The exact two-level search: minimise max(T_train, T_rollout) over the split of the cluster.

The space searched (the brute-force test enumerates exactly this):
- Training: TP in `train_tp_sizes` dividing the node and the (KV) heads, PP in `train_pp_sizes`
  dividing the layers, DP with TP*PP*DP a multiple of the split granularity g, between
  `min_train_devices` and N - `min_rollout_devices`, each DP rank receiving whole GRPO groups
  -- the same number of them, or with `uneven_data_parallel` ceil(G/DP) or floor(G/DP) of them
  (the step priced on the largest share) -- the largest share splitting into whole
  micro-batches, and the memory model satisfied (on the largest share).
- Rollout: on the remaining devices, any multiset of instances of the TP sizes in
  `rollout_tp_sizes` (powers of two dividing the node) with total size at most the remaining
  devices (left-over devices idle), plus routing thresholds on output tokens: the history,
  sorted by output tokens, is cut at candidate boundaries into consecutive ranges, the j-th range
  going to the j-th TP size present in ascending order (C-MLFQ's buckets). Candidate
  boundaries are the cuts between distinct output lengths, thinned to `threshold_candidates`
  quantiles when there are more.
- A bucket of m TP-k instances serving requests S takes max(sum work_k(S) / m, max latency_k(S))
  (work spreads over its instances, the slowest request cannot be split); a request that does
  not fit a TP-k instance's KV capacity cannot go to TP-k. T_rollout is the slowest bucket.

The idea: both sides are monotone in time. Let A(T) be the fewest training devices of any
configuration with T_train <= T (a prefix minimum over configurations sorted by T_train), and
D(T) the fewest rollout devices achieving T_rollout <= T. For fixed T, D is a shortest path:
a dynamic programme over (TP size, prefix of the sorted requests) where giving range (a, b] to
TP-k costs k * ceil(work / T) devices if its slowest request's latency is <= T, else infinity --
O(K Q^2) for K TP sizes and Q candidate boundaries, independent of the cluster size. A plan
with objective <= T exists iff A(T) + D(T) <= N, a monotone predicate, so the optimum is found
by bisection: first over the sorted T_train values (training-bound optima are hit exactly), then,
inside the bracketing interval where A is constant, over T itself down to a relative
`relative_tolerance`. The returned objective is that of a concrete feasible plan, and no plan
of the space is better by more than the tolerance. Devices the rollout optimum leaves over are
then given to rollout instances (`_spend_leftover`).

Two tie-breaks follow the optimum T*: when the slowest trajectory's latency bounds rollout,
many splits reach T*, and the one kept minimises max(T_train, rollout *work*) with every
bucket's latency still <= T* (an asynchronous loop's step rate is set by work, not by one
trajectory); the rollout side then gets the pool with the least work makespan on the devices
training leaves it. And since how full decode batches get depends on how many devices share
the trajectories in flight (`RolloutCostModel.decoding_per_device`), which is what the search
decides, `search` iterates: memory-bound batches first, then the in-flight bound of the
previous plan's rollout size, until that size repeats; the plan returned is exact for the
space of its own rollout size.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from libra.planner.config import PlanningProblem
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.plan import BucketPlan, Plan, TrainingPlacement, place_rollout
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.training_cost import (
    SequenceStats,
    TrainingConfig,
    TrainingCostModel,
    batch_split_error,
)

DEFAULT_TRAIN_FACTORS = EfficiencyFactors(compute=0.45, memory=0.85, communication=0.7)
DEFAULT_ROLLOUT_FACTORS = EfficiencyFactors(compute=0.55, memory=0.85, communication=0.7)
THRESHOLD_CANDIDATES = 64


@dataclass(frozen=True)
class TrainingCandidate:
    config: TrainingConfig
    step_s: float


def enumerate_training(problem: PlanningProblem, cost: TrainingCostModel) -> list[TrainingCandidate]:
    """Every feasible training configuration of the space, sorted by predicted step time."""
    cluster, model, batch, search = problem.cluster, problem.model, problem.batch, problem.config.search
    g = search.granularity(cluster)
    max_devices = cluster.num_devices - search.min_rollout_devices
    seqs = SequenceStats.of(problem.history)
    groups = batch.global_batch // batch.group_size
    candidates = []
    for tp in search.train_tp_sizes:
        if cluster.devices_per_node % tp or model.num_attention_heads % tp or model.num_kv_heads % tp:
            continue
        for pp in search.train_pp_sizes:
            if model.num_layers % pp:
                continue
            for dp in range(1, groups + 1):  # every replica trains at least one whole group
                n = tp * pp * dp
                if n % g or n < search.min_train_devices or n > max_devices:
                    continue
                for mb in batch.micro_batch_sizes:
                    cfg = TrainingConfig(tp, pp, dp, mb)
                    if batch_split_error(batch, cfg, search.uneven_data_parallel):
                        continue
                    if cost.fits(cfg, seqs):
                        candidates.append(TrainingCandidate(cfg, cost.step_s(cfg, seqs)))
    return sorted(candidates, key=lambda c: (c.step_s, c.config.num_devices, c.config))


@dataclass(frozen=True)
class BucketChoice:
    tp: int
    first: int
    """Index of the first request (in the sorted history) of the bucket's range."""
    end: int
    num_instances: int


class RolloutSpace:
    """The rollout half of the space for one workload: per TP size, the prefix sums of work and
    the range maxima of latency between candidate boundaries."""

    def __init__(
        self,
        tp_sizes: list[int],
        output_tokens: np.ndarray,
        work: dict[int, np.ndarray],
        latency: dict[int, np.ndarray],
        max_boundaries: int = THRESHOLD_CANDIDATES,
    ):
        self.order = np.argsort(output_tokens, kind="stable")
        self.outputs = output_tokens[self.order]
        self.tp_sizes = [k for k in sorted(tp_sizes) if np.isfinite(latency[k]).any()]
        self.boundaries = candidate_boundaries(self.outputs, max_boundaries)
        self.work = {k: work[k][self.order] for k in self.tp_sizes}
        self.latency = {k: latency[k][self.order] for k in self.tp_sizes}
        q = len(self.boundaries)
        upper = np.triu(np.ones((q, q), dtype=bool), k=1)
        self._empty = np.eye(q, dtype=bool)
        self._range_work, self._range_latency = {}, {}
        for k in self.tp_sizes:
            prefix = np.concatenate([[0.0], np.cumsum(self.work[k])])[self.boundaries]
            self._range_work[k] = np.where(upper, prefix[None, :] - prefix[:, None], 0.0)
            lat = np.full((q, q), np.inf)
            segment_max = np.maximum.reduceat(self.latency[k], self.boundaries[:-1])
            for a in range(q - 1):  # range maximum = running maximum of the segment maxima
                lat[a, a + 1 :] = np.maximum.accumulate(segment_max[a:])
            lat[self._empty] = 0.0
            self._range_latency[k] = lat
        self._build_device_count_tables()
        self._device_counts: dict[tuple[float, float | None], float] = {}
        self.max_latency = float(
            np.max(
                np.min(
                    np.stack(
                        [self.latency[k] for k in self.tp_sizes] or [np.full(len(self.outputs), np.inf)]
                    ),
                    axis=0,
                )
            )
        )
        finite_work = [self.work[k][np.isfinite(self.latency[k])].sum() for k in self.tp_sizes]
        self.upper_bound = (max(finite_work) if finite_work else 0.0) + self.max_latency

    def min_devices(
        self, target_s: float, latency_cap_s: float | None = None
    ) -> tuple[float, list[np.ndarray]]:
        """D(T): the fewest devices whose rollout makespan is <= target_s, and the DP's choices.
        With `latency_cap_s`, the slowest request of a bucket may take up to that (>= target_s)
        instead: only the work must fit in target_s."""
        latency_limit = target_s if latency_cap_s is None else max(latency_cap_s, target_s)
        q = len(self.boundaries)
        best = np.full(q, np.inf)
        best[0] = 0.0
        choices = []
        for k in self.tp_sizes:
            work = self._range_work[k]
            with np.errstate(divide="ignore", invalid="ignore"):
                count = np.maximum(np.ceil(work / target_s), 1.0)
                count += work / count > target_s  # ceil's floating error must never exceed the target
            cost = np.where(self._range_latency[k] <= latency_limit, k * count, np.inf)
            cost[self._empty] = 0.0
            total = best[:, None] + cost
            choice = total.argmin(axis=0)
            best = total[choice, np.arange(q)]
            choices.append(choice)
        return float(best[-1]), choices

    def _build_device_count_tables(self) -> None:
        """`min_device_count`'s layout: per TP size, the (first, end) ranges with first < end
        (the DP's only finite choices besides skipping the size) flattened column by column, so
        that the best way to reach each end is one `minimum.reduceat` over its column."""
        q = len(self.boundaries)
        firsts, ends = np.triu_indices(q, k=1)
        by_column = np.lexsort((firsts, ends))
        self._flat_first = firsts[by_column]
        self._column_starts = np.searchsorted(ends[by_column], np.arange(1, q))
        self._flat_work = {k: self._range_work[k][firsts, ends][by_column] for k in self.tp_sizes}
        self._flat_latency = {k: self._range_latency[k][firsts, ends][by_column] for k in self.tp_sizes}

    def min_device_count(self, target_s: float, latency_cap_s: float | None = None) -> float:
        """`min_devices(...)[0]` -- the same floating-point operations on the same values, over
        the upper triangle only and without the choices -- remembered per (target, cap): the
        bisections of one search probe the same targets again (the exact round repeats the
        coarse round's probes over the training steps)."""
        key = (target_s, latency_cap_s)
        found = self._device_counts.get(key)
        if found is not None:
            return found
        latency_limit = target_s if latency_cap_s is None else max(latency_cap_s, target_s)
        q = len(self.boundaries)
        best = np.full(q, np.inf)
        best[0] = 0.0
        for k in self.tp_sizes:
            work = self._flat_work[k]
            count = np.maximum(np.ceil(work / target_s), 1.0)
            count += work / count > target_s
            cost = np.where(self._flat_latency[k] <= latency_limit, k * count, np.inf)
            reached = np.minimum.reduceat(best[self._flat_first] + cost, self._column_starts)
            best[1:] = np.minimum(best[1:], reached)  # skipping TP-k keeps each end's cost
        self._device_counts[key] = float(best[-1])
        return self._device_counts[key]

    def buckets_at(self, target_s: float, latency_cap_s: float | None = None) -> list[BucketChoice]:
        """The bucket ranges and instance counts of D(target_s)'s solution."""
        _, choices = self.min_devices(target_s, latency_cap_s)
        result, end = [], len(self.boundaries) - 1
        for k, choice in zip(reversed(self.tp_sizes), reversed(choices), strict=True):
            start = int(choice[end])
            if start != end:
                work = self._range_work[k][start, end]
                count = max(math.ceil(work / target_s), 1)
                count += int(work / count > target_s)
                result.append(BucketChoice(k, int(self.boundaries[start]), int(self.boundaries[end]), count))
            end = start
        return sorted(result, key=lambda b: b.tp)

    def bucket_makespan(self, tp: int, first: int, end: int, num_instances: int) -> float:
        if first == end:
            return 0.0
        if num_instances < 1:
            return math.inf
        return max(
            float(self.work[tp][first:end].sum()) / num_instances, float(self.latency[tp][first:end].max())
        )

    def min_makespan(
        self,
        num_devices: int,
        tolerance: float,
        low: float = 0.0,
        latency_cap_s: float | None = None,
        high: float | None = None,
    ) -> float:
        """The least T with D(T) <= num_devices (inf if none), by bisection above `low`; `high`,
        when given, is known to satisfy it."""
        if high is None:
            high = self.upper_bound
            if not math.isfinite(high) or self.min_device_count(high, latency_cap_s) > num_devices:
                return math.inf
        low = max(low, 0.0)
        while high - low > tolerance * high:
            mid = 0.5 * (low + high)
            if self.min_device_count(mid, latency_cap_s) <= num_devices:
                high = mid
            else:
                low = mid
        return high


def candidate_boundaries(sorted_outputs: np.ndarray, max_boundaries: int) -> np.ndarray:
    """Indices (0 and len included) where the sorted history may be cut: only between distinct
    output lengths (a threshold cannot split equal lengths), thinned to quantiles if too many."""
    r = len(sorted_outputs)
    cuts = [i for i in range(1, r) if sorted_outputs[i] != sorted_outputs[i - 1]]
    if len(cuts) > max_boundaries - 2:
        picks = np.linspace(0, len(cuts) - 1, max_boundaries - 2).round().astype(int)
        cuts = sorted({cuts[i] for i in picks})
    return np.array([0, *cuts, r], dtype=int)


def build_rollout_space(
    problem: PlanningProblem, factors: EfficiencyFactors, rollout_devices: int | None = None
) -> RolloutSpace:
    """The rollout space; with `rollout_devices`, batches are bounded by the trajectories in
    flight spread over that many devices (`RolloutCostModel.decoding_per_device`), else only by
    memory and max_decode_batch."""
    cost = RolloutCostModel(problem.cluster, problem.model, problem.config, factors)
    sizes = [
        k
        for k in problem.config.search.rollout_tp_sizes
        if problem.cluster.devices_per_node % k == 0 and problem.model.serves_at_tp(k)
    ]
    # Per step: a training step consumes global_batch trajectories, so the history's work is
    # scaled to that many; with bounded staleness a trajectory may span max_staleness +
    # tail_staleness + 1 steps, while launches keep global_batch x (max_staleness + 1) in flight.
    work_scale = problem.batch.global_batch / len(problem.history)
    latency_window = problem.batch.max_staleness + problem.batch.tail_staleness + 1
    work, latency = {}, {}
    in_flight = problem.batch.global_batch * (problem.batch.max_staleness + 1)
    for k in sizes:
        decoding = (
            None
            if rollout_devices is None
            else cost.decoding_per_device(k, problem.history, in_flight, rollout_devices)
        )
        request_work, request_latency = cost.request_costs(k, problem.history, decoding)
        work[k], latency[k] = request_work * work_scale, request_latency / latency_window
    outputs = np.array([r.output_tokens for r in problem.history], dtype=float)
    return RolloutSpace(sizes, outputs, work, latency, problem.config.search.threshold_candidates)


class NoFeasiblePlan(RuntimeError):
    """No plan of the space satisfies the constraints (the message says which side failed)."""


def search(
    problem: PlanningProblem,
    train_factors: EfficiencyFactors = DEFAULT_TRAIN_FACTORS,
    rollout_factors: EfficiencyFactors = DEFAULT_ROLLOUT_FACTORS,
    rollout_devices: int | None = None,
) -> Plan:
    """The optimal plan for `problem` (see the module docstring for the space and the method).

    How full rollout batches get depends on how many devices share the trajectories in flight,
    which is what the search decides; so the search runs to a fixed point: first with batches
    bounded by memory only, then again with the in-flight bound of the previous plan's rollout
    devices, until the rollout side stops changing (at most `MAX_CONCURRENCY_ROUNDS`; a plan is
    exact for the space of the rollout size it was searched with). `rollout_devices` fixes that
    size instead (one exact search, as the brute-force test checks)."""
    started = time.perf_counter()
    train_cost = TrainingCostModel(
        problem.cluster, problem.model, problem.batch, problem.config, train_factors
    )
    candidates = enumerate_training(problem, train_cost)
    if not candidates:
        raise NoFeasiblePlan(
            "no training configuration fits (memory, batch divisibility, granularity or minimum sizes)"
        )
    # One space per rollout size, built once: the exact round at a size reuses the coarse
    # round's space there, and with it the device counts its bisections already computed.
    spaces: dict[int | None, RolloutSpace] = {}
    if rollout_devices is not None:
        plan = _search_space(problem, candidates, rollout_factors, rollout_devices, spaces=spaces)
        return dataclasses.replace(plan, search_time_s=time.perf_counter() - started)
    # Rounds until the rollout size repeats are coarse (they only choose the size); the plan
    # returned is an exact search at the size it then has, i.e. exact for its own space.
    plan = _search_space(problem, candidates, rollout_factors, None, TIE_BREAK_TOLERANCE, spaces)
    devices = plan.num_devices - plan.training.config.num_devices
    tried: set[int] = set()
    for _ in range(MAX_CONCURRENCY_ROUNDS):
        tried.add(devices)
        plan = _search_space(problem, candidates, rollout_factors, devices, TIE_BREAK_TOLERANCE, spaces)
        devices = plan.num_devices - plan.training.config.num_devices
        if devices in tried:
            break
    exact: dict[int, Plan] = {}
    while devices not in exact and len(exact) < MAX_CONCURRENCY_ROUNDS:
        exact[devices] = _search_space(problem, candidates, rollout_factors, devices, spaces=spaces)
        devices = exact[devices].num_devices - exact[devices].training.config.num_devices
    consistent = [p for d, p in exact.items() if p.num_devices - p.training.config.num_devices == d]
    plan = min(
        consistent or exact.values(), key=lambda p: (p.predicted_step_s, p.training.config.num_devices)
    )
    return dataclasses.replace(plan, search_time_s=time.perf_counter() - started)


def search_within(
    problem: PlanningProblem,
    train_factors: EfficiencyFactors = DEFAULT_TRAIN_FACTORS,
    rollout_factors: EfficiencyFactors = DEFAULT_ROLLOUT_FACTORS,
    **narrowed: object,
) -> Plan:
    """`search` with the problem's search space narrowed by `narrowed` (fields of
    `problem.config.search`, e.g. `rollout_tp_sizes=(4,)`). Raises NoFeasiblePlan likewise."""
    space = dataclasses.replace(problem.config.search, **narrowed)
    return search(
        dataclasses.replace(problem, config=dataclasses.replace(problem.config, search=space)),
        train_factors,
        rollout_factors,
    )


MAX_CONCURRENCY_ROUNDS = 4
TIE_BREAK_TOLERANCE = 1e-3


def _search_space(
    problem: PlanningProblem,
    candidates: list[TrainingCandidate],
    rollout_factors: EfficiencyFactors,
    rollout_devices: int | None,
    tolerance: float | None = None,
    spaces: dict[int | None, RolloutSpace] | None = None,
) -> Plan:
    """The exact optimum over the space whose rollout batches assume `rollout_devices` (to the
    config's relative tolerance unless `tolerance` is given); `spaces` keeps built spaces by
    rollout size for the next call."""
    started = time.perf_counter()
    n_total = problem.cluster.num_devices
    tolerance = problem.config.search.relative_tolerance if tolerance is None else tolerance
    spaces = {} if spaces is None else spaces
    if rollout_devices not in spaces:
        spaces[rollout_devices] = build_rollout_space(problem, rollout_factors, rollout_devices)
    space = spaces[rollout_devices]
    if not space.tp_sizes:
        raise NoFeasiblePlan("the model does not fit any rollout TP size's memory")

    best = _optimum(space, candidates, n_total, tolerance)
    if not math.isfinite(best):
        raise NoFeasiblePlan("no split lets rollout serve every request (KV capacity or minimum devices)")
    # Among the plans reaching `best` (many, when the slowest trajectory's latency is what bounds
    # rollout), the one whose work -- training's and rollout's -- fits the least time: in an
    # asynchronous loop that work, not the one slowest trajectory, sets how fast steps come.
    work_bound = _optimum(space, candidates, n_total, TIE_BREAK_TOLERANCE, latency_cap_s=best)
    needed = space.min_device_count(work_bound, best)
    training = min(
        (c for c in candidates if c.step_s <= work_bound and c.config.num_devices <= n_total - needed),
        key=lambda c: (c.step_s, c.config.num_devices, c.config),
    )
    # The rollout side then gets the most throughput the devices left to it allow (when training
    # bounds the step, many rollout pools tie at `best`; the fastest leaves the most slack).
    # A tie-break, not the objective: a coarse bisection between a lower bound (every request on
    # its cheapest allowed TP size, the work spread perfectly) and work_bound (known to fit) will do.
    rest = n_total - training.config.num_devices
    device_seconds = np.min(
        np.stack([np.where(space.latency[k] <= best, k * space.work[k], np.inf) for k in space.tp_sizes]),
        axis=0,
    )
    high = work_bound
    if best < high and space.min_device_count(best, best) <= rest:
        high = best  # rollout bounds the step: its optimum, not a point within the tie-break of it
    rollout_s = space.min_makespan(
        rest, TIE_BREAK_TOLERANCE, low=float(device_seconds.sum()) / rest, latency_cap_s=best, high=high
    )
    buckets = space.buckets_at(rollout_s, best)
    buckets = _spend_leftover(space, buckets, n_total - training.config.num_devices)
    return _assemble(problem, space, training, buckets, time.perf_counter() - started)


def _optimum(
    space: RolloutSpace,
    candidates: list[TrainingCandidate],
    n_total: int,
    tolerance: float,
    latency_cap_s: float | None = None,
) -> float:
    """The least T with A(T) + D(T) <= n_total (see the module docstring); with `latency_cap_s`,
    D lets each bucket's slowest request take up to that cap (`RolloutSpace.min_devices`)."""
    steps = [c.step_s for c in candidates]
    fewest = list(np.minimum.accumulate([c.config.num_devices for c in candidates]))

    def feasible(target_s: float) -> bool:
        i = bisect.bisect_right(steps, target_s) - 1
        return i >= 0 and space.min_device_count(target_s, latency_cap_s) <= n_total - fewest[i]

    # Bisection over the T_train values: the first feasible one brackets the optimum.
    lo_i, hi_i = -1, len(steps)
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        if feasible(steps[mid]):
            hi_i = mid
        else:
            lo_i = mid
    best = steps[hi_i] if hi_i < len(steps) else math.inf
    if lo_i >= 0:  # between steps[lo_i] and best the training side is fixed: a rollout-only problem
        rollout_only = space.min_makespan(n_total - fewest[lo_i], tolerance, steps[lo_i], latency_cap_s)
        best = min(best, max(rollout_only, steps[lo_i]))
    return best


def _spend_leftover(space: RolloutSpace, buckets: list[BucketChoice], budget: int) -> list[BucketChoice]:
    """Gives the devices the optimum leaves over to rollout, one instance at a time: first to the
    slowest bucket while that still shortens the predicted makespan; then, when the makespan is
    bound by its slowest request's latency, to the bucket with the most work per instance. The
    min-max objective cannot see that second gain, but an asynchronous run turns rollout
    capacity into throughput (more trajectories in flight against the staleness bound), so an
    idle device is never better than one more instance."""
    buckets = list(buckets)
    left = budget - sum(b.tp * b.num_instances for b in buckets)
    while buckets:
        spans = [space.bucket_makespan(b.tp, b.first, b.end, b.num_instances) for b in buckets]
        i = int(np.argmax(spans))
        b = buckets[i]
        grown = space.bucket_makespan(b.tp, b.first, b.end, b.num_instances + 1)
        if b.tp > left or grown >= spans[i]:
            break
        buckets[i] = BucketChoice(b.tp, b.first, b.end, b.num_instances + 1)
        left -= b.tp
    while True:
        fitting = [i for i, b in enumerate(buckets) if b.first < b.end and b.tp <= left]
        if not fitting:
            return buckets
        i = max(fitting, key=lambda i: _work_per_instance(space, buckets[i]))
        b = buckets[i]
        buckets[i] = BucketChoice(b.tp, b.first, b.end, b.num_instances + 1)
        left -= b.tp


def _work_per_instance(space: RolloutSpace, bucket: BucketChoice) -> float:
    return float(space.work[bucket.tp][bucket.first : bucket.end].sum()) / bucket.num_instances


def _assemble(
    problem: PlanningProblem,
    space: RolloutSpace,
    training: TrainingCandidate,
    buckets: list[BucketChoice],
    search_time_s: float,
) -> Plan:
    cluster = problem.cluster
    n_train = training.config.num_devices
    sizes = [b.tp for b in buckets for _ in range(b.num_instances)]
    instances = place_rollout(n_train, cluster.num_devices, cluster.devices_per_node, sizes)
    bucket_plans = tuple(
        BucketPlan(
            tp=b.tp,
            num_instances=b.num_instances,
            max_output_tokens=int(space.outputs[b.end - 1]),
            num_requests=b.end - b.first,
            predicted_makespan_s=space.bucket_makespan(b.tp, b.first, b.end, b.num_instances),
        )
        for b in buckets
    )
    return Plan(
        num_devices=cluster.num_devices,
        training=TrainingPlacement(training.config),
        instances=instances,
        buckets=bucket_plans,
        predicted_train_s=training.step_s,
        predicted_rollout_s=max((b.predicted_makespan_s for b in bucket_plans), default=0.0),
        search_time_s=search_time_s,
    )
