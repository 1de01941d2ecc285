"""A simulated rollout instance: continuous batching with chunked prefill, priced by the planner's
rollout cost model.

Every engine step is one forward pass over a token budget (vLLM's `max_num_batched_tokens`),
spent as vLLM v1's scheduler spends it: first one token for each sequence that is decoding, then
the rest on prefill chunks of the sequences still prefilling, first come first served. A long
prefill therefore no longer stalls the batch: the decodes keep advancing one token a step while
the prefill takes the budget they leave over, and the step gets slower by what its chunk costs.
A step with B decoding sequences holding K KV tokens and prefill chunks (o_i, n_i) -- n_i tokens
of a sequence that already holds o_i tokens of KV -- takes

    step_s = a + b * B + c * K + max(W, g * (B + sum_i n_i))  +  sum_i [F(o_i + n_i) - F(o_i)]

where all but the last sum is the planner's decode step (`RolloutCostModel.decode_terms`, read
once per TP size): floors, per-sequence all-reduce bytes, the KV read, and the matmuls, which read
the weights (W) while they multiply every token of the pass (g each) and take the longer of the
two. F(p) is the rest of the planner's prefill time of p tokens (`RolloutCostModel.prefill_seconds`
less its matmuls: causal attention quadratic in p, and the all-reduces of the activations). The
difference F(o + n) - F(o) is what prefilling tokens o..o+n adds to a forward pass (the pass's
latency floor is paid once, in a): chunks of one prefill add up exactly to the unchunked
prefill's work, and a tool result prefilled after a cached prefix pays attention over that
prefix. A step of a few decodes is bound by its weight read, and a few hundred prefill tokens
riding in it cost no more matmul time; a step with a large chunk is bound by its compute.

There are no per-token events. While the step's composition holds, steps are uniform and are
taken in closed form: a prefilling sequence that alone fills the leftover budget for k steps
costs k (a + b B + max(W, g (B + P))) + c (k K + B k (k - 1) / 2) + F(o + k P) - F(o)
(P = budget - B; the decodes' KV grows by B a step), up to when its prefill is done or the first
decode finishes its turn.
A step that mixes the end of one prefill with the start of the next is taken on its own.
Decoding alone is taken as a fluid (tokens = elapsed / step_s at the interval's start; context
growth inside an interval is ignored, a few percent at most between events). An event that
lands inside a step takes the elapsed fraction of that step's tokens (fluid), so a run is a pure
function of its events.

A sequence waits in the instance's queue while its context does not fit the free KV capacity or
the batch (decoding and prefilling sequences, vLLM's `max_num_seqs`) is full; one whose KV is
being moved in from another instance (`not_before`) joins the queue when the transfer is done.
Admission reserves a sequence's context, not what its decode will add: a batch that grows past
the capacity is not preempted.

The KV capacity is shared with a prefix cache, as under vLLM's automatic prefix caching. A turn
that ends (at a tool call, or the trajectory's last) frees its KV, but it stays cached, keyed by
trajectory, in least-recently-used order: it counts against the capacity yet is evictable, and a
sequence admitted, or a decode that grows, evicts the oldest entries it needs room for -- never
more (all of them when the KV held alone overflows, as an empty instance admitting an oversized
head does). Were cached KV not counted, every
trajectory waiting in a tool would hold its prefix for free, overstating what an instance holds on
agentic workloads. A turn that counts on its previous turn's KV (`Sequence.cached`) looks it up when it
is admitted, as vLLM's scheduler does when it takes a request off the queue: it may have been
evicted while the turn waited there, and is then prefilled again (`evicted_prefill_tokens`). Only
the entry a trajectory's last turn left is a hit; an older one, left on an instance the
trajectory has since moved away from, is dropped when it comes back and prefills its whole
context (vLLM would find their common prefix). A turn taken off the instance (cut to resume
elsewhere, or aborted) frees its KV uncached, and a stopped instance's cache is gone. New weights
empty the cache (`drop_prefix_cache`), as the job's engines reset theirs when they load a version:
KV computed by the old weights is no prefix of the new policy's.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from libra.planner.rollout_cost import DecodeTerms, RolloutCostModel

DONE_EPS = 1e-6
"""Tokens below which a turn's decode or a prefill counts as finished (float rounding)."""


