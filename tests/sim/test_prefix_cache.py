"""The instances' prefix cache: an ended turn's KV stays cached, against the KV capacity, until
other sequences need the room; a turn whose prefix was evicted prefills it again."""

from dataclasses import replace

import pytest

from libra.planner.config import PlannerConfig
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS
from libra.scheduler.baselines import LeastLoadRouter
from libra.scheduler.config import CmlfqConfig
from libra.sim.engine import RolloutCluster
from libra.sim.instance import Instance, Sequence, StepCoefficients
from tests.sim.helpers import migrating_cluster, tiny_config, trace


def cost_model() -> RolloutCostModel:
    config = tiny_config()
    return RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)


def cap(inst: Instance, capacity: int) -> Instance:
    inst.coefficients = replace(inst.coefficients, token_capacity=capacity)
    return inst


def one_instance_cluster(capacity: int):
    cost = cost_model()
    cmlfq = CmlfqConfig()
    cluster = RolloutCluster(LeastLoadRouter(cmlfq), cmlfq, cost, max_batch=256)
    inst = cap(cluster.add_instance("i0", 1, 0, (0,), ready_at=0.0), capacity)
    return cluster, cost, inst


def bare_instance(capacity: int, max_batch: int = 8) -> Instance:
    coefficients = replace(StepCoefficients.of(cost_model(), 1), token_capacity=capacity)
    return Instance(0, "i0", 1, 0, (0,), coefficients, max_batch=max_batch, token_budget=256)


def run_to_next_finish(inst: Instance) -> list[Sequence]:
    """Runs steps until a turn ends, handling it as the engine does."""
    while True:
        inst.advance(inst.next_completion())
        done = inst.pop_finished()
        inst.admit_waiting()
        if done:
            return done


def prefill(cost, tokens, offset=0):
    c = StepCoefficients.of(cost, 1)
    return c.step_s(0, 0.0, prefill_tokens=tokens) + c.chunk_s(offset, tokens)


def step(cost, batch, kv_tokens):
    return StepCoefficients.of(cost, 1).step_s(batch, kv_tokens)


def test_a_prefix_survives_a_tool_call_and_the_next_turn_prefills_only_the_tool_result():
    cluster, cost, inst = one_instance_cluster(capacity=1000)
    done = []
    cluster.on_finish = done.append
    traj = cluster.start(trace("a", [40, 60], prompt=10, tool_latency=2.0, payload=20))
    seen = []

    def look():  # while the tool runs: nothing in the batch, the turn's KV cached
        inst.advance(cluster.now)
        seen.append((inst.kv_tokens, dict(inst.prefix_cache), inst.cached_tokens))

    cluster.schedule(1.0, look)
    cluster.run_until(lambda: False)
    assert seen == [(0.0, {traj.key: pytest.approx(50)}, pytest.approx(50))]
    assert inst.prefilled_tokens == pytest.approx(10 + 20)  # the prompt, then only the tool result
    first = prefill(cost, 10) + 40 * step(cost, 1, 10)
    second = 2.0 + prefill(cost, 20, offset=50) + 60 * step(cost, 1, 70)
    assert done[0].finished_at == pytest.approx(first + second, rel=1e-9)
    assert inst.evictions == 0 and cluster.evicted_prefill_tokens == 0
    # The finished trajectory's KV stays cached until evicted.
    assert dict(inst.prefix_cache) == {traj.key: pytest.approx(130)}


def test_new_weights_empty_the_cache_and_the_next_turn_prefills_its_whole_context():
    """The job's engines reset their prefix cache when they load a version: a trajectory whose
    tool call spans a publication prefills its 50 tokens again, not only the tool's 20."""
    cluster, _, inst = one_instance_cluster(capacity=1000)
    done = []
    cluster.on_finish = done.append
    cluster.start(trace("a", [40, 60], prompt=10, tool_latency=2.0, payload=20))
    cluster.schedule(1.0, cluster.publish, 1)
    cluster.run_until(lambda: False)
    assert [t.trajectory_id for t in done] == ["a"] and done[0].versions == [0, 1]
    assert inst.prefilled_tokens == pytest.approx(10 + 50 + 20)
    assert cluster.evicted_prefill_tokens == pytest.approx(50)


