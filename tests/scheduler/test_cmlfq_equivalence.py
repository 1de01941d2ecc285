"""The C++ core decides exactly as the plain-Python reference on random traces.

Each trace draws a small config (thresholds low enough that random token counts cross them, tiny
windows so rebuilds and evictions happen) and a sequence of admissions, tool returns,
completions, aborts, instance changes, KV reports and losses (with reroutes of the displaced)
and rebuilds.
Half the configs give the buckets speeds (`BucketConfig.speed`), so priced promotions and moves
to a faster bucket while the pool drains are decided by both, on the contexts the trace reports.
Every decision must match in bucket, instance, reason and migrated; predictions and loads too.
"""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from libra.scheduler import (
    BucketConfig,
    BucketSpeed,
    CmlfqConfig,
    CmlfqRouter,
    Reason,
    SizeClass,
    ToolReturnState,
)
from libra.trajectory import ToolStatus
from tests.scheduler.reference_cmlfq import ReferenceCmlfq

STATES = [
    ToolReturnState(tool, size, status)
    for tool, size, status in [
        ("python", SizeClass.SMALL, ToolStatus.SUCCESS),
        ("python", SizeClass.LARGE, ToolStatus.FAILURE),
        ("python", SizeClass.SMALL, ToolStatus.TIMEOUT),
        ("search", SizeClass.MEDIUM, ToolStatus.SUCCESS),
        ("search", SizeClass.SMALL, ToolStatus.FAILURE),
    ]
]
PROMPTS = ["p0", "p1", "p2"]


def speed(rng: random.Random) -> BucketSpeed:
    """Steps of 5-50 ms plus up to 5 ms per live trajectory, and moves of up to 20 us per context
    token (plus a quadratic term): on the traces' few hundred tokens left and contexts of a few
    thousand, some moves pay and some do not."""
    return BucketSpeed(
        rng.uniform(0.005, 0.05), rng.uniform(0.0, 0.005), rng.uniform(0.0, 2e-5), rng.uniform(0.0, 1e-9)
    )


@st.composite
def configs(draw: st.DrawFn) -> CmlfqConfig:
    num_buckets = draw(st.integers(1, 4))
    thresholds = sorted(draw(st.sets(st.integers(1, 1500), min_size=num_buckets, max_size=num_buckets)))
    rng = random.Random(draw(st.integers(0, 2**32)))
    priced = draw(st.booleans())
    return CmlfqConfig(
        buckets=tuple(
            BucketConfig(f"b{i}", 2**i, t, speed(rng) if priced else None) for i, t in enumerate(thresholds)
        ),
        draining_fraction=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
        p90_window=draw(st.integers(1, 15)),
        rebuild_window=draw(st.integers(1, 30)),
        rebuild_interval=draw(st.integers(0, 8)),
        # Small caps bind; larger ones leave the pool short of draining, where the fair-share
        # bound decides.
        max_queue_length=draw(st.integers(1, 4) | st.integers(5, 20)),
        demote=draw(st.booleans()),
        kv_full_fraction=draw(st.sampled_from([1.0, 0.9, 0.5]) | st.floats(0.01, 1.0)),
        fair_share_headroom=draw(st.sampled_from([0.0, 1.0, 1.4]) | st.floats(1.0, 4.0)),
    )


# Kinds repeated to weight them: traces are mostly tool returns and completions.
KINDS = (
    ["admit"] * 4
    + ["tool"] * 10
    + ["finish"] * 3
    + ["add"] * 2
    + ["kv"] * 3
    + ["abort", "reroute", "lose", "ready", "rebuild", "update", "speeds", "cap"]
)
ops = st.tuples(st.sampled_from(KINDS), st.integers(0, 50), st.integers(0, 600), st.booleans())
traces = st.lists(ops, min_size=20, max_size=200)


FALLBACKS = (Reason.BUCKET_SATURATED_FALLBACK, Reason.ANY_INSTANCE_FALLBACK)


