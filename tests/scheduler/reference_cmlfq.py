"""A plain-Python C-MLFQ, written for clarity rather than speed: the reference the C++ core is
held to (`test_cmlfq_equivalence.py`) and the Python baseline of `benchmarks/cmlfq.py`.

Same rules as `csrc/cmlfq/scheduler.cpp`, computed the obvious way: every tool return walks the
tree from the root, every P90 sorts its window, the mean is compared as sum <= threshold * count.
Priced moves (`BucketConfig.speed`) use the same floating-point expressions as the core, in the
same order, so both round alike.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction

from libra.scheduler.config import CmlfqConfig
from libra.scheduler.interface import Decision, Reason
from libra.scheduler.tool_state import ToolReturnState


class Node:
    def __init__(self, window: int) -> None:
        self.count = 0
        self.total = 0
        self.samples: deque[int] = deque(maxlen=window)
        """The most recent remaining-token samples, oldest first."""
        self.children: dict[int, Node] = {}

    def add(self, remaining: int) -> None:
        self.count += 1
        self.total += remaining
        self.samples.append(remaining)

    def p90(self) -> int:
        ordered = sorted(self.samples)
        return ordered[-(-9 * len(ordered) // 10) - 1]  # the ceil(0.9 n)-th smallest


class Tree:
    def __init__(self, window: int) -> None:
        self.window = window
        self.root = Node(window)

    def child(self, node: Node, key: int) -> Node:
        if key not in node.children:
            node.children[key] = Node(self.window)
        return node.children[key]

    def insert(self, path: list[int], remaining: list[int]) -> None:
        node = self.root
        node.add(remaining[0])
        for key, left in zip(path, remaining[1:], strict=True):
            node = self.child(node, key)
            node.add(left)

    def deepest(self, path: list[int]) -> tuple[Node, int]:
        node, depth = self.root, 0
        for key in path:
            if key not in node.children:
                break
            node, depth = node.children[key], depth + 1
        return node, depth

    def merge(self, other: Tree) -> None:
        pairs = [(self.root, other.root)]
        while pairs:
            ours, theirs = pairs.pop()
            ours.count += theirs.count
            ours.total += theirs.total
            ours.samples.extend(theirs.samples)
            for key, child in theirs.children.items():
                pairs.append((self.child(ours, key), child))


@dataclass
class Live:
    prompt: str
    bucket: int = 0
    instance: int | None = None
    path: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    context: int = 0


@dataclass
class Instance:
    bucket: int
    ready: bool
    active: int = 0
    weight: int = 1
    kv_used: int = 0
    kv_capacity: int = 0
    """0: never reported."""
    loading: bool = False
    """Added not ready and not ready since (one set not ready after serving is leaving)."""


def clamp(tokens: int) -> int:
    return min(max(tokens, 0), 2**31 - 1)


class ReferenceCmlfq:
    def __init__(self, config: CmlfqConfig) -> None:
        self.config = config
        self.thresholds = config.thresholds
        self.speeds = config.speeds
        self.global_tree = Tree(config.p90_window)
        self.prompt_trees: dict[str, Tree] = {}
        self.history: deque[tuple[str, list[int], list[int]]] = deque(maxlen=config.rebuild_window)
        self.live: dict[str, Live] = {}
        self.instances: dict[int, Instance] = {}
        self.completions_since_rebuild = 0

    # Learning.

    def learn(self, prompt: str, path: list[int], remaining: list[int]) -> None:
        if path:  # a completion without tool returns is no history of its prompt
            self.prompt_trees.setdefault(prompt, Tree(self.config.p90_window)).insert(path, remaining)
        self.global_tree.insert(path, remaining)
        self.history.append((prompt, path, remaining))

    def rebuild(self) -> None:
        history = list(self.history)
        self.global_tree = Tree(self.config.p90_window)
        self.prompt_trees = {}
        self.history.clear()
        for completed in history:
            self.learn(*completed)
        self.completions_since_rebuild = 0

    def merge(self, other: ReferenceCmlfq) -> None:
        self.global_tree.merge(other.global_tree)
        for prompt, tree in other.prompt_trees.items():
            self.prompt_trees.setdefault(prompt, Tree(self.config.p90_window)).merge(tree)
        self.history.extend(other.history)

    def predict(self, prompt: str, path: list[int]) -> tuple[bool, int, int, int, int] | None:
        """(from prompt tree, depth, count, sum, p90), like the core's `predict`."""
        prompt_tree = self.prompt_trees.get(prompt)
        if prompt_tree is not None and prompt_tree.root.count > 0:
            node, depth = prompt_tree.deepest(path)
            return True, depth, node.count, node.total, node.p90()
        if self.global_tree.root.count == 0:
            return None
        node, depth = self.global_tree.deepest(path)
        return False, depth, node.count, node.total, node.p90()

    # Routing.

    def bucket_for(self, tokens: int) -> int:
        return next((b for b, t in enumerate(self.thresholds) if tokens <= t), len(self.thresholds) - 1)

    def bucket_for_mean(self, count: int, total: int) -> int:
        return next(
            (b for b, t in enumerate(self.thresholds) if total <= t * count), len(self.thresholds) - 1
        )

    def admit(self, trajectory_id: str, prompt_id: str) -> Decision:
        assert trajectory_id not in self.live
        self.live[trajectory_id] = Live(prompt_id)
        return self.move(trajectory_id, 0, Reason.ADMITTED)

    def on_tool_return(
        self, trajectory_id: str, state: ToolReturnState, generated_tokens: int, context_tokens: int = 0
    ) -> Decision:
        live = self.live[trajectory_id]
        live.path.append(state.key)
        live.generated.append(clamp(generated_tokens))
        live.context = max(context_tokens, 0)
        prediction = self.predict(live.prompt, live.path)
        target = live.bucket
        mean = 0.0
        if prediction is None:
            reason = Reason.NO_HISTORY
        else:
            _, _, count, total, p90 = prediction
            mean = float(total) / float(count)
            by_mean, by_p90 = self.bucket_for_mean(count, total), self.bucket_for(p90)
            if by_mean != by_p90:
                reason = Reason.MEAN_P90_DISAGREE
            elif by_mean == live.bucket:
                reason = Reason.STAY_SAME_BUCKET
            elif by_mean < live.bucket and not self.config.demote:
                reason = Reason.DEMOTION_HELD
            else:
                target = by_mean
                reason = Reason.MIGRATE_UP if by_mean > live.bucket else Reason.MIGRATE_DOWN
        if live.instance is None or not self.instances[live.instance].ready:
            return self.move(trajectory_id, target, reason)
        if target == live.bucket:
            faster = self.faster_bucket(live, mean) if prediction is not None else None
            if faster is not None:
                return self.move(trajectory_id, faster, Reason.MIGRATE_FASTER)
            return Decision(trajectory_id, live.bucket, live.instance, reason, False)
        return self.stay_or_move(trajectory_id, target, reason, mean)

    def stay_or_move(self, trajectory_id: str, target: int, reason: Reason, mean: float) -> Decision:
        live = self.live[trajectory_id]
        if not self.has_room(target, holder=live.instance):
            return Decision(trajectory_id, live.bucket, live.instance, Reason.TARGET_FULL_STAY, False)
        if self.speeds and target > live.bucket and self.gain(live, target, mean) <= 0:
            return Decision(trajectory_id, live.bucket, live.instance, Reason.MOVE_NOT_WORTH_IT, False)
        return self.move(trajectory_id, target, reason)

    def step_with(self, bucket: int, live: int) -> float:
        step, per_sequence, _, _ = self.speeds[bucket]
        return step + per_sequence * float(live)

    def gain(self, live: Live, target: int, mean: float) -> float:
        """Seconds a move to `target` saves on the predicted remaining tokens, less its cost to it
        and to the target's trajectories."""
        _, destination, _ = self.place(target, live.instance, previous_holds_it=True)
        saving = mean * (
            self.step_with(live.bucket, self.instances[live.instance].active)
            - self.step_with(target, self.instances[destination].active + 1)
        )
        _, _, linear, quadratic = self.speeds[target]
        c = float(live.context)
        # The re-prefill holds up the target's trajectories too.
        return saving - (linear * c + quadratic * c * c) * (1.0 + float(self.instances[destination].active))

    def faster_bucket(self, live: Live, mean: float) -> int | None:
        """While the pool drains: the larger bucket with room where the move gains the most."""
        if not self.speeds or not self.draining():
            return None
        best, best_gain = None, 0.0
        for bucket in range(live.bucket + 1, len(self.thresholds)):
            if self.has_room(bucket, live.instance) and (gain := self.gain(live, bucket, mean)) > best_gain:
                best, best_gain = bucket, gain
        return best

    def pool(self, holder: int | None) -> tuple[int, int, bool]:
        """The ready instances' live trajectories (one fewer on `holder`: a trajectory whose move
        is decided before it leaves), their weight, and whether the pool drains."""
        ready = [(i, instance) for i, instance in self.instances.items() if instance.ready]
        active = sum(instance.active - (i == holder and instance.active > 0) for i, instance in ready)
        cap = sum(self.config.max_queue_length * instance.weight for _, instance in ready)
        draining = cap > 0 and float(active) <= self.config.draining_fraction * float(cap)
        return active, sum(instance.weight for _, instance in ready), draining

    def draining(self) -> bool:
        return self.pool(None)[2]

    def room(self, instance: Instance, holder: int | None = None) -> bool:
        """Under its trajectory cap; unless the pool drains, active / weight below
        fair_share_headroom times (pool active + 1) / pool weight; if it reported its KV, under
        kv_full_fraction of it."""
        if instance.active >= self.config.max_queue_length * instance.weight:
            return False
        if (
            0 < instance.kv_capacity
            and instance.kv_used >= self.config.kv_full_fraction * instance.kv_capacity
        ):
            return False
        held, weight, draining = self.pool(holder)
        headroom = self.config.fair_share_headroom
        if headroom == 0 or draining:
            return True
        return float(instance.active * weight) < headroom * float(held + 1) * float(instance.weight)

    def has_room(self, bucket: int, holder: int | None = None) -> bool:
        return any(i.ready and i.bucket == bucket and self.room(i, holder) for i in self.instances.values())

    def on_finish(self, trajectory_id: str, total_output_tokens: int) -> None:
        live = self.live[trajectory_id]
        remaining = [clamp(total_output_tokens)] + [clamp(total_output_tokens - g) for g in live.generated]
        self.learn(live.prompt, live.path, remaining)
        self.on_abort(trajectory_id)
        self.completions_since_rebuild += 1
        if self.config.rebuild_interval and self.completions_since_rebuild >= self.config.rebuild_interval:
            self.rebuild()

    def on_abort(self, trajectory_id: str) -> None:
        live = self.live.pop(trajectory_id)
        if live.instance is not None:
            self.instances[live.instance].active -= 1

    def reroute(self, trajectory_id: str) -> Decision:
        return self.move(trajectory_id, self.live[trajectory_id].bucket, Reason.REROUTED)

    # Instances and placement.

    def add_instance(self, instance_id: int, bucket: int, ready: bool = True, weight: int = 1) -> None:
        assert instance_id not in self.instances
        self.instances[instance_id] = Instance(bucket, ready, weight=weight, loading=not ready)

    def remove_instance(self, instance_id: int) -> list[str]:
        del self.instances[instance_id]
        displaced = sorted(t for t, live in self.live.items() if live.instance == instance_id)
        for trajectory_id in displaced:
            self.live[trajectory_id].instance = None
        return displaced

    on_instance_lost = remove_instance

    def set_instance_ready(self, instance_id: int, ready: bool) -> None:
        instance = self.instances[instance_id]
        instance.ready = ready
        instance.loading = instance.loading and not ready

    def set_instance_kv(self, instance_id: int, used_tokens: int, capacity_tokens: int) -> None:
        instance = self.instances[instance_id]
        instance.kv_used, instance.kv_capacity = used_tokens, capacity_tokens

    def set_max_queue_length(self, max_queue_length: int) -> None:
        self.config = dataclasses.replace(self.config, max_queue_length=max_queue_length)

    def set_bucket_speeds(self, buckets) -> None:
        self.speeds = [b.speed.as_tuple() for b in buckets if b.speed is not None]

    def update_buckets(self, buckets, instance_buckets: dict[int, int]) -> list[Decision]:
        """New thresholds and instance buckets; then each live trajectory, in id order, takes its
        instance's new bucket, or moves where its path's mean and P90 now agree."""
        assert sorted(instance_buckets) == sorted(self.instances)
        self.thresholds = [b.max_remaining_tokens for b in buckets]
        self.speeds = [b.speed.as_tuple() for b in buckets if b.speed is not None]
        last = len(self.thresholds) - 1
        for instance_id, bucket in instance_buckets.items():
            self.instances[instance_id].bucket = bucket
        moved = []
        for trajectory_id in sorted(self.live):
            live = self.live[trajectory_id]
            placed = live.instance is not None
            live.bucket = self.instances[live.instance].bucket if placed else min(live.bucket, last)
            prediction = self.predict(live.prompt, live.path) if live.path else None
            if prediction is None:
                continue
            _, _, count, total, p90 = prediction
            target = self.bucket_for_mean(count, total)
            if target != self.bucket_for(p90) or target == live.bucket:
                continue
            if target < live.bucket and not self.config.demote:
                continue
            if not placed:
                live.bucket = target
                continue
            reason = Reason.MIGRATE_UP if target > live.bucket else Reason.MIGRATE_DOWN
            if not self.instances[live.instance].ready:
                moved.append(self.move(trajectory_id, target, reason))
                continue
            before = live.instance
            decision = self.stay_or_move(trajectory_id, target, reason, float(total) / float(count))
            if decision.instance_id != before:
                moved.append(decision)
        return moved

    def move(self, trajectory_id: str, bucket: int, reason: Reason) -> Decision:
        live = self.live[trajectory_id]
        previous = live.instance
        if previous is not None:
            self.instances[previous].active -= 1
        live.bucket, live.instance, fallback = self.place(bucket, previous)
        if live.instance is not None:
            self.instances[live.instance].active += 1
        migrated = previous is not None and live.instance is not None and live.instance != previous
        return Decision(trajectory_id, live.bucket, live.instance, fallback or reason, migrated)

    def place(
        self, bucket: int, previous: int | None, previous_holds_it: bool = False
    ) -> tuple[int, int | None, Reason | None]:
        holder = previous if previous_holds_it else None

        def least_loaded(buckets: set[int], capped: bool) -> int | None:
            candidates = [
                (Fraction(instance.active, instance.weight), instance_id != previous, instance_id)
                for instance_id, instance in self.instances.items()
                if instance.ready
                and instance.bucket in buckets
                and (not capped or self.room(instance, holder))
            ]
            return min(candidates)[2] if candidates else None

        num_buckets = len(self.thresholds)
        if (chosen := least_loaded({bucket}, capped=True)) is not None:
            return bucket, chosen, None
        # Nearest first; at equal distance the larger bucket.
        for other in sorted(range(num_buckets), key=lambda b: (abs(b - bucket), -b))[1:]:
            if (chosen := least_loaded({other}, capped=True)) is not None:
                return other, chosen, Reason.BUCKET_SATURATED_FALLBACK
        loading = any(instance.loading for instance in self.instances.values())
        if not loading and (chosen := least_loaded(set(range(num_buckets)), capped=False)) is not None:
            return self.instances[chosen].bucket, chosen, Reason.ANY_INSTANCE_FALLBACK
        return bucket, None, Reason.NO_INSTANCE
