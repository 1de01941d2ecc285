"""Small simulation configs and hand-made traces for the simulator's tests."""

from __future__ import annotations

from libra.planner.config import ModelArch, PlannerConfig, SearchConfig, TrainingBatch, TriggerPolicy
from libra.planner.rollout_cost import RolloutCostModel
from libra.scheduler.cmlfq import CmlfqRouter
from libra.scheduler.config import BucketConfig, CmlfqConfig
from libra.scheduler.tool_state import ToolReturnState
from libra.sim.config import MovementCosts, SimConfig
from libra.sim.engine import RolloutCluster
from libra.sim.instance import Instance
from libra.sim.workloads import WorkloadConfig
from libra.trace import TrajectoryTrace, TurnTrace
from libra.trajectory import ToolStatus

SMALL_MODEL = ModelArch(
    num_layers=16,
    hidden_size=2048,
    num_attention_heads=16,
    num_kv_heads=4,
    ffn_hidden_size=5632,
    vocab_size=32000,
)


def tiny_config(**overrides) -> SimConfig:
    """2 nodes x 4 A800, a ~1.5B model, 16 trajectories per step, 4 steps: runs in ~0.1 s/policy."""
    fields = dict(
        name="tiny",
        profile="a800",
        num_nodes=2,
        devices_per_node=4,
        model=SMALL_MODEL,
        batch=TrainingBatch(global_batch=16, group_size=4, max_staleness=1),
        workload=WorkloadConfig(name="r2e", group_size=4, num_prompts=50),
        planner=PlannerConfig(
            search=SearchConfig(rollout_tp_sizes=(1, 2, 4)), policy=TriggerPolicy(plan_interval=2)
        ),
        costs=MovementCosts(),
        num_steps=4,
        history_size=64,
        fixed_node_pattern=(1, 1, 2),
        fixed_train_fraction=0.5,
    )
    fields.update(overrides)
    return SimConfig(**fields)


def trace(
    trajectory_id: str,
    outputs: list[int],
    prompt: int = 10,
    tool_latency: float = 1.0,
    payload: int = 20,
    group: str = "g0",
    prompt_id: str = "p0",
) -> TrajectoryTrace:
    """A trajectory of len(outputs) turns; every turn but the last calls `tool`."""
    turns = [TurnTrace(o, "tool", payload, ToolStatus.FAILURE, tool_latency) for o in outputs[:-1]]
    turns.append(TurnTrace(outputs[-1]))
    return TrajectoryTrace(trajectory_id, prompt_id, group, prompt, tuple(turns))


def migrating_cluster(
    cost: RolloutCostModel, migration: str, second_devices: tuple[int, ...] = (2, 3), bandwidth: float = 0.0
) -> tuple[RolloutCluster, Instance, Instance]:
    """i0 (TP-1, device 0) serves short paths, i1 (TP-2) long ones; the router has learnt that
    after a failing tool return of 20 tokens 500 tokens remain, so a trajectory's turn after one
    migrates from i0 to i1."""
    cmlfq = CmlfqConfig(
        buckets=(BucketConfig("a", 1, 100), BucketConfig("b", 2, 100000)), max_queue_length=100
    )
    router = CmlfqRouter(cmlfq)
    cluster = RolloutCluster(
        router, cmlfq, cost, max_batch=256, migration=migration, kv_move_bandwidth_bytes_per_s=bandwidth
    )
    i0 = cluster.add_instance("i0", 1, 0, (0,), ready_at=0.0)
    i1 = cluster.add_instance("i1", 2, 1, second_devices, ready_at=0.0)
    state = ToolReturnState.of("tool", ToolStatus.FAILURE, 20, cmlfq)
    for n in range(3):
        router.admit(f"learned{n}", "p0")
        router.on_tool_return(f"learned{n}", state, 100)
        router.on_finish(f"learned{n}", 600)
    return cluster, i0, i1
