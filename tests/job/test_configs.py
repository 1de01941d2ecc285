"""Every file in configs/ loads through its own loader, and every job config (`libra run`) is
consistent: its parts agree with each other, its cluster holds its workers, and its parallel
sizes and context fit its model (the facts each GPU config states in `MODEL` and
`MODEL_MAX_POSITIONS`, from the model's config.json). A bad value gives an error naming the
field and the allowed values.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.config import LibraConfig, load_config, load_definitions, load_from_file
from libra.job.loop import GrpoJob
from libra.job.rollouts import TOOLS_BY_TASK_TYPE
from libra.planner.config import PlanningProblem
from libra.sim.config import load_sim_config
from libra.tasks.datasets import TaskType

CONFIGS = sorted(Path("configs").glob("*.py"))
JOB_CONFIGS = [p for p in CONFIGS if "def config()" in p.read_text()]
GPU_JOB_CONFIGS = ["qwen3_4b_r2e", "qwen3_14b_r2e", "qwen25_7b_dapo", "search_r1"]
TASK_TYPE_OF_SHAPE = {
    "dapo_math": TaskType.MATH,
    "search_r1": TaskType.RETRIEVAL_QA,
    "r2e_gym": TaskType.CODE,
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def consistency_problems(path: Path, config: LibraConfig) -> list[str]:
    """What is inconsistent in a job config, each naming the field to change."""
    facts = load_definitions(path)  # what the file states beside config(): MODEL, NUM_NODES, ...
    job = config.job
    problems = []
    training, instance, agent = config.training, config.rollout.instance, config.rollout.agent
    # Devices: the train ranks and every rollout instance's TP size must fit the cluster.
    if config.backend.name == "cpu":
        devices = config.backend.num_devices
    else:
        devices = facts["NUM_NODES"] * facts["DEVICES_PER_NODE"]
        if job.num_agents != facts["NUM_NODES"]:
            problems.append(
                f"job.num_agents ({job.num_agents}) must be the number of nodes ({facts['NUM_NODES']})"
            )
    needed = training.world_size + sum(job.rollout_tp_sizes)
    if devices is not None and needed > devices:
        problems.append(
            f"training (TP x PP x DP = {training.world_size}) + job.rollout_tp_sizes "
            f"({job.rollout_tp_sizes}) need {needed} devices, the cluster has {devices}"
        )
    if not agent.max_tokens_per_turn <= agent.max_response_tokens < instance.max_model_len:
        problems.append(
            "rollout.agent.max_tokens_per_turn <= rollout.agent.max_response_tokens < "
            f"rollout.instance.max_model_len must hold, got {agent.max_tokens_per_turn}, "
            f"{agent.max_response_tokens}, {instance.max_model_len}"
        )
    # Datasets: a model to train, and the tools their task type needs.
    if config.tasks.dataset_path is not None:
        if not job.model:
            problems.append("job.model must name the HF model folder when tasks.dataset_path is set")
        task_type = TASK_TYPE_OF_SHAPE.get(config.tasks.dataset_shape)
        offered = [*config.tools.enabled, *(custom.name for custom in config.tools.custom)]
        missing = [t for t in TOOLS_BY_TASK_TYPE.get(task_type, ()) if t not in offered]
        if missing:
            problems.append(
                f"tools.enabled ({config.tools.enabled}) lacks {missing} for {config.tasks.dataset_shape}"
            )
    model = facts.get("MODEL")
    if model is None:
        return problems
    # The model: Megatron splits query and KV heads over TP; vLLM splits query heads and splits
    # or replicates KV heads; PP splits the layers; the context fits the positions.
    heads, kv_heads = model.num_attention_heads, model.num_kv_heads
    train_tp_allowed = [d for d in _divisors(heads) if kv_heads % d == 0]
    if training.tensor_parallel not in train_tp_allowed:
        problems.append(
            f"training.tensor_parallel ({training.tensor_parallel}) must be one of {train_tp_allowed}"
        )
    if model.num_layers % training.pipeline_parallel:
        problems.append(
            f"training.pipeline_parallel ({training.pipeline_parallel}) must divide the "
            f"{model.num_layers} layers"
        )
    rollout_tp_allowed = [d for d in _divisors(heads) if kv_heads % d == 0 or d % kv_heads == 0]
    bad = sorted({tp for tp in job.rollout_tp_sizes if tp not in rollout_tp_allowed})
    if bad:
        problems.append(f"job.rollout_tp_sizes has {bad}; allowed TP sizes are {rollout_tp_allowed}")
    if instance.max_model_len > facts["MODEL_MAX_POSITIONS"]:
        problems.append(
            f"rollout.instance.max_model_len ({instance.max_model_len}) exceeds the model's "
            f"{facts['MODEL_MAX_POSITIONS']} positions"
        )
    return problems


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_file_loads(path):
    text = path.read_text()
    if "def config()" in text:
        GrpoJob(load_config(path))  # the job's own checks
    elif "def sim_config()" in text:
        load_sim_config(path)
    else:
        assert "def planning_problem()" in text, f"{path}: no loader knows this file"
        load_from_file(path, "planning_problem", PlanningProblem)


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=[p.stem for p in JOB_CONFIGS])
def test_every_job_config_is_consistent(path):
    assert consistency_problems(path, load_config(path)) == []


def test_the_gpu_configs_are_real_cluster_configs():
    for name in GPU_JOB_CONFIGS:
        path = Path("configs") / f"{name}.py"
        config = load_config(path)
        job = config.job
        assert config.backend.name == "cuda" and not job.spawn_agent
        assert config.training.dtype == "bfloat16" and config.rollout.instance.dtype == "bfloat16"
        # Megatron's production path: fp32 main parameters and Adam state sharded over DP.
        assert config.training.use_distributed_optimizer and config.training.overlap_grad_reduce
        assert config.tasks.dataset_path and job.model
        # Heterogeneous TP buckets: the point of C-MLFQ.
        assert len(set(job.rollout_tp_sizes)) >= 2 and len(config.scheduler.buckets) >= 2
        facts = load_definitions(path)
        devices = facts["NUM_NODES"] * facts["DEVICES_PER_NODE"]
        # The cluster is used whole: what the trainer does not take serves rollouts.
        assert config.training.world_size + sum(job.rollout_tp_sizes) == devices


@pytest.mark.parametrize(
    ("name", "override", "message"),
    [
        (
            "qwen3_14b_r2e",
            "job.router=fastest",
            "job.router must be one of ('cmlfq', 'least_load', 'round_robin')",
        ),
        (
            "qwen3_4b_r2e",
            "job.rollout_tp_sizes=1,8",
            "job.rollout_tp_sizes has TP sizes [8] without a bucket; scheduler.buckets have TP sizes [1, 2]",
        ),
        (
            "qwen25_7b_dapo",
            "tasks.dataset_shape=gsm8k",
            "tasks.dataset_shape must be one of "
            "('auto', 'libra', 'dapo_math', 'verl', 'search_r1', 'r2e_gym')",
        ),
        (
            "search_r1",
            "rollout.instance.dtype=int8",
            "rollout.instance.dtype must be float32, bfloat16, float16 or auto",
        ),
        ("search_r1", "tasks.qa_metric=bleu", "tasks.qa_metric must be em or f1"),
        ("qwen3_14b_r2e", "training.grpo.loss_aggregation=sum", "must be token_mean or sequence_mean"),
        ("qwen25_7b_dapo", "rollout.agent.temperature=0.7", "must equal rollout.agent.temperature"),
        (
            "qwen3_4b_r2e",
            "training.staleness_mode=never",
            "training.staleness_mode must be one of ('wait', 'drop', 'budget')",
        ),
        ("qwen3_4b_r2e", "endpoint.agent=no_colon", "endpoint.agent must be 'package.module:function'"),
    ],
)
def test_a_bad_value_names_the_field_and_the_allowed_values(name, override, message):
    with pytest.raises(ValueError) as error:
        load_config(Path("configs") / f"{name}.py", [override])
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("name", "override", "message"),
    [
        # Qwen2.5-7B has 28 query and 4 KV heads: TP8 would split them unevenly.
        (
            "qwen25_7b_dapo",
            "training.tensor_parallel=8",
            "training.tensor_parallel (8) must be one of [1, 2, 4]",
        ),
        ("qwen3_14b_r2e", "rollout.instance.max_model_len=65536", "exceeds the model's 40960 positions"),
        ("qwen3_14b_r2e", "training.data_parallel=8", "need 80 devices, the cluster has 48"),
        ("qwen3_4b_r2e", "training.pipeline_parallel=5", "must divide the 36 layers"),
        ("search_r1", "tools.enabled=python", "lacks ['retrieve'] for search_r1"),
    ],
)
def test_an_inconsistent_config_is_named(name, override, message):
    path = Path("configs") / f"{name}.py"
    config = load_config(path, [override])
    assert any(message in problem for problem in consistency_problems(path, config))