class Twin:
    """Runs every operation on the C++ router and the reference and checks they agree."""

    def __init__(self, config: CmlfqConfig) -> None:
        self.native = CmlfqRouter(config)
        self.reference = ReferenceCmlfq(config)
        self.num_buckets = len(config.buckets)
        self.generated: dict[str, int] = {}
        self.instances: list[int] = []
        self.next_instance = 0
        self.next_trajectory = 0

    def both(self, method: str, *args: object) -> object:
        native = getattr(self.native, method)(*args)
        reference = getattr(self.reference, method)(*args)
        assert native == reference, (method, args)
        return native

    def pick(self, index: int) -> str | None:
        live = sorted(self.generated)
        return live[index % len(live)] if live else None

    def apply(self, op: tuple[str, int, int, bool]) -> None:
        """`index` picks a prompt, live trajectory, bucket or instance; `tokens` is what a turn
        generates; `flag` is an instance's readiness."""
        kind, index, tokens, flag = op
        if kind == "admit":
            trajectory = f"t{self.next_trajectory}"
            self.next_trajectory += 1
            self.generated[trajectory] = 0
            self.both("admit", trajectory, PROMPTS[index % len(PROMPTS)])
        elif kind in ("tool", "finish", "abort", "reroute") and (trajectory := self.pick(index)):
            if kind == "tool":
                self.generated[trajectory] += tokens
                state = STATES[(index + tokens) % len(STATES)]
                context = self.generated[trajectory] + 100 * index
                holder = self.reference.live[trajectory].instance
                was_placed = holder is not None and self.reference.instances[holder].ready
                decision = self.both("on_tool_return", trajectory, state, self.generated[trajectory], context)
                # From a ready instance a trajectory stays or moves where the decision aimed: a
                # move is judged against the pool its placement sees.
                assert not was_placed or decision.reason not in FALLBACKS, decision
            elif kind == "finish":
                self.both("on_finish", trajectory, self.generated.pop(trajectory) + tokens)
            elif kind == "abort":
                del self.generated[trajectory]
                self.both("on_abort", trajectory)
            else:
                self.both("reroute", trajectory)
        elif kind == "add":
            weight = 1 + tokens % 3  # equal instances most of the time, some two or three times larger
            self.both("add_instance", self.next_instance, index % self.num_buckets, flag, weight)
            self.instances.append(self.next_instance)
            self.next_instance += 1
        elif kind in ("lose", "ready", "kv") and self.instances:
            instance = self.instances[index % len(self.instances)]
            if kind == "ready":
                self.both("set_instance_ready", instance, flag)
            elif kind == "kv":
                # Capacity 0 (no report) now and then; usage around the threshold, past capacity too.
                capacity = 0 if index % 7 == 0 else 1 + tokens % 23 + 10 * (index % 3)
                self.both("set_instance_kv", instance, tokens % (capacity + 5), capacity)
            else:
                self.instances.remove(instance)
                for trajectory in self.both("on_instance_lost", instance):
                    self.both("reroute", trajectory)
        elif kind == "rebuild":
            self.both("rebuild")
        elif kind == "update":
            self.update_buckets(index, tokens)
        elif kind == "cap":
            # A plan changed the pool's weight: its derived cap moves (`FairQueueLength`).
            self.both("set_max_queue_length", 1 + tokens % 20)
        elif kind == "speeds" and self.native.config.speeds:
            rng = random.Random(index * 1000 + tokens)
            buckets = tuple(dataclasses.replace(b, speed=speed(rng)) for b in self.native.config.buckets)
            self.both("set_bucket_speeds", buckets)

    def update_buckets(self, index: int, tokens: int) -> None:
        """A re-plan: 1-4 new buckets with thresholds around the token counts traces generate,
        and every instance relabelled (drawn from `index` and `tokens`, so a trace replays)."""
        rng = random.Random(index * 1000 + tokens)
        num_buckets = rng.randint(1, 4)
        thresholds = sorted(rng.sample(range(1, 1500), num_buckets))
        priced = rng.random() < 0.5
        buckets = tuple(
            BucketConfig(f"u{i}", 2**i, t, speed(rng) if priced else None) for i, t in enumerate(thresholds)
        )
        mapping = {instance: rng.randrange(num_buckets) for instance in self.instances}
        self.both("update_buckets", buckets, mapping)
        self.num_buckets = num_buckets
        assert self.native.thresholds == thresholds

    def check_model(self) -> None:
        paths = [[]] + [path[:n] for _, path, _ in self.reference.history for n in range(1, len(path) + 1)]
        for prompt in PROMPTS + ["unseen"]:
            for path in paths:
                native = self.native._core.predict(prompt, path)
                assert native == self.reference.predict(prompt, path), (prompt, path)

    def check_loads(self) -> None:
        native = [
            (load.instance_id, load.bucket, load.active, load.ready, load.kv_used, load.kv_capacity)
            for load in self.native.instance_loads()
        ]
        reference = [
            (i, x.bucket, x.active, x.ready, x.kv_used, x.kv_capacity)
            for i, x in sorted(self.reference.instances.items())
        ]
        assert native == reference


@settings(max_examples=200, deadline=None)
@given(config=configs(), initial_buckets=st.lists(st.integers(0, 3), min_size=1, max_size=8), trace=traces)
def test_same_decisions_on_random_traces(
    config: CmlfqConfig, initial_buckets: list[int], trace: list[tuple]
) -> None:
    twin = Twin(config)
    for bucket in initial_buckets:
        twin.apply(("add", bucket, 0, True))
    for op in trace:
        twin.apply(op)
    twin.check_model()
    twin.check_loads()