def test_the_least_recently_used_prefix_is_evicted_and_its_turn_re_prefills():
    """Capacity 400. "a" and then "b" end their first turn (110 tokens cached each, "a" the
    older); "c" (200 tokens) needs room and evicts "a" only. "b" comes back from its tool first
    and finds its prefix; when "a" comes back, it evicts the least recently used entry ("c"'s,
    not "b"'s newer one) and prefills its whole context again."""
    cluster, cost, inst = one_instance_cluster(capacity=400)
    done = {}
    cluster.on_finish = lambda t: done.__setitem__(t.trajectory_id, t.finished_at)
    a = cluster.start(trace("a", [10, 10], prompt=100, tool_latency=5.0, payload=20))
    cluster.schedule(0.5, cluster.start, trace("b", [10, 10], prompt=100, tool_latency=2.0, payload=20))
    cluster.schedule(1.0, cluster.start, trace("c", [10], prompt=200))
    seen = []
    cluster.schedule(1.0, lambda: seen.append((list(inst.prefix_cache), inst.evictions)))
    cluster.run_until(lambda: False)
    assert sorted(done) == ["a", "b", "c"]
    a_key, b_key = a.key, a.key + 1  # keys in order of start
    assert seen == [([b_key], 1)]  # "c" admitted: "a" evicted, "b" kept
    assert inst.evictions == 2  # then "c"'s entry, for "a"'s re-prefill
    assert list(inst.prefix_cache) == [b_key, a_key]
    assert inst.evicted_prefill_tokens == pytest.approx(110)
    assert cluster.evicted_prefill_tokens == pytest.approx(110) and cluster.prefix_evictions == 2
    # "a" prefilled 100 + 130 (its whole context), "b" 100 + 20 (its tool result), "c" 200.
    assert inst.prefilled_tokens == pytest.approx(550)
    assert cluster.num_migrations == 0
    a_first = prefill(cost, 100) + 10 * step(cost, 1, 100)
    a_second = prefill(cost, 130) + 10 * step(cost, 1, 130)
    assert done["a"] == pytest.approx(a_first + 5.0 + a_second, rel=1e-9)


def test_a_prefix_evicted_while_its_turn_waits_in_the_queue_is_prefilled_again():
    inst = bare_instance(capacity=400, max_batch=1)
    inst.enqueue(Sequence(1, 100.0, 1.0, prefill_left=100.0))
    run_to_next_finish(inst)
    assert dict(inst.prefix_cache) == {1: pytest.approx(101)}
    inst.enqueue(Sequence(2, 100.0, 10.0, prefill_left=100.0))  # fits beside the cached 101
    wide = Sequence(3, 250.0, 5.0, prefill_left=250.0)
    turn = Sequence(1, 121.0, 5.0, prefill_left=20.0, cached=101.0)
    inst.enqueue(wide)
    inst.enqueue(turn)  # behind `wide`: the batch is full
    assert inst.evictions == 0 and inst.holds_prefix(1) and list(inst.waiting) == [wide, turn]
    run_to_next_finish(inst)  # 2 ends; `wide` needs 250 beside 101 + 110 cached: the older goes
    assert inst.holds_prefix(2) and not inst.holds_prefix(1) and inst.evictions == 1
    assert list(inst.waiting) == [turn] and turn.prefill_left == 20.0
    run_to_next_finish(inst)  # `wide` ends; `turn` is admitted and finds its prefix gone
    assert turn in inst.prefilling and turn.prefill_left == 121.0 and turn.cached == 0.0
    assert inst.evicted_prefill_tokens == pytest.approx(101)
    assert not inst.holds_prefix(2) and inst.evictions == 2  # room for 121 beside `wide`'s 255
    run_to_next_finish(inst)
    assert inst.prefilled_tokens == pytest.approx(100 + 100 + 250 + 121)


def test_an_empty_instance_takes_an_oversized_turn_and_cannot_keep_it_cached():
    inst = bare_instance(capacity=300)
    inst.enqueue(Sequence(1, 100.0, 1.0, prefill_left=100.0))
    run_to_next_finish(inst)
    big = Sequence(5, 500.0, 3.0, prefill_left=500.0)
    small = Sequence(6, 10.0, 1.0, prefill_left=10.0)
    inst.enqueue(big)
    inst.enqueue(small)
    assert inst.prefilling == [big] and list(inst.waiting) == [small]  # the overflow rule, alone
    assert inst.kv_tokens == 500.0 and not inst.prefix_cache and inst.evictions == 1
    assert run_to_next_finish(inst) == [big]
    assert inst.evictions == 2 and small in inst.prefilling  # 503 tokens cannot stay cached
    run_to_next_finish(inst)
    assert dict(inst.prefix_cache) == {6: pytest.approx(11)} and inst.cached_tokens == pytest.approx(11)


def test_a_growing_decode_evicts_the_cache_it_needs():
    inst = bare_instance(capacity=300)
    inst.enqueue(Sequence(1, 100.0, 1.0, prefill_left=100.0))
    run_to_next_finish(inst)
    growing = Sequence(2, 190.0, 30.0, prefill_left=190.0)
    inst.enqueue(growing)  # 190 beside the cached 101: room for 9 more tokens
    inst.advance(inst.next_completion())  # prefilled
    assert inst.holds_prefix(1) and growing in inst.active
    per_token = inst.coefficients.step_s(1, 190.0)
    inst.advance(inst.clock + 5 * per_token)
    assert inst.holds_prefix(1) and inst.evictions == 0
    inst.advance(inst.clock + 10 * per_token)
    assert not inst.holds_prefix(1) and inst.evictions == 1 and inst.cached_tokens == 0.0