@dataclass(frozen=True)
class StepCoefficients:
    """The cost of one engine step of a TP-tp instance: `decode.step_s(B, K, n)` for its B
    decodes holding K KV tokens and the n prefill tokens riding along, plus
    prefill_s(o + n) - prefill_s(o) for each prefill chunk, where
    prefill_s(p) = prefill_linear_s * p + prefill_quadratic_s * p^2 (+ a constant that cancels)
    is what prefilling adds besides the matmuls (their compute is in the step's roofline term)."""

    tp: int
    decode: DecodeTerms
    prefill_linear_s: float
    prefill_quadratic_s: float
    token_capacity: int

    @staticmethod
    def of(cost: RolloutCostModel, tp: int) -> StepCoefficients:
        decode = cost.decode_terms(tp)
        linear, quadratic = cost.prefill_coefficients(tp)
        return StepCoefficients(
            tp, decode, linear - decode.gemm_per_token_s, quadratic, cost.token_capacity(tp)
        )

    def step_s(self, batch: int, kv_tokens: float, prefill_tokens: float = 0.0) -> float:
        """A step of `batch` decodes and `prefill_tokens` prefill tokens, without what the
        prefill chunks add besides their matmuls (`chunk_s`)."""
        return self.decode.step_s(batch, kv_tokens, prefill_tokens)

    def chunk_s(self, offset: float, tokens: float) -> float:
        """What prefilling `tokens` more tokens of a sequence holding `offset` adds to a step
        besides the matmuls."""
        end = offset + tokens
        return self.prefill_linear_s * tokens + self.prefill_quadratic_s * (end * end - offset * offset)


@dataclass(eq=False)
class Sequence:
    """A trajectory's current turn as the instance sees it."""

    key: int
    """The engine's trajectory index."""
    context: float
    """KV tokens it holds once prefilled (prompt, earlier turns, tool results, tokens generated)."""
    left: float
    """Tokens still to generate in this turn."""
    prefill_left: float = 0.0
    """Tokens of its context still to prefill (the last ones of `context`)."""
    not_before: float = 0.0
    """Its KV is being moved in until then; it joins the queue at this time."""
    cached: float = 0.0
    """Tokens of its context before `prefill_left` expected in the instance's prefix cache (what
    its previous turn left there); prefilled too if they are gone when it is admitted."""

    @property
    def prefill_offset(self) -> float:
        """KV tokens it already holds on this instance (the next chunk attends to them)."""
        return self.context - self.prefill_left


