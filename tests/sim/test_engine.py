"""The event engine and the instance model against hand calculations from the cost model."""

from dataclasses import replace

import pytest

from libra.planner.config import PlannerConfig
from libra.planner.cost_model import ring_allreduce_s
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS
from libra.scheduler.baselines import LeastLoadRouter
from libra.scheduler.cmlfq import CmlfqRouter
from libra.scheduler.config import BucketConfig, CmlfqConfig
from libra.scheduler.tool_state import ToolReturnState
from libra.sim.engine import RolloutCluster
from libra.sim.instance import Instance, Sequence, StepCoefficients
from libra.trajectory import ToolStatus
from tests.sim.helpers import migrating_cluster, tiny_config, trace


def make_cluster(num_instances=1, tp=1, max_batch=256, token_budget=2048):
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cmlfq = CmlfqConfig()
    cluster = RolloutCluster(
        LeastLoadRouter(cmlfq), cmlfq, cost, max_batch=max_batch, token_budget=token_budget
    )
    for i in range(num_instances):
        cluster.add_instance(f"i{i}", tp, 0, tuple(range(i * tp, (i + 1) * tp)), ready_at=0.0)
    return cluster, cost


def step(cost, batch, kv_tokens, tp=1):
    return cost.decode_step(tp, batch, kv_tokens / batch).seconds(cost.factors)


def chunk(cost, offset, tokens, tp=1):
    """Plain-Python reference: what prefilling `tokens` after `offset` held tokens adds to a
    forward pass besides its matmuls -- causal attention over everything before them, and two
    all-reduces per layer of their activations."""
    m, profile, f = cost.model, cost.cluster.profile, cost.factors
    end = offset + tokens
    flops = 2.0 * m.num_layers * m.query_dim * (end**2 - offset**2)
    per_token = ring_allreduce_s(
        m.hidden_size * m.bytes_per_param, tp, profile.intra_node_bandwidth_bytes_per_s
    )
    return (
        flops / (tp * profile.peak_bf16_flops) / f.compute
        + 2 * m.num_layers * per_token * tokens / f.communication
    )


def matmul_s(cost, tokens, tp=1):
    """The matmuls of a pass over `tokens` tokens: 2 x params FLOPs each, or the weight read,
    whichever takes longer (they run at once)."""
    m, profile, f = cost.model, cost.cluster.profile, cost.factors
    compute = 2.0 * m.num_params * tokens / (tp * profile.peak_bf16_flops) / f.compute
    weight_read = m.weight_bytes / tp / profile.memory_bandwidth_bytes_per_s / f.memory
    return max(compute, weight_read)


def ref_step(cost, decode_contexts, chunks, tp=1):
    """Plain-Python reference of one engine step: the decode step of the decoding sequences
    without its matmuls (a latency floor per pass, even with no decodes), the matmuls of every
    token in the pass, and what each prefill chunk adds besides them."""
    batch, kv = len(decode_contexts), float(sum(decode_contexts))
    decode = cost.decode_step(tp, batch, kv / batch if batch else 0.0)
    without_matmuls = replace(decode, overlapped=()).seconds(cost.factors)
    tokens = batch + sum(n for _, n in chunks)
    return without_matmuls + matmul_s(cost, tokens, tp) + sum(chunk(cost, o, n, tp) for o, n in chunks)


