"""Qwen3-14B on R2E-style tasks (an issue and tests the fix must pass), 6 nodes x 8 A800 80GB: the
setting of the original Libra's main experiment (`reference/libra-notes.md` §7, its configs
`r2e_gym_qwen3_14b_mcore_gpu_6node48_*`). Run with the CUDA launcher:

    bash scripts/launch_cuda.sh configs/qwen3_14b_r2e.py RUN_DIR job.model=/path/to/Qwen3-14B \
        tasks.dataset_path=/path/to/r2e_tasks.jsonl

Tasks are `r2e_gym` records (`libra.tasks.datasets`): the reward runs the task's tests after the
model's last code block in the sandbox. The original's R2E workflow gives the model an issue
validator tool; Libra has none, so the model gets the sandboxed Python interpreter instead.
"""

from libra.backends.config import BackendConfig
from libra.config import LibraConfig
from libra.control.config import ControlConfig
from libra.job.config import JobConfig
from libra.planner.config import QWEN3_14B, PlannerConfig, TriggerPolicy
from libra.rollout.config import AgentLoopConfig, InstanceConfig, RolloutConfig
from libra.rollout.tools.config import SandboxConfig, ToolsConfig
from libra.scheduler.config import BucketConfig, CmlfqConfig
from libra.tasks.config import TasksConfig
from libra.training.config import GrpoConfig, TrainingConfig

# Qwen3-14B's config.json: 40 layers, 40 query / 8 KV heads of 128, 40,960 positions (32,768
# native context plus room for output; 131,072 needs YaRN, not used here).
MODEL = QWEN3_14B
MODEL_MAX_POSITIONS = 40960
NUM_NODES = 6
DEVICES_PER_NODE = 8

# The original's 48-GPU layout: 4 nodes train at Megatron TP8 x DP4; each of the 2 rollout nodes
# holds TP1, TP1, TP2 and TP4 instances.
TRAIN_TP, TRAIN_DP = 8, 4
ROLLOUT_TP_SIZES = (1, 1, 2, 4, 1, 1, 2, 4)
# 128 trajectories a step in groups of 4, staleness 2: configs/planner_qwen3_14b_48xa800.py and
# configs/sim_r2e_48xa800.py (the same setting).
PROMPTS_PER_STEP, GROUP_SIZE = 32, 4
# The original's R2E sampling: temperature 0.8, top-p 0.95.
TEMPERATURE = 0.8


def config() -> LibraConfig:
    return LibraConfig(
        run_dir="runs/qwen3-14b-r2e",
        job=JobConfig(
            model="/models/Qwen3-14B",
            num_steps=100,  # the original's R2E runs
            prompts_per_step=PROMPTS_PER_STEP,
            group_size=GROUP_SIZE,
            rollout_tp_sizes=ROLLOUT_TP_SIZES,
            checkpoint_interval=10,
            spawn_agent=False,
            num_agents=NUM_NODES,
            # Loading 14B weights from a shared filesystem takes minutes.
            worker_start_timeout_s=1800.0,
        ),
        # The original's 48-GPU R2E buckets and payload classes (`reference/libra-notes.md` §4).
        scheduler=CmlfqConfig(
            buckets=(
                BucketConfig("short", tp_size=1, max_remaining_tokens=4000),
                BucketConfig("medium", tp_size=2, max_remaining_tokens=12000),
                BucketConfig("long", tp_size=4, max_remaining_tokens=30000),
            ),
            small_payload_max_tokens=1000,
            medium_payload_max_tokens=12000,
        ),
        control=ControlConfig(port=0),
        backend=BackendConfig(name="cuda"),
        # The original re-plans every 5 steps in its 48-GPU experiment.
        planner=PlannerConfig(policy=TriggerPolicy(plan_interval=5)),
        rollout=RolloutConfig(
            # 32K context, 30K new tokens over up to 12 turns (the original's R2E settings).
            # The accelerator engine as the backend sets it, stated: graphs for the long tail's
            # small-batch decode, 90 % of each device (rollout devices hold no train rank), chunked
            # prefills.
            instance=InstanceConfig(
                dtype="bfloat16",
                max_model_len=32768,
                max_num_seqs=64,
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
                # Test runs print long tracebacks (the original's payload classes reach 12K tokens).
                max_tool_result_chars=16384,
                tool_timeout_s=120.0,
            ),
        ),
        tools=ToolsConfig(
            enabled=["python"],
            max_result_chars=16384,
            # Test suites import more and run longer than math snippets.
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
            lr=1e-6,  # the original's R2E learning rate
            max_staleness=2,
            # One full 32K trajectory per micro-batch per rank.
            max_tokens_per_microbatch=32768,
            num_minibatches=1,
            # DAPO's clip-higher; token-mean aggregation (DAPO, and verl's default).
            grpo=GrpoConfig(clip_low=0.2, clip_high=0.28, temperature=TEMPERATURE),
        ),
    )
