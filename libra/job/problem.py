"""The global planner's problem as the job sees it before launch: the model (from its HF config),
the cluster (from the backend and `job.num_agents`), the batch (from the job and training
config) and the elastic hybrid pool's limits (`libra.training.hybrid`); and each finished
trajectory's trace as one request of the planner's history.

Kept apart from the planner in the loop (`planning`, which drives the launch's `JobWorkers`), so
that the launch (`setup`) builds the problem without importing `planning`: no import cycle.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from libra.config import LibraConfig
from libra.model_spec import DTYPE_BYTES, ModelSpec
from libra.planner.config import ClusterSpec, ModelArch, PlanningProblem, RequestRecord, TrainingBatch
from libra.planner.plan import Plan
from libra.planner.search import NoFeasiblePlan, search
from libra.training.hybrid import HYBRID_POOL_LIMITS


def model_arch(model_dir: Path, dtype: str) -> ModelArch:
    """The planner's view of an HF model folder, at the instances' dtype."""
    spec = ModelSpec.from_hf_dir(model_dir)
    return ModelArch.from_spec(spec, DTYPE_BYTES.get(dtype if dtype != "auto" else spec.dtype or "", 2))


def cluster_spec(devices_per_agent: int, num_agents: int, profile) -> ClusterSpec:
    """Planner nodes of the largest power of two that divides an agent's devices: an agent of a
    power of two is one node (the 4-slot CPU default: one node of 4), one of 6 is three nodes of 2,
    one of 3 three nodes of 1 (rollout and training TP 1 only). That keeps the planner's numbering
    (node-major, device d = the d-th device of the agents laid end to end)."""
    if devices_per_agent < 1:
        raise ValueError(f"an agent must hold at least one device, got {devices_per_agent}")
    node = devices_per_agent & -devices_per_agent
    return ClusterSpec(num_agents * devices_per_agent // node, node, profile)


def planning_problem(config: LibraConfig, model_dir: Path) -> PlanningProblem:
    """The job's planning problem before launch. The cluster is sized from the backend (its
    devices per agent, `job.num_agents` agents); the history is one seed request (a turn at the
    per-turn cap) that the measured trajectories replace before the first search can run (the
    policy's `min_history`)."""
    from libra.backends import get_backend

    job = config.job
    backend = get_backend(config.backend.name, **config.backend.options())
    profile = backend.hardware_profile()
    engine = config.rollout.instance.for_backend(backend)
    cluster = cluster_spec(profile.devices_per_node, job.num_agents, profile)
    turn = config.rollout.agent.max_tokens_per_turn
    return PlanningProblem(
        cluster=cluster,
        model=model_arch(model_dir, config.rollout.instance.dtype),
        # One micro-batch size: the trainer forms token-balanced micro-batches itself, and a
        # plan that differed from the running one only in it would need a training restart.
        batch=TrainingBatch(
            global_batch=job.batch_size,
            group_size=job.group_size,
            micro_batch_sizes=(1,),
            distributed_optimizer=config.training.use_distributed_optimizer,
            recompute=config.training.recompute,
            max_staleness=config.training.max_staleness,
            tail_staleness=config.training.tail_staleness,
        ),
        history=(RequestRecord(turn, turn),),
        config=dataclasses.replace(
            config.planner,
            # What `libra.training.hybrid` pairs: training grows past it by a restart.
            hybrid_pool=HYBRID_POOL_LIMITS,
            # The engines' own sizes: what they batch and the KV they hold.
            max_decode_batch=engine.max_num_seqs,
            rollout_memory_utilization=engine.gpu_memory_utilization,
            rollout_kv_bytes_per_device=None if engine.kv_cache_gib is None else engine.kv_cache_gib * 2**30,
        ),
    )


def planned_rollout_sizes(config: LibraConfig, problem: PlanningProblem) -> tuple[tuple[int, ...], Plan]:
    """The rollout instances' TP sizes the planner chooses for the launch (`job.rollout_tp_sizes`
    empty), largest first, and its plan: its search on the devices the job's training takes
    (`training.world_size`, fixed) leaves to rollout, among the TP sizes that have a C-MLFQ
    bucket (on the CPU default: three TP-1 instances rather than TP-2 + TP-1, where a TP-2
    instance is no faster, `PLATFORM.md`)."""
    train = config.training.world_size
    rollout = problem.cluster.num_devices - train
    bucket_sizes = {b.tp_size for b in config.scheduler.buckets}
    sizes = tuple(k for k in problem.config.search.rollout_tp_sizes if k in bucket_sizes)
    if rollout < 1 or not sizes:
        raise ValueError(
            f"job.rollout_tp_sizes is empty (planned) but there is nothing to plan: {rollout} devices "
            f"left after training's {train}, bucket TP sizes {sorted(bucket_sizes)} against the "
            f"planner's {list(problem.config.search.rollout_tp_sizes)}; set job.rollout_tp_sizes"
        )
    space = dataclasses.replace(
        problem.config.search, rollout_tp_sizes=sizes, min_train_devices=train, min_rollout_devices=rollout
    )
    try:
        plan = search(dataclasses.replace(problem, config=dataclasses.replace(problem.config, search=space)))
    except NoFeasiblePlan as e:
        raise ValueError(
            f"job.rollout_tp_sizes is empty (planned) but the planner found no layout: {e}; "
            "set job.rollout_tp_sizes"
        ) from e
    return tuple(sorted((i.tp for i in plan.instances), reverse=True)), plan
