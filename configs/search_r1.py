"""Search-R1: Qwen3-14B answering NQ / HotpotQA questions with a retrieval tool, 6 nodes x 8 H200:
the original Libra's Search-R1 setting (`reference/libra-notes.md` §4 and §7: 16 rollout GPUs in
TP2/TP2/TP4/TP8, 40,960-token context) with the batch of `configs/sim_search_r1_48xh200.py`.
Run with

    bash scripts/launch_cuda.sh configs/search_r1.py RUN_DIR job.model=/path/to/Qwen3-14B \
        tasks.dataset_path=/path/to/nq_hotpotqa_train.parquet tools.retrieval_corpus=/path/to/wiki.jsonl

Records are Search-R1's (`search_r1` shape: question + golden answers); the reward is the exact
match of the final `<answer>` with any golden answer (Search-R1's rule). `retrieve` is Libra's
BM25 over a JSONL collection, top 3 passages a search as in Search-R1 (which retrieves from a
2018 Wikipedia dump, by default with a dense E5 index). The BM25 index is built in the
controller's memory: give it a collection that fits there, or serve a full dump from a retrieval
server registered as a custom tool (`tools.custom`, an HTTP or gRPC endpoint).
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

# Qwen3-14B's config.json (see configs/qwen3_14b_r2e.py).
MODEL = QWEN3_14B
MODEL_MAX_POSITIONS = 40960
NUM_NODES = 6
DEVICES_PER_NODE = 8

# 4 nodes train at TP8 x DP4, 2 nodes serve TP2, TP2, TP4 and TP8 instances (the original's layout).
TRAIN_TP, TRAIN_DP = 8, 4
ROLLOUT_TP_SIZES = (2, 2, 4, 8)
# 256 trajectories a step in groups of 8, staleness 2 (configs/sim_search_r1_48xh200.py).
PROMPTS_PER_STEP, GROUP_SIZE = 32, 8


def config() -> LibraConfig:
    return LibraConfig(
        run_dir="runs/search-r1",
        job=JobConfig(
            model="/models/Qwen3-14B",
            num_steps=100,
            prompts_per_step=PROMPTS_PER_STEP,
            group_size=GROUP_SIZE,
            rollout_tp_sizes=ROLLOUT_TP_SIZES,
            checkpoint_interval=10,
            spawn_agent=False,
            num_agents=NUM_NODES,
            worker_start_timeout_s=1800.0,
        ),
        # The original's Search-R1 buckets; retrieved passages are small payloads.
        scheduler=CmlfqConfig(
            buckets=(
                BucketConfig("short", tp_size=2, max_remaining_tokens=5000),
                BucketConfig("medium", tp_size=4, max_remaining_tokens=15000),
                BucketConfig("long", tp_size=8, max_remaining_tokens=40960),
            ),
            small_payload_max_tokens=500,
            medium_payload_max_tokens=5000,
        ),
        control=ControlConfig(port=0),
        backend=BackendConfig(name="cuda"),
        planner=PlannerConfig(policy=TriggerPolicy(plan_interval=5)),
        rollout=RolloutConfig(
            # The original's 40,960-token context (all of Qwen3's positions).
            # The accelerator engine as the backend sets it, stated: graphs for the long tail's
            # small-batch decode, 90 % of each device (rollout devices hold no train rank), chunked
            # prefills.
            instance=InstanceConfig(
                dtype="bfloat16",
                max_model_len=40960,
                max_num_seqs=128,
                enforce_eager=False,
                gpu_memory_utilization=0.9,
                chunked_prefill=True,
            ),
            # Many short turns: a search, three passages back, and so on, then a short answer.
            agent=AgentLoopConfig(
                max_turns=8,
                max_response_tokens=16384,
                max_tokens_per_turn=2048,
                temperature=1.0,
                max_tool_result_chars=4096,
                tool_timeout_s=30.0,
            ),
        ),
        tools=ToolsConfig(
            enabled=["retrieve"],
            retrieval_corpus="data/wiki-18.jsonl",
            retrieval_top_k=3,
            max_result_chars=4096,
            sandbox=SandboxConfig(num_workers=2),  # no code runs; the pool idles
        ),
        tasks=TasksConfig(
            dataset_path="data/nq_hotpotqa_train.parquet", dataset_shape="search_r1", qa_metric="em"
        ),
        training=TrainingConfig(
            tensor_parallel=TRAIN_TP,
            data_parallel=TRAIN_DP,
            dtype="bfloat16",
            # Megatron's path: fp32 main parameters and Adam state sharded over DP (ZeRO-1), the
            # DP reduction overlapped with backward, whole layers recomputed (long contexts).
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            recompute="full",
            lr=1e-6,  # Search-R1's and the original's
            max_staleness=2,
            max_tokens_per_microbatch=40960,
            grpo=GrpoConfig(clip_low=0.2, clip_high=0.28, temperature=1.0),
        ),
    )