@dataclass(eq=False)
class Instance:
    instance_id: int
    name: str
    tp: int
    bucket: int
    devices: tuple[int, ...]
    coefficients: StepCoefficients
    max_batch: int
    """Sequences decoding or prefilling at once (vLLM's max_num_seqs)."""
    token_budget: int
    """Tokens one step processes (vLLM's max_num_batched_tokens); must be >= max_batch, as vLLM
    requires, so that a step always has room for a prefill chunk."""
    ready_at: float = 0.0
    """When it finished loading weights and can run steps."""
    active: list[Sequence] = field(default_factory=list)
    """Sequences decoding (their prefill is done), in the order they started decoding."""
    prefilling: list[Sequence] = field(default_factory=list)
    """Admitted sequences whose prefill is not done, first come first served."""
    waiting: deque[Sequence] = field(default_factory=deque)
    """Not admitted yet: the batch is full or their KV does not fit."""
    arriving: list[Sequence] = field(default_factory=list)
    """KV moving in from another instance; joins `waiting` at `not_before`."""
    clock: float = 0.0
    """Time up to which the steps have been run."""
    busy_s: float = 0.0
    """Seconds spent running steps (device-seconds: multiply by tp)."""
    decoded_tokens: float = 0.0
    prefilled_tokens: float = 0.0
    num_steps: float = 0.0
    """Engine steps run (fractional where an event cut a step)."""
    epoch: int = 0
    """Bumped whenever the next completion changes; stale completion events are ignored."""
    kv_tokens: float = 0.0
    """KV tokens held or reserved by the decoding and prefilling sequences."""
    decode_kv: float = 0.0
    """KV tokens of the decoding sequences (what a decode step reads)."""
    queued_kv: float = 0.0
    """Contexts of the waiting and arriving sequences: KV demand not admitted yet."""
    prefix_cache: OrderedDict[int, float] = field(default_factory=OrderedDict)
    """Trajectory key -> KV tokens its ended turn left cached (freed, evictable), least recently
    used first."""
    cached_tokens: float = 0.0
    """The sum of `prefix_cache`: with `kv_tokens`, what counts against the capacity."""
    evictions: int = 0
    """Prefix-cache entries evicted to make room."""
    evicted_prefill_tokens: float = 0.0
    """Tokens prefilled again because the cached prefix a turn counted on was gone: evicted, or
    dropped with the cache by new weights."""
    retired: bool = False

    def __post_init__(self) -> None:
        if self.token_budget < self.max_batch:
            raise ValueError(
                f"instance {self.name}: token_budget ({self.token_budget}) must be >= max_batch "
                f"({self.max_batch}), or a full batch leaves no room to prefill"
            )

    # Running steps.

    def advance(self, now: float) -> None:
        """Runs steps from `clock` to `now`."""
        t = max(self.clock, self.ready_at)
        self.clock = max(self.clock, now)
        while t < now:
            self._arrive(t)
            until = min(now, self._next_arrival())
            if self.prefilling:
                t = self._prefill_steps(t, until, apply=True)
            elif self.active:
                t = self._decode(t, until)
            else:
                t = until
        self._arrive(now)

    def next_completion(self) -> float | None:
        """The next time the engine must look at this instance: a decode finishing its turn, or
        a change of the steps' composition (a prefill done, a KV transfer arrived). None: idle."""
        t = max(self.clock, self.ready_at)
        candidates = [self._next_arrival()]
        if self.prefilling:
            candidates.append(self._prefill_steps(t, math.inf, apply=False))
        elif self.active:
            fewest = max(0.0, min(s.left for s in self.active))
            candidates.append(t + fewest * self.coefficients.step_s(len(self.active), self.decode_kv))
        at = min(candidates)
        return None if math.isinf(at) else at

    def _decode(self, t: float, until: float) -> float:
        """Decode-only steps, as a fluid, from t to until."""
        dt = until - t
        tokens = dt / self.coefficients.step_s(len(self.active), self.decode_kv)
        self._decode_tokens(tokens)
        self.num_steps += tokens
        self.busy_s += dt
        return until

    def _decode_tokens(self, tokens: float) -> None:
        """Every decoding sequence gains `tokens` (none beyond the end of its turn)."""
        active = self.active
        if tokens < min(s.left for s in active):
            for seq in active:
                seq.left -= tokens
                seq.context += tokens
            gained = tokens * len(active)
        else:
            gained = 0.0
            for seq in active:
                g = min(tokens, max(seq.left, 0.0))
                seq.left -= g
                seq.context += g
                gained += g
        self.kv_tokens += gained
        self.decode_kv += gained
        self.decoded_tokens += gained
        self._evict()

    def _prefill_steps(self, t: float, until: float, apply: bool) -> float:
        """Runs (apply) or prices (not apply) the steps from t while the composition holds: the
        head prefill taking the whole leftover budget for k steps, or one mixed step. Stops at
        `until` (a fraction of the step in progress is run) and returns where it stopped."""
        c = self.coefficients
        decoding = self.active
        num_decoding = len(decoding)
        kv = self.decode_kv
        budget = self.token_budget - num_decoding
        head = self.prefilling[0]
        if head.prefill_left >= budget:
            # Uniform steps: the head alone gets `budget` prefill tokens a step.
            limit = math.floor(head.prefill_left / budget + 1e-9)
            if decoding:
                limit = min(limit, max(1, math.ceil(min(s.left for s in decoding) - DONE_EPS)))
            offset = head.prefill_offset

            def elapsed(k: float) -> float:
                return (
                    k * c.step_s(num_decoding, 0.0, budget)
                    + c.decode.per_kv_token_s * (k * kv + num_decoding * k * (k - 1) / 2)
                    + c.chunk_s(offset, k * budget)
                )

            if t + elapsed(limit) <= until:
                steps = float(limit)
            else:
                whole = _largest_fitting(elapsed, limit, until - t)
                last = elapsed(whole + 1) - elapsed(whole)
                steps = whole + (until - t - elapsed(whole)) / last
            end = t + elapsed(steps) if steps == limit else until
            if apply:
                self._take_steps([(head, steps * budget)], steps, end - t)
            return end
        # One mixed step: the end of the head's prefill, then the next ones first come first served.
        chunks, room = [], float(budget)
        for seq in self.prefilling:
            if room <= DONE_EPS:
                break
            n = min(room, seq.prefill_left)
            chunks.append((seq, n))
            room -= n
        cost = c.step_s(num_decoding, kv, sum(n for _, n in chunks)) + sum(
            c.chunk_s(s.prefill_offset, n) for s, n in chunks
        )
        fraction = min(1.0, (until - t) / cost)
        end = t + cost if fraction >= 1.0 else until
        if apply:
            self._take_steps([(s, n * fraction) for s, n in chunks], fraction, end - t)
        return end

    def _take_steps(self, chunks: list[tuple[Sequence, float]], steps: float, seconds: float) -> None:
        if self.active:
            self._decode_tokens(steps)
        for seq, tokens in chunks:
            tokens = min(tokens, seq.prefill_left)
            seq.prefill_left -= tokens
            self.prefilled_tokens += tokens
            if seq.prefill_left <= DONE_EPS:
                self.prefilled_tokens += seq.prefill_left
                seq.prefill_left = 0.0
                self.prefilling.remove(seq)
                self.active.append(seq)
                self.decode_kv += seq.context
        self.num_steps += steps
        self.busy_s += seconds

    # Arrivals and admission.

    def _next_arrival(self) -> float:
        return min((s.not_before for s in self.arriving), default=math.inf)

    def _arrive(self, t: float) -> None:
        if not any(s.not_before <= t for s in self.arriving):
            return
        arrived = [s for s in self.arriving if s.not_before <= t]
        self.arriving = [s for s in self.arriving if s.not_before > t]
        self.waiting.extend(arrived)
        self.admit_waiting()

    def enqueue(self, seq: Sequence) -> None:
        """Queues a turn: its context's last `prefill_left` tokens are prefilled, in chunks,
        before it decodes (call `advance(now)` first)."""
        self.queued_kv += seq.context
        if seq.not_before > max(self.clock, self.ready_at):
            self.arriving.append(seq)
            return
        self.waiting.append(seq)
        self.admit_waiting()

    def admit_waiting(self) -> None:
        """Moves queued sequences into the batch while KV capacity and batch size allow (FIFO;
        an empty instance takes the head even if it overflows, or nothing would ever run it).
        The prefix cache gives way: an admitted sequence evicts what it needs room for. A
        sequence with nothing to prefill decodes at once."""
        cap = self.coefficients.token_capacity
        while self.waiting and len(self.active) + len(self.prefilling) < self.max_batch:
            head = self.waiting[0]
            # Every cache entry can be evicted (the head's own becomes part of its context).
            if (self.active or self.prefilling) and self.kv_tokens + head.context > cap:
                break
            self.waiting.popleft()
            self._unqueue(head)
            self._take_prefix(head)
            if head.prefill_left > DONE_EPS:
                self.prefilling.append(head)
            else:
                self.active.append(head)
                self.decode_kv += head.context
            self.kv_tokens += head.context
            self._evict()

    # The prefix cache.

    def holds_prefix(self, key: int) -> bool:
        """Whether the KV trajectory `key`'s last turn left here is still cached."""
        return key in self.prefix_cache

    def _take_prefix(self, seq: Sequence) -> None:
        """An admitted sequence's cache entry becomes part of its KV. One that counted on an entry
        evicted since prefills it again; one that did not drops an outdated entry."""
        held = self.prefix_cache.pop(seq.key, None)
        if held is not None:
            self.cached_tokens = self.cached_tokens - held if self.prefix_cache else 0.0
        elif seq.cached > 0:
            seq.prefill_left += seq.cached
            self.evicted_prefill_tokens += seq.cached
        seq.cached = 0.0

    def _evict(self) -> None:
        """Evicts least recently used entries until the KV held and cached fits the capacity
        (all of them when the held KV alone overflows it)."""
        cap = self.coefficients.token_capacity
        while self.prefix_cache and self.kv_tokens + self.cached_tokens > cap + DONE_EPS:
            _, tokens = self.prefix_cache.popitem(last=False)
            self.cached_tokens = self.cached_tokens - tokens if self.prefix_cache else 0.0
            self.evictions += 1

    # Leaving.

    def pop_finished(self) -> list[Sequence]:
        """Sequences whose turn is done. The engine ends the request (at a tool call, or the
        trajectory's end): its KV is freed into the prefix cache, the most recently used entry."""
        done = [s for s in self.active if s.left <= DONE_EPS]
        if done:
            self.active = [s for s in self.active if s.left > DONE_EPS]
            self._recount_kv()
            for seq in done:
                self.prefix_cache[seq.key] = seq.context
                self.cached_tokens += seq.context
            # What overflowed the capacity (an empty instance's oversized admission, a batch
            # grown past it) cannot stay cached.
            self._evict()
        return done

    def remove(self, key: int) -> Sequence | None:
        """Takes one trajectory's turn off the instance, wherever it is (call `advance(now)` first)."""
        for queue in (self.active, self.prefilling):
            for seq in queue:
                if seq.key == key:
                    queue.remove(seq)
                    self._recount_kv()
                    return seq
        for queue in (self.waiting, self.arriving):
            for seq in queue:
                if seq.key == key:
                    queue.remove(seq)
                    self._unqueue(seq)
                    return seq
        return None

    def _unqueue(self, seq: Sequence) -> None:
        """`seq` left the waiting or arriving queue."""
        # Exactly 0 once both are empty, so float residue cannot build up over a run.
        self.queued_kv = self.queued_kv - seq.context if self.waiting or self.arriving else 0.0

    def drop_prefix_cache(self) -> None:
        """New weights: every cached prefix is stale (call `advance(now)` first); the room it held
        may admit queued sequences."""
        self.prefix_cache.clear()
        self.cached_tokens = 0.0
        self.admit_waiting()

    def take_all(self) -> list[Sequence]:
        """Removes every sequence (the instance is stopped: in-flight turns are cut, the cache is gone)."""
        seqs = [*self.active, *self.prefilling, *self.waiting, *self.arriving]
        self.active, self.prefilling, self.waiting, self.arriving = [], [], deque(), []
        self.kv_tokens = self.decode_kv = self.queued_kv = 0.0
        self.prefix_cache.clear()
        self.cached_tokens = 0.0
        return seqs

    def _recount_kv(self) -> None:
        self.decode_kv = sum(s.context for s in self.active)
        self.kv_tokens = self.decode_kv + sum(s.context for s in self.prefilling)

    @property
    def load(self) -> int:
        return len(self.active) + len(self.prefilling) + len(self.waiting) + len(self.arriving)


def _largest_fitting(elapsed, limit: int, seconds: float) -> int:
    """The most whole steps k < limit with elapsed(k) <= seconds (elapsed grows with k)."""
    lo, hi = 0, limit  # elapsed(lo) <= seconds < elapsed(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if elapsed(mid) <= seconds:
            lo = mid
        else:
            hi = mid
    return lo
