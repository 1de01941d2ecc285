"""A simulated rollout instance: continuous batching over the planner's rollout cost model.

There are no per-token events. An instance holds the sequences decoding on it; while its batch
does not change, every sequence gains one token per decode step, and a step takes

    step_s(B, K) = a + b * B + c * K        (B sequences, K KV tokens in the batch)

-- the planner's `RolloutCostModel.decode_step` is exactly linear in B and K, so a, b, c are read
off it once per TP size (`DecodeCoefficients`). The engine asks for the time of the next turn
completion (fewest tokens left x step time), jumps there, and advances every sequence by the
elapsed steps. Context growth inside an interval is ignored (the step time is that of the
interval's start), which is exact up to the few percent a growing KV read adds between events.

Prefills (a turn's new tokens, or the whole context after a migration) stall the instance's
decoding for their duration, as an unchunked vLLM prefill does. A sequence waits in the
instance's queue while its context does not fit the free KV capacity or the batch is full.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from libra.planner.cost_model import EfficiencyFactors
from libra.planner.rollout_cost import RolloutCostModel


@dataclass(frozen=True)
class DecodeCoefficients:
    """step_s = base_s + per_sequence_s * B + per_kv_token_s * K for a TP-tp instance."""

    tp: int
    base_s: float
    per_sequence_s: float
    per_kv_token_s: float
    token_capacity: int

    @staticmethod
    def of(cost: RolloutCostModel, tp: int) -> DecodeCoefficients:
        base, per_sequence, per_kv_token = cost.decode_coefficients(tp)
        return DecodeCoefficients(tp, base, per_sequence, per_kv_token, cost.token_capacity(tp))

    def step_s(self, batch: int, kv_tokens: float) -> float:
        return self.base_s + self.per_sequence_s * batch + self.per_kv_token_s * kv_tokens


def prefill_s(cost: RolloutCostModel, factors: EfficiencyFactors, tp: int, tokens: float) -> float:
    return cost.prefill(tp, tokens).seconds(factors) if tokens > 0 else 0.0


@dataclass(eq=False)
class Sequence:
    """A trajectory's current turn as the instance sees it."""

    key: int
    """The engine's trajectory index."""
    context: float
    """KV tokens held (prompt, earlier turns, tool results, tokens generated so far)."""
    left: float
    """Tokens still to generate in this turn."""
    prefill_tokens: float


@dataclass(eq=False)
class Instance:
    instance_id: int
    name: str
    tp: int
    bucket: int
    devices: tuple[int, ...]
    coefficients: DecodeCoefficients
    max_batch: int
    ready_at: float = 0.0
    """When it finished loading weights and can decode."""
    active: list[Sequence] = field(default_factory=list)
    waiting: deque[Sequence] = field(default_factory=deque)
    clock: float = 0.0
    """Time up to which the batch has been advanced."""
    prefill_debt_s: float = 0.0
    """Prefill still to run before decoding resumes."""
    busy_s: float = 0.0
    """Seconds spent prefilling or decoding (device-seconds: multiply by tp)."""
    decoded_tokens: float = 0.0
    epoch: int = 0
    """Bumped whenever the next completion changes; stale completion events are ignored."""
    kv_tokens: float = 0.0
    retired: bool = False

    def advance(self, now: float) -> None:
        """Runs prefills, then decode steps, from `clock` to `now`."""
        dt = now - max(self.clock, self.ready_at)
        self.clock = max(self.clock, now)
        if dt <= 0:
            return
        if self.prefill_debt_s > 0:
            used = min(dt, self.prefill_debt_s)
            self.prefill_debt_s -= used
            self.busy_s += used
            dt -= used
        if dt <= 0 or not self.active:
            return
        tokens = dt / self.coefficients.step_s(len(self.active), self.kv_tokens)
        for seq in self.active:
            seq.left -= tokens
            seq.context += tokens
        self.kv_tokens += tokens * len(self.active)
        self.decoded_tokens += tokens * len(self.active)
        self.busy_s += dt

    def next_completion(self) -> float | None:
        """When the first active sequence will finish its turn (None: nothing is decoding)."""
        if not self.active:
            return None
        start = max(self.clock, self.ready_at) + self.prefill_debt_s
        fewest = min(seq.left for seq in self.active)
        return start + max(fewest, 0.0) * self.coefficients.step_s(len(self.active), self.kv_tokens)

    def enqueue(self, seq: Sequence, prefill_cost_s: float) -> None:
        seq.prefill_tokens = prefill_cost_s  # reused as the cost in seconds until admitted
        self.waiting.append(seq)
        self.admit_waiting()

    def admit_waiting(self) -> None:
        """Moves queued sequences into the batch while KV capacity and batch size allow (FIFO;
        an empty instance takes the head even if it overflows, or nothing would ever run it)."""
        cap = self.coefficients.token_capacity
        while self.waiting and len(self.active) < self.max_batch:
            head = self.waiting[0]
            if self.active and self.kv_tokens + head.context > cap:
                break
            self.waiting.popleft()
            self.prefill_debt_s += head.prefill_tokens
            self.active.append(head)
            self.kv_tokens += head.context

    def pop_finished(self) -> list[Sequence]:
        """Sequences whose turn is done (their KV is freed: the engine ends a request at a tool call)."""
        done = [s for s in self.active if s.left <= 1e-6]
        if done:
            self.active = [s for s in self.active if s.left > 1e-6]
            self.kv_tokens = sum(s.context for s in self.active)
        return done

    def take_all(self) -> list[Sequence]:
        """Removes every sequence (the instance is stopped: in-flight turns are cut)."""
        seqs = list(self.active) + list(self.waiting)
        self.active, self.waiting = [], deque()
        self.kv_tokens = 0.0
        self.prefill_debt_s = 0.0
        return seqs

    @property
    def load(self) -> int:
        return len(self.active) + len(self.waiting)