def prefill(cost, tokens, tp=1, offset=0):
    """A step that only prefills `tokens` (they fit one step's budget)."""
    return ref_step(cost, [], [(offset, tokens)], tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_step_coefficients_match_the_reference(tp):
    _, cost = make_cluster()
    coeff = StepCoefficients.of(cost, tp)
    for batch, kv in [(1, 100.0), (7, 20_000.0), (64, 900_000.0)]:
        assert coeff.step_s(batch, kv) == pytest.approx(step(cost, batch, kv, tp), rel=1e-9)
    for offset, tokens in [(0, 10), (0, 2048), (30_000, 500), (1_000, 1)]:
        assert coeff.chunk_s(offset, tokens) == pytest.approx(chunk(cost, offset, tokens, tp), rel=1e-9)
    # Chunks of one prefill and their matmuls add up to the unchunked prefill's compute (its
    # latency floor aside).
    whole = cost.prefill(tp, 6000.0).seconds(cost.factors) - cost.prefill(tp, 0.0).seconds(cost.factors)
    parts = sum(coeff.chunk_s(o, 2000) for o in (0, 2000, 4000))
    assert parts + 6000 * coeff.decode.gemm_per_token_s == pytest.approx(whole, rel=1e-9)
    # A pass's matmuls take the longer of their compute and the weight read.
    for batch, prefill_tokens in [(1, 0), (3, 40), (8, 2048)]:
        matmuls = coeff.step_s(batch, 0.0, prefill_tokens) - coeff.step_s(batch, 0.0, 0.0)
        expected = matmul_s(cost, batch + prefill_tokens, tp) - matmul_s(cost, batch, tp)
        assert matmuls == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_one_mixed_step_costs_its_decodes_plus_its_chunks():
    """Three decoding sequences and two queued prefills under a 64-token budget: the step
    decodes three tokens and prefills 61 -- the end of the first prompt, then the start of the
    second, first come first served -- and takes the reference's time."""
    _, cost = make_cluster()
    coeff = StepCoefficients.of(cost, 1)
    inst = Instance(0, "i0", 1, 0, (0,), coeff, max_batch=8, token_budget=64)
    decoders = [Sequence(k, context, 100.0) for k, context in enumerate([300.0, 50.0, 1200.0])]
    for seq in decoders:
        inst.enqueue(seq)
    first = Sequence(10, 40.0, 5.0, prefill_left=40.0)
    second = Sequence(11, 500.0, 5.0, prefill_left=200.0)  # 300 tokens of its KV already held
    inst.enqueue(first)
    inst.enqueue(second)
    expected = ref_step(cost, [300, 50, 1200], [(0, 40), (300, 21)])
    assert inst.next_completion() == pytest.approx(expected, rel=1e-12)
    inst.advance(expected)
    assert [s.left for s in decoders] == pytest.approx([99.0] * 3)
    assert first in inst.active and first.prefill_left == 0.0
    assert second.prefill_left == pytest.approx(179.0) and inst.prefilled_tokens == pytest.approx(61.0)
    assert inst.num_steps == pytest.approx(1.0) and inst.busy_s == pytest.approx(expected)


def test_single_turn_time():
    cluster, cost = make_cluster()
    finished = []
    cluster.on_finish = finished.append
    cluster.start(trace("a", [100], prompt=10))
    cluster.run_until(lambda: False)
    expected = prefill(cost, 10) + 100 * step(cost, 1, 10)
    assert finished[0].finished_at == pytest.approx(expected, rel=1e-9)


def test_two_sequences_share_the_batch_then_one_runs_alone():
    cluster, cost = make_cluster()
    done = {}
    cluster.on_finish = lambda t: done.__setitem__(t.trajectory_id, t.finished_at)
    cluster.start(trace("long", [100], prompt=10))
    cluster.start(trace("short", [50], prompt=30))
    cluster.run_until(lambda: False)
    # Both prompts are prefilled in the first step (they fit its budget), then both decode.
    t_short = ref_step(cost, [], [(0, 10), (0, 30)]) + 50 * step(cost, 2, 40)
    t_long = t_short + 50 * step(cost, 1, 10 + 50)
    assert done["short"] == pytest.approx(t_short, rel=1e-9)
    assert done["long"] == pytest.approx(t_long, rel=1e-9)


def test_tool_call_and_cached_prefix():
    cluster, cost = make_cluster()
    done = []
    cluster.on_finish = done.append
    cluster.start(trace("a", [40, 60], prompt=10, tool_latency=2.0, payload=20))
    cluster.run_until(lambda: False)
    first = prefill(cost, 10) + 40 * step(cost, 1, 10)
    # Same instance: only the tool result is prefilled (attending to the cached 50 tokens); the
    # context is prompt + turn 1 + result.
    second = 2.0 + prefill(cost, 20, offset=10 + 40) + 60 * step(cost, 1, 10 + 40 + 20)
    assert done[0].finished_at == pytest.approx(first + second, rel=1e-9)
    assert cluster.num_migrations == 0 and cluster.num_turns == 2


def test_events_in_time_order_and_every_trajectory_finishes_once():
    cluster, _ = make_cluster(num_instances=3)
    seen, times = [], []
    original = cluster.schedule

    def recording(time, callback, *args):
        def wrapped(*a):
            times.append(cluster.now)
            callback(*a)

        original(time, wrapped, *args)

    cluster.schedule = recording
    cluster.on_finish = lambda t: seen.append(t.trajectory_id)
    ids = [f"t{i}" for i in range(30)]
    for i, tid in enumerate(ids):
        cluster.start(trace(tid, [10 + 7 * i, 5 + i, 30], prompt=20 + i, tool_latency=0.1 * (i % 5)))
    cluster.run_until(lambda: False)
    assert times == sorted(times)
    assert sorted(seen) == sorted(ids)
    assert not cluster.live and cluster.num_turns == 90
    # Device time adds up: every decoded token is accounted for.
    decoded = sum(i.decoded_tokens for i in cluster.all_instances())
    assert decoded == pytest.approx(sum(10 + 7 * i + 5 + i + 30 for i in range(30)), rel=1e-6)
    # And every prompt and tool result is prefilled exactly once (no trajectory moved).
    assert cluster.num_migrations == 0
    prefilled = sum(i.prefilled_tokens for i in cluster.all_instances())
    assert prefilled == pytest.approx(sum(20 + i + 2 * 20 for i in range(30)), rel=1e-9)


def reference_instance(cost, budget, arrivals, tp=1):
    """Plain-Python, step-by-step reference of one instance with chunked prefill: `arrivals` are
    (time, key, prompt tokens, output tokens); each step decodes one token of every decoding
    sequence, then prefills the rest of the budget first come first served, and costs
    `ref_step`. Returns each key's finish time and, per step, the decoding keys."""
    pending = sorted(arrivals)
    prefilling, decoding, done, steps = [], {}, {}, []
    t = 0.0
    while pending or prefilling or decoding:
        while pending and pending[0][0] <= t + 1e-12:
            _, key, prompt, output = pending.pop(0)
            prefilling.append([key, 0, prompt, output])
        if not prefilling and not decoding:
            t = pending[0][0]
            continue
        room = budget - len(decoding)
        chunks, finished_prefill = [], []
        for p in prefilling:
            n = min(room, p[2] - p[1])
            if n <= 0:
                break
            chunks.append((p[1], n))
            p[1] += n
            room -= n
            if p[1] == p[2]:
                finished_prefill.append(p)
        t += ref_step(cost, [c for c, _ in decoding.values()], chunks, tp)
        steps.append(sorted(decoding))
        for key in list(decoding):
            context, left = decoding[key]
            decoding[key] = (context + 1, left - 1)
            if left == 1:
                done[key] = t
                del decoding[key]
        for p in finished_prefill:
            prefilling.remove(p)
            decoding[p[0]] = (p[2], p[3])
    return done, steps


def test_a_long_prefill_does_not_block_running_decodes():
    """A 5,000-token prompt arrives while a sequence decodes, under a 64-token budget: the
    decode keeps advancing a token every step (the prompt takes 79 full chunks of 63 and a last
    of 23), and both finish when the step-by-step reference says -- an unchunked prefill would
    have held the decode for the whole prompt."""
    cluster, cost = make_cluster(max_batch=8, token_budget=64)
    done = {}
    cluster.on_finish = lambda t: done.__setitem__(t.trajectory_id, t.finished_at)
    cluster.start(trace("decoding", [400], prompt=10))
    arrive = prefill(cost, 10) + 100 * step(cost, 1, 10)  # after about 100 decode steps
    cluster.schedule(arrive, cluster.start, trace("long", [50], prompt=5000))
    inst = cluster.instances[0]
    seen = []
    probe = arrive

    def look():
        inst.advance(cluster.now)
        seen.append((inst.prefilling[0].prefill_left, inst.decoded_tokens))

    for _ in range(30):  # look at the decode's progress every ~2 steps of the prompt's prefill
        probe += 2 * ref_step(cost, [110], [(2500, 63)])
        cluster.schedule(probe, look)
    cluster.run_until(lambda: False)
    expected, steps = reference_instance(cost, 64, [(0.0, "decoding", 10, 400), (arrive, "long", 5000, 50)])
    # The engine runs decode-only stretches as a fluid at the stretch's first context, the
    # reference a step at a time; they agree to within one step.
    one_step = ref_step(cost, [110], [(2500, 63)])
    assert abs(done["decoding"] - expected["decoding"]) < one_step
    assert abs(done["long"] - expected["long"]) < one_step
    # In the reference too the decode never waits: one step per token, the long prompt's 80
    # chunks (ceil(5000 / 63)) riding along, then both decode.
    assert len([s for s in steps if s == ["decoding", "long"]]) == 50
    assert len(steps) == 1 + 400  # the first prompt's step, then one per token of the long decode
    # While the prompt prefilled, the decode gained about two tokens between every two looks.
    lefts = [left for left, _ in seen]
    decoded = [d for _, d in seen]
    assert lefts == sorted(lefts, reverse=True) and lefts[-1] > 0
    assert all(1.8 < b - a < 2.2 for a, b in zip(decoded[:-1], decoded[1:], strict=True))
    tokens = sum(i.decoded_tokens for i in cluster.all_instances())
    assert tokens == pytest.approx(450, rel=1e-9)
    assert sum(i.prefilled_tokens for i in cluster.all_instances()) == pytest.approx(5010, rel=1e-9)


def test_removing_an_instance_cuts_and_resumes_turns():
    cluster, cost = make_cluster(num_instances=2)
    done = []
    cluster.on_finish = done.append
    for i in range(4):
        cluster.start(trace(f"t{i}", [200], prompt=10))
    cluster.schedule(0.05, cluster.remove_instance, 0)
    cluster.run_until(lambda: False)
    assert sorted(t.trajectory_id for t in done) == ["t0", "t1", "t2", "t3"]
    assert cluster.num_migrations >= 1  # the cut ones re-prefilled on instance 1
    assert sum(i.decoded_tokens for i in cluster.all_instances()) == pytest.approx(800, rel=1e-6)


def test_trajectories_that_found_no_ready_instance_run_once_instances_are_ready():
    """A re-plan that replaces every instance leaves a window with none ready: trajectories
    admitted (or back from a tool) in it wait unplaced, then run -- spread over every instance
    that became ready, not piled on the first one (once they were never run at all, and the
    simulated run stalled with its heap empty)."""
    cluster, _ = make_cluster(num_instances=1)
    done = []
    cluster.on_finish = done.append
    cluster.start(trace("early", [50, 50], prompt=10, tool_latency=0.2))
    cluster.schedule(0.01, cluster.remove_instance, 0)
    for i in range(1, 3):
        cluster.schedule(0.02, cluster.add_instance, f"new{i}", 1, 0, (i,), 1.0)
    for i in range(6):
        cluster.schedule(0.03, cluster.start, trace(f"t{i}", [40], prompt=10))
    cluster.run_until(lambda: False)
    assert sorted(t.trajectory_id for t in done) == ["early", *(f"t{i}" for i in range(6))]
    assert all(t.finished_at > 1.0 for t in done)
    assert sorted(inst.decoded_tokens > 0 for inst in cluster.instances.values()) == [True, True]


def test_an_instance_added_ready_takes_the_trajectories_a_removal_left_unplaced():
    """A re-plan that stops the only instance, then starts one that is ready at once (no start
    cost): the cut turn resumes there."""
    cluster, _ = make_cluster(num_instances=1)
    done = []
    cluster.on_finish = done.append
    cluster.start(trace("a", [100], prompt=10))
    cluster.schedule(0.01, cluster.remove_instance, 0)
    cluster.schedule(0.01, cluster.add_instance, "new", 1, 0, (1,), 0.0)
    cluster.run_until(lambda: False)
    assert [t.trajectory_id for t in done] == ["a"] and not cluster.unplaced


def test_bucket_update_moves_a_running_turn_and_keeps_its_tokens():
    """A re-plan relabels buckets: the router moves a trajectory whose path now points to the
    other bucket; its turn in flight is cut on the old instance and resumes on the new one with
    the tokens it had, and it finishes exactly once."""
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cmlfq = CmlfqConfig(
        buckets=(BucketConfig("a", 1, 1000), BucketConfig("b", 2, 100000)), max_queue_length=100
    )
    router = CmlfqRouter(cmlfq)
    cluster = RolloutCluster(router, cmlfq, cost, max_batch=256)
    cluster.add_instance("i0", 1, 0, (0,), ready_at=0.0)
    cluster.add_instance("i1", 1, 1, (1,), ready_at=0.0)
    # Teach the router: after this tool return, 500 output tokens remain.
    state = ToolReturnState.of("tool", ToolStatus.FAILURE, 20, cmlfq)
    for n in range(3):
        router.admit(f"learned{n}", "p0")
        router.on_tool_return(f"learned{n}", state, 100)
        router.on_finish(f"learned{n}", 600)
    done = []
    cluster.on_finish = done.append
    traj = cluster.start(trace("a", [100, 500], prompt=10, tool_latency=0.5))
    second_turn_starts = prefill(cost, 10) + 100 * step(cost, 1, 10) + 0.5
    middle = second_turn_starts + prefill(cost, 20, offset=110) + 250 * step(cost, 1, 130)
    cluster.schedule(middle, lambda: None)  # an event to stop at, halfway through the turn
    cluster.run_until(lambda: cluster.now >= middle)
    assert traj.turn == 1 and traj.instance == 0  # 500 left <= 1,000: the small bucket
    # The new plan: bucket 0 up to 200 remaining tokens; instance 0 stays there.
    moved = cluster.update_buckets((BucketConfig("a", 1, 200), BucketConfig("b", 2, 100000)), {0: 0, 1: 1})
    assert moved == 1 and traj.instance == 1 and 0 < traj.carried < 500
    cluster.run_until(lambda: False)
    assert [t.trajectory_id for t in done] == ["a"] and cluster.num_migrations == 1


def test_the_router_is_told_the_context_its_instance_holds():
    """At a tool return the router hears the context up to the turn's end (what a move would
    re-prefill beyond the return, which is prefilled wherever the next turn runs)."""
    cluster, _ = make_cluster()
    told = []
    on_tool_return = cluster.router.on_tool_return

    def spy(trajectory_id, state, generated_tokens, context_tokens=0):
        told.append((generated_tokens, context_tokens))
        return on_tool_return(trajectory_id, state, generated_tokens, context_tokens)

    cluster.router.on_tool_return = spy
    cluster.start(trace("a", [100, 50, 30], prompt=10, payload=20, tool_latency=0.5))
    cluster.run_until(lambda: False)
    assert told == [(100, 10 + 100), (150, 10 + 100 + 20 + 50)]


def _migrating_cluster(migration: str, second_devices: tuple[int, ...], bandwidth: float = 0.0):
    """`migrating_cluster` running one trajectory whose second turn migrates to i1."""
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cluster, _, _ = migrating_cluster(cost, migration, second_devices, bandwidth)
    done = []
    cluster.on_finish = done.append
    cluster.start(trace("a", [100, 500], prompt=10, payload=20, tool_latency=0.5))
    cluster.run_until(lambda: False)
    assert [t.trajectory_id for t in done] == ["a"] and cluster.num_migrations == 1
    return cluster, cost, done[0].finished_at


@pytest.mark.parametrize("second_devices, link", [((4, 5), "inter"), ((2, 3), "intra")])
def test_kv_move_pays_the_transfer_instead_of_the_re_prefill(second_devices, link):
    reprefill, cost, t_reprefill = _migrating_cluster("reprefill", second_devices)
    moved, _, t_moved = _migrating_cluster("kv_move", second_devices)
    m, profile = cost.model, cost.cluster.profile
    context = 10 + 100  # the prompt and turn 1's output, held by i0 when the tool returns
    kv_bytes = context * 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.bytes_per_param
    bandwidth = (
        profile.inter_node_bandwidth_bytes_per_s
        if link == "inter"
        else profile.intra_node_bandwidth_bytes_per_s
    )
    move_s = kv_bytes / (1 * bandwidth)  # min(TP-1, TP-2) = one link
    assert moved.migration_s == pytest.approx(move_s) and reprefill.migration_s == 0.0
    # Re-prefill: the whole context plus the tool return on i1; KV move: the transfer, then only
    # the tool return (attending to the moved KV).
    expected_gap = prefill(cost, context + 20, tp=2) - (move_s + prefill(cost, 20, tp=2, offset=context))
    assert t_reprefill - t_moved == pytest.approx(expected_gap, rel=1e-6)
    configured, _, _ = _migrating_cluster("kv_move", second_devices, bandwidth=1e9)
    assert configured.migration_s == pytest.approx(kv_bytes / 1e9)


def test_kv_move_from_a_stopped_instance_re_prefills():
    cluster, cost = make_cluster(num_instances=2)
    cluster.migration = "kv_move"
    for i in range(4):
        cluster.start(trace(f"t{i}", [200], prompt=10))
    cluster.schedule(0.05, cluster.remove_instance, 0)
    cluster.run_until(lambda: False)
    assert cluster.num_migrations >= 1 and cluster.migration_s == 0.0  # nothing left to move from


class KvSpy(LeastLoadRouter):
    """Least-load, recording every KV report."""

    def __init__(self, config: CmlfqConfig) -> None:
        super().__init__(config)
        self.reports: list[tuple[int, int, int]] = []

    def set_instance_kv(self, instance_id: int, used_tokens: int, capacity_tokens: int) -> None:
        self.reports.append((instance_id, used_tokens, capacity_tokens))
        super().set_instance_kv(instance_id, used_tokens, capacity_tokens)


def test_instances_report_held_and_queued_kv_to_the_router_when_it_changes():
    """With room for one sequence, the second waits: the report counts its context as demand.
    Ended turns stay in the prefix cache, which is evictable and not reported."""
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cmlfq = CmlfqConfig()
    router = KvSpy(cmlfq)
    cluster = RolloutCluster(router, cmlfq, cost, max_batch=1)
    inst = cluster.add_instance("i0", 1, 0, (0,), ready_at=0.0)
    capacity = inst.coefficients.token_capacity
    cluster.start(trace("a", [50], prompt=1000))
    cluster.start(trace("b", [50], prompt=2000))
    assert router.reports == [(0, 1000, capacity), (0, 3000, capacity)]
    cluster.run_until(lambda: not cluster.live)
    assert [used for _, used, _ in router.reports] == [1000, 3000, 2000, 0]
    assert inst.cached_tokens > 0


def test_a_derived_cap_follows_the_pool_as_instances_join_and_leave():
    """With the trajectories in flight given (the config's cap left 0), the cluster keeps the
    router's cap at their fair share per unit of the pool's weight (`fair_queue_length`), as the
    job's pool does: a plan that shrinks the pool raises it, one that grows it lowers it."""
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cmlfq = CmlfqConfig(
        buckets=(BucketConfig("a", 1, 1000), BucketConfig("b", 2, 100000)), max_queue_length=5
    )
    router = CmlfqRouter(cmlfq)
    cluster = RolloutCluster(router, cmlfq, cost, max_batch=64, trajectories_in_flight=120)
    w1, w2 = cost.router_weight(1), cost.router_weight(2)
    first = cluster.add_instance("i0", 1, 0, (0,), ready_at=0.0)
    assert router.config.max_queue_length == -(-120 // w1)
    cluster.add_instance("i1", 1, 0, (1,), ready_at=0.0)
    assert router.config.max_queue_length == max(3, -(-120 // (2 * w1)))
    # One still loading counts at once: the plan's pool, which the ready ones share the cap of.
    cluster.add_instance("i2", 2, 1, (2, 3), ready_at=5.0)
    assert router.config.max_queue_length == max(3, -(-120 // (2 * w1 + w2)))
    cluster.run_until(lambda: False)
    assert cluster.now == 5.0
    assert router.config.max_queue_length == max(3, -(-120 // (2 * w1 + w2)))
    cluster.remove_instance(first.instance_id)
    assert router.config.max_queue_length == max(3, -(-120 // (w1 + w2)))
    # A cap set by hand is kept.
    kept = CmlfqRouter(cmlfq)
    by_hand = RolloutCluster(kept, cmlfq, cost, max_batch=64)
    by_hand.add_instance("i0", 1, 0, (0,), ready_at=0.0)
    assert kept.config.max_queue_length == 5


def test_while_an_instance_loads_what_has_no_room_waits_and_takes_the_room_a_finish_frees():
    """The serving instance is full (cap 1) and another is loading: the second trajectory waits
    unplaced (it does not queue over the cap) and runs as soon as the first ends, long before the
    loading instance serves."""
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    cmlfq = CmlfqConfig(buckets=(BucketConfig("all", 1, 100_000),), max_queue_length=1)
    cluster = RolloutCluster(CmlfqRouter(cmlfq), cmlfq, cost, max_batch=64)
    serving = cluster.add_instance("serving", 1, 0, (0,), ready_at=0.0)
    cluster.add_instance("loading", 1, 0, (1,), ready_at=1000.0)
    done = {}
    cluster.on_finish = lambda t: done.__setitem__(t.trajectory_id, (t.finished_at, t.instance))
    cluster.start(trace("first", [100], prompt=10))
    cluster.start(trace("second", [50], prompt=10))
    assert len(cluster.unplaced) == 1
    cluster.run_until(lambda: len(done) == 2)
    (first_at, first_on), (second_at, second_on) = done["first"], done["second"]
    assert first_on == second_on == serving.instance_id
    assert first_at < second_at < 1000.0
