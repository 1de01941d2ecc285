"""Qwen2.5-7B-Instruct on DAPO-Math-17k with a code interpreter (tool-integrated math, as in verl's
ReTool recipe), 2 nodes x 8 H100 80GB. Run with

    bash scripts/launch_cuda.sh configs/qwen25_7b_dapo.py RUN_DIR \
        job.model=/path/to/Qwen2.5-7B-Instruct tasks.dataset_path=/path/to/dapo-math-17k.parquet

Records are DAPO-Math-17k's (`dapo_math` shape); the reward compares the final `Answer:` (or
`\\boxed{}`) with the ground truth after normalisation (`libra.tasks.rewards.math_reward`).
The DAPO numbers below (clip-higher 0.2/0.28, token-mean loss, dynamic sampling, 16 responses a
prompt, lr 1e-6, temperature 1) are the DAPO paper's and verl's DAPO recipe's.
"""

from libra.backends.config import BackendConfig
from libra.config import LibraConfig
from libra.control.config import ControlConfig
from libra.job.config import JobConfig
from libra.planner.config import ModelArch
from libra.rollout.config import AgentLoopConfig, InstanceConfig, RolloutConfig
from libra.rollout.tools.config import SandboxConfig, ToolsConfig
from libra.scheduler.config import BucketConfig, CmlfqConfig
from libra.tasks.config import TasksConfig
from libra.training.config import GrpoConfig, TrainingConfig

# Qwen2.5-7B-Instruct's config.json: 28 layers, 28 query / 4 KV heads of 128, 32,768 positions.
# 28 heads and 4 KV heads allow TP 1, 2 or 4 only (TP8 would split a head).
MODEL = ModelArch(
    num_layers=28,
    hidden_size=3584,
    num_attention_heads=28,
    num_kv_heads=4,
    ffn_hidden_size=18944,
    vocab_size=152064,
    head_dim=128,
    num_params=7_620_000_000,
)
MODEL_MAX_POSITIONS = 32768
NUM_NODES = 2
DEVICES_PER_NODE = 8

# One node trains at TP4 x DP2; the other serves two TP2 instances and one TP4.
TRAIN_TP, TRAIN_DP = 4, 2
ROLLOUT_TP_SIZES = (2, 2, 4)
# DAPO samples 16 responses a prompt; 32 prompts a step (DAPO takes 512 for its 32B model;
# scaled down to 16 devices).
PROMPTS_PER_STEP, GROUP_SIZE = 32, 16


def config() -> LibraConfig:
    return LibraConfig(
        run_dir="runs/qwen25-7b-dapo",
        job=JobConfig(
            model="/models/Qwen2.5-7B-Instruct",
            num_steps=300,
            prompts_per_step=PROMPTS_PER_STEP,
            group_size=GROUP_SIZE,
            rollout_tp_sizes=ROLLOUT_TP_SIZES,
            checkpoint_interval=20,
            spawn_agent=False,
            num_agents=NUM_NODES,
            worker_start_timeout_s=1200.0,
        ),
        # The original's DAPO-Math buckets are TP2 at 3,000 and 6,000 remaining tokens and TP4 at
        # 32,768 (`reference/libra-notes.md` §4); Libra maps a TP size to one bucket, so its two
        # TP2 buckets are one here, at the larger threshold. Math tool results are small.
        scheduler=CmlfqConfig(
            buckets=(
                BucketConfig("short", tp_size=2, max_remaining_tokens=6000),
                BucketConfig("long", tp_size=4, max_remaining_tokens=32768),
            ),
            small_payload_max_tokens=500,
            medium_payload_max_tokens=5000,
        ),
        control=ControlConfig(port=0),
        backend=BackendConfig(name="cuda"),
        rollout=RolloutConfig(
            # Prompts up to 2K tokens (DAPO's max prompt length) plus 16K of response.
            # The accelerator engine as the backend sets it, stated: graphs for the long tail's
            # small-batch decode, 90 % of each device (rollout devices hold no train rank), chunked
            # prefills.
            instance=InstanceConfig(
                dtype="bfloat16",
                max_model_len=18432,
                max_num_seqs=256,
                enforce_eager=False,
                gpu_memory_utilization=0.9,
                chunked_prefill=True,
            ),
            # Up to 8 assistant turns with code execution (verl's ReTool recipe).
            agent=AgentLoopConfig(
                max_turns=8,
                max_response_tokens=16384,
                max_tokens_per_turn=8192,
                temperature=1.0,
                top_p=1.0,
                max_tool_result_chars=4096,
                tool_timeout_s=30.0,
            ),
        ),
        tools=ToolsConfig(
            enabled=["python"],
            max_result_chars=4096,
            # Math snippets are short: a 10 s limit, many workers for 512 concurrent trajectories.
            sandbox=SandboxConfig(num_workers=64, timeout_s=10.0, cpu_time_s=10.0, memory_mb=2048),
        ),
        tasks=TasksConfig(dataset_path="data/dapo-math-17k.parquet", dataset_shape="dapo_math"),
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
            weight_decay=0.1,  # DAPO's
            # One step of overlap, like verl's one-step-off-policy DAPO runs.
            max_staleness=1,
            max_tokens_per_microbatch=18432,
            # DAPO takes several optimizer steps per rollout batch (mini-batches of 512 responses);
            # 512 trajectories a step here, so 4 mini-batches of 128.
            num_minibatches=4,
            dynamic_sampling=True,
            grpo=GrpoConfig(clip_low=0.2, clip_high=0.28, loss_aggregation="token_mean", temperature=1.0),
        ),
    )