def test_kv_held_and_cached_stays_within_the_capacity():
    """Sixteen three-turn trajectories on one instance of 600 tokens: after every event the KV
    held plus cached fits the capacity (or nothing is cached), a sequence is admitted beside
    others only if the KV held then fits, and every prefilled token is a prompt, a tool result,
    or an evicted prefix prefilled again."""
    capacity = 600
    cluster, _, inst = one_instance_cluster(capacity)
    admit = inst.admit_waiting
    violations = []

    def checked_admit():
        was_empty = not (inst.active or inst.prefilling)
        before = len(inst.waiting)
        admit()
        admitted = before - len(inst.waiting)
        if admitted and inst.kv_tokens > capacity and not (was_empty and admitted == 1):
            violations.append(("admission", cluster.now, inst.kv_tokens))

    inst.admit_waiting = checked_admit
    original = cluster.schedule

    def checking(time, callback, *args):
        def wrapped(*a):
            callback(*a)
            held = sum(s.context for s in (*inst.active, *inst.prefilling))
            if inst.kv_tokens != pytest.approx(held, abs=1e-6):
                violations.append(("held", cluster.now, inst.kv_tokens, held))
            if inst.cached_tokens != pytest.approx(sum(inst.prefix_cache.values()), abs=1e-6):
                violations.append(("cached", cluster.now))
            if inst.prefix_cache and inst.kv_tokens + inst.cached_tokens > capacity + 1e-6:
                violations.append(("total", cluster.now, inst.kv_tokens, inst.cached_tokens))

        original(time, wrapped, *args)

    cluster.schedule = checking
    finished = []
    cluster.on_finish = finished.append
    traces = [
        trace(f"t{i}", [20 + 5 * i, 10 + i, 30], prompt=60 + 9 * i, tool_latency=0.03 * (i % 7), payload=30)
        for i in range(16)
    ]
    for t in traces:
        cluster.start(t)
    cluster.run_until(lambda: False)
    assert violations == []
    assert len(finished) == 16 and cluster.num_migrations == 0
    assert inst.evictions > 0 and inst.evicted_prefill_tokens > 0  # the capacity did bind
    fresh = sum(t.prompt_tokens + sum(turn.payload_tokens for turn in t.turns) for t in traces)
    assert inst.prefilled_tokens == pytest.approx(fresh + inst.evicted_prefill_tokens, rel=1e-9)
    assert inst.decoded_tokens == pytest.approx(sum(sum(x.output_tokens for x in t.turns) for t in traces))


def test_stopping_an_instance_drops_its_cache():
    cluster, _, inst = one_instance_cluster(capacity=1000)
    cluster.start(trace("a", [10, 10], prompt=10, tool_latency=5.0))
    cluster.schedule(1.0, cluster.remove_instance, 0)
    cluster.run_until(lambda: cluster.now >= 1.0)
    assert not inst.prefix_cache and inst.cached_tokens == 0.0 and inst.kv_tokens == 0.0


def _kv_move_cluster(evict: bool):
    """i0 (TP-1, capacity 300) serves short paths, i1 (TP-2) long ones; after its tool returns,
    "a" runs its second turn on i1, its KV moved from i0 -- if i0 still holds it: with `evict`,
    "b" (250 tokens) arrives on i0 while "a" is in its tool and needs the room."""
    cost = cost_model()
    cluster, i0, i1 = migrating_cluster(cost, "kv_move")
    cap(i0, 300)
    done = []
    cluster.on_finish = done.append
    cluster.start(trace("a", [100, 500], prompt=10, payload=20, tool_latency=0.5))
    turn_ends = prefill(cost, 10) + 100 * step(cost, 1, 10)
    if evict:
        cluster.schedule(turn_ends + 0.25, cluster.start, trace("b", [10], prompt=250))
    cluster.run_until(lambda: False)
    assert "a" in [t.trajectory_id for t in done] and cluster.num_migrations == 1
    return cluster, i0, i1


def test_a_kv_move_from_an_instance_that_evicted_the_prefix_re_prefills():
    kept, _, kept_i1 = _kv_move_cluster(evict=False)
    assert kept.migration_s > 0 and kept_i1.prefilled_tokens == pytest.approx(20)
    evicted, i0, i1 = _kv_move_cluster(evict=True)
    assert i0.evictions >= 1 and i0.prefilled_tokens == pytest.approx(10 + 250)  # "b" ran on i0
    assert evicted.migration_s == 0.0  # nothing left to move
    assert i1.prefilled_tokens == pytest.approx(130)  # the whole context: 10 + 100 + the 20 result
    assert evicted.evicted_prefill_tokens == pytest.approx(110)
    assert kept.evicted_prefill_tokens == 0.0
