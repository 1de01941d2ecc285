"""Qwen3-4B on R2E-style tasks, 2 nodes x 8 H100 80GB: the smaller sibling of
`configs/qwen3_14b_r2e.py` (same task, turns, context and sampling; the original Libra's R2E
settings, `reference/libra-notes.md` §7), on a third of the devices. Run with

    bash scripts/launch_cuda.sh configs/qwen3_4b_r2e.py RUN_DIR job.model=/path/to/Qwen3-4B \
        tasks.dataset_path=/path/to/r2e_tasks.jsonl

No issue-validator tool exists in Libra: the model gets the sandboxed Python interpreter, and the
reward runs each task's tests after the model's last code block.
"""

from libra.backends.config import BackendConfig
from libra.config import LibraConfig
from libra.control.config import ControlConfig
from libra.job.config import JobConfig
from libra.planner.config import ModelArch, PlannerConfig, TriggerPolicy
from libra.rollout.config import AgentLoopConfig, InstanceConfig, RolloutConfig
from libra.rollout.tools.config import SandboxConfig, ToolsConfig
from libra.scheduler.config import BucketConfig, CmlfqConfig
from libra.tasks.config import TasksConfig
from libra.training.config import GrpoConfig, TrainingConfig

# Qwen3-4B's config.json: 36 layers, 32 query / 8 KV heads of 128, 40,960 positions, tied
# embeddings.
MODEL = ModelArch(
    num_layers=36,
    hidden_size=2560,
    num_attention_heads=32,
    num_kv_heads=8,
    ffn_hidden_size=9728,
    vocab_size=151936,
    head_dim=128,
    num_params=4_020_000_000,
)
MODEL_MAX_POSITIONS = 40960
NUM_NODES = 2
DEVICES_PER_NODE = 8

# One node trains (TP2 keeps a 32K-token micro-batch's activations within 80 GB; DP4 for
# throughput); the other serves rollouts: four TP1 instances for the many short trajectories, two
# TP2 for the long tail (a 4B model gains too little from TP4 to give it half a node).
TRAIN_TP, TRAIN_DP = 2, 4
ROLLOUT_TP_SIZES = (1, 1, 1, 1, 2, 2)
# 128 trajectories a step like the 14B setting, in groups of 8: a smaller model solves fewer
# issues, and larger groups keep groups with some reward variance.
PROMPTS_PER_STEP, GROUP_SIZE = 16, 8
TEMPERATURE = 0.8


def config() -> LibraConfig:
    return LibraConfig(
        run_dir="runs/qwen3-4b-r2e",
        job=JobConfig(
            model="/models/Qwen3-4B",
            num_steps=100,
            prompts_per_step=PROMPTS_PER_STEP,
            group_size=GROUP_SIZE,
            rollout_tp_sizes=ROLLOUT_TP_SIZES,
            checkpoint_interval=10,
            spawn_agent=False,
            num_agents=NUM_NODES,
            worker_start_timeout_s=1200.0,
        ),
        # The original's R2E thresholds with its medium and long buckets merged into TP2 (the
        # largest TP size here); payload classes as in the 14B setting.
        scheduler=CmlfqConfig(
            buckets=(
                BucketConfig("short", tp_size=1, max_remaining_tokens=4000),
                BucketConfig("long", tp_size=2, max_remaining_tokens=30000),
            ),
            small_payload_max_tokens=1000,
            medium_payload_max_tokens=12000,
        ),
        control=ControlConfig(port=0),
        backend=BackendConfig(name="cuda"),
        planner=PlannerConfig(policy=TriggerPolicy(plan_interval=5)),
        rollout=RolloutConfig(
            # The accelerator engine as the backend sets it, stated: graphs for the long tail's
            # small-batch decode, 90 % of each device (rollout devices hold no train rank), chunked
            # prefills.
            instance=InstanceConfig(
                dtype="bfloat16",
                max_model_len=32768,
                max_num_seqs=128,
                enforce_eager=False,
                gpu_memory_utilization=0.9,
                chunked_prefill=True,
            ),
            agent=AgentLoopConfig(
                max_turns=12,
                max_response_tokens=30000,
                max_tokens_per_turn=8192,
                temperature=TEMPERATURE,
                top_p=0.95,
                max_tool_result_chars=16384,
                tool_timeout_s=120.0,
            ),
        ),
        tools=ToolsConfig(
            enabled=["python"],
            max_result_chars=16384,
            sandbox=SandboxConfig(num_workers=32, timeout_s=60.0, cpu_time_s=60.0, memory_mb=4096),
        ),
        tasks=TasksConfig(dataset_path="data/r2e_tasks.jsonl", dataset_shape="r2e_gym"),
        training=TrainingConfig(
            tensor_parallel=TRAIN_TP,
            data_parallel=TRAIN_DP,
            dtype="bfloat16",
            # Megatron's path: fp32 main parameters and Adam state sharded over DP (ZeRO-1), the
            # DP reduction overlapped with backward, whole layers recomputed (long contexts).
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            recompute="full",
            lr=1e-6,
            max_staleness=2,
            max_tokens_per_microbatch=32768,
            grpo=GrpoConfig(clip_low=0.2, clip_high=0.28, temperature=TEMPERATURE),
        ),
    )
