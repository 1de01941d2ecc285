"""The warm-started tiny policy: the factory's random model after a short supervised pass on
procedural demonstrations, stopped early on purpose.

Random weights never emit a well-formed tool call, so RL would see no reward signal. A few hundred
SFT steps on demonstrations (rendered exactly as the agent loop renders them, `sft.py`) teach the
call format and the easy cases; long chains stay mostly unsolved, which leaves RL room to improve.

Recipe:
  1. one procedural suite split by index into train / validation / test tasks (one document
     collection, so keys never collide across splits);
  2. AdamW over the train demonstrations, loss on model tokens only; a share of them answers
     without calling the tool (`direct_answer_fraction`), as an untrained agent often does;
  3. every `eval_every` steps, greedy evaluation of the validation split through the real
     `AgentLoop` and tools (in-process transformers engine, `hf_engine.py`). Training stops at the
     first evaluation with success >= `stop_at_success`; if that one overshoots the band
     [`success_low`, `success_high`], the last checkpoint inside the band is kept;
  4. the kept model is evaluated on the test split; `warm_start.json` next to the weights
     records the recipe, the cache key and both evaluations.

The result is cached by its inputs (`cache_key`): `cached_warm_start` builds at most once per
machine per recipe, under `~/.cache/libra/tiny-models/<key>`.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from libra.tasks.tiny_model import TinyModelSpec, make_tiny_model

logger = logging.getLogger(__name__)

RECIPE_VERSION = "warm-start-4"
"""Part of the cache key: bump it whenever the recipe's code changes what it builds."""
NUM_REPLAYED = 128
"""Python-only demonstrations replayed through the real sandbox to check the predicted results of
the others (`sft.render_checked`)."""
REPORT_FILE = "warm_start.json"
COLLECTION_FILE = "procedural_collection.jsonl"
"""The suite's document collection, written next to the model (the `retrieve` tool's corpus)."""


@dataclass(frozen=True)
class WarmStartConfig:
    """Everything the warm-started model is a function of (with `RECIPE_VERSION`)."""

    spec: TinyModelSpec = field(
        default_factory=lambda: TinyModelSpec(
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=256,
            max_position_embeddings=1024,
        )
    )
    """4 layers: copying a value from the prompt or a tool result needs an induction circuit (2+
    layers). The factory's init std 0.1: with HF's usual 0.02 the same recipe learned the call
    format but stayed at 2 % validation success after 600 steps, where 0.1 reached 28 %."""
    family: str = "arithmetic"
    """Procedural family: `arithmetic`, `lookup` or `mixed`."""
    difficulty: str = "easy"
    """Procedural difficulty (`procedural.generate_suite`): `easy` arithmetic is built so that every
    call is a copy of prompt and result tokens; the standard tasks (three-digit values, `x_i`
    renaming) taught a tiny model the format only. The RL loop must use the same suite
    (`warm_start_suite`)."""
    max_calls: int = 6
    """Longest reference solution (tool calls): a long tail (Zipf 1.5: 55 % one call, 4 % six)
    that stays within a short context (~450 tokens at six calls)."""
    distribution: str = "zipf"
    suite_seed: int = 0
    num_train_tasks: int = 2048
    """Many distinct demonstrations (cheap to make) rather than epochs over few: copying
    generalises from variety."""
    direct_answer_fraction: float = 0.3
    """Share of the train demonstrations that answer at once, without calling the tool
    (`sft.render_direct_answer`; a random, seeded subset). The policy then skips its tool on
    about this share of its sampled trajectories (built: first-turn P(answer) 0.31; greedy
    decoding still calls it), almost always failing there: a decision GRPO's group advantages
    teach within tens of steps — learning to rely on the tool is the first thing agentic RL
    does — where the copy errors of the tool path alone improve far more slowly (issue #10: with
    no such share the reward stayed flat over 30 steps). At 0.4 with the direct answers in
    batches of their own, greedy decoding stopped calling the tool; see `make_batches`."""
    num_val_tasks: int = 64
    num_test_tasks: int = 96
    retrieval_top_k: int = 1
    """Hits the `retrieve` tool returns (1 keeps contexts short; RL should use the same)."""
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    max_steps: int = 1000
    batch_tokens: int = 4096
    """Padded tokens per batch (~20 demonstrations)."""
    max_train_length: int = 512
    """Demonstrations are cut to this many tokens for training (none is longer at `max_calls` 6)."""
    eval_every: int = 80
    first_eval_step: int = 400
    stop_at_success: float = 0.3
    success_low: float = 0.2
    success_high: float = 0.5
    max_tokens_per_turn: int = 64
    """A call turn is ~35 tokens; a longer turn is already a failure."""
    seed: int = 0
    num_threads: int = 1
    """torch threads while building (results are deterministic for a given count). One: on a
    shared 2-core machine a second thread makes each step 3x slower, not faster."""

    def __post_init__(self) -> None:
        if self.family not in ("arithmetic", "lookup", "mixed"):
            raise ValueError(f"warm_start.family must be arithmetic, lookup or mixed, got {self.family!r}")
        if self.difficulty not in ("standard", "easy"):
            raise ValueError(f"warm_start.difficulty must be standard or easy, got {self.difficulty!r}")
        for name in (
            "max_calls", "num_train_tasks", "num_val_tasks", "num_test_tasks", "retrieval_top_k",
            "max_steps", "batch_tokens", "max_train_length", "eval_every", "max_tokens_per_turn",
            "num_threads",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"warm_start.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.direct_answer_fraction < 1:
            raise ValueError(
                f"warm_start.direct_answer_fraction must be in [0, 1), got {self.direct_answer_fraction}"
            )
        if self.learning_rate <= 0:
            raise ValueError(f"warm_start.learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.success_low <= self.stop_at_success <= self.success_high <= 1:
            raise ValueError(
                "warm_start needs 0 <= success_low <= stop_at_success <= success_high <= 1, got "
                f"{self.success_low}, {self.stop_at_success}, {self.success_high}"
            )
        if self.batch_tokens < self.max_train_length:
            raise ValueError(
                f"warm_start.batch_tokens ({self.batch_tokens}) must be >= max_train_length "
                f"({self.max_train_length})"
            )

    @property
    def max_turns(self) -> int:
        """Agent-loop turn limit: the longest solution's calls, its answer, and some slack."""
        return self.max_calls + 4

    @property
    def tool_names(self) -> list[str]:
        return {"arithmetic": ["python"], "lookup": ["retrieve"], "mixed": ["python", "retrieve"]}[
            self.family
        ]


def cache_key(config: WarmStartConfig) -> str:
    payload = json.dumps({"recipe": RECIPE_VERSION, **dataclasses.asdict(config)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def default_cache_root() -> Path:
    return Path(os.environ.get("LIBRA_CACHE_DIR", Path.home() / ".cache" / "libra")) / "tiny-models"


def warm_start_dir(config: WarmStartConfig | None = None, cache_root: str | Path | None = None) -> Path:
    """Where `cached_warm_start` keeps the model of `config`; it is built when `REPORT_FILE` is
    there."""
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / cache_key(config or WarmStartConfig())


def cached_warm_start(config: WarmStartConfig | None = None, cache_root: str | Path | None = None) -> Path:
    """The warm-started model folder for `config`, built once per cache (concurrent callers wait
    on a lock; a half-built folder is never visible)."""
    config = config or WarmStartConfig()
    final = warm_start_dir(config, cache_root)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / REPORT_FILE).is_file():
            return final
        staging = Path(tempfile.mkdtemp(prefix=f"{final.name}.", dir=root))
        try:
            build_warm_started_model(staging, config)
            if final.exists():  # an earlier build died before writing its report
                shutil.rmtree(final)
            staging.rename(final)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    return final


def make_warm_started_model(
    out_dir: str | Path, config: WarmStartConfig | None = None, cache_root: str | Path | None = None
) -> dict:
    """`libra make-tiny-model DIR`: the cached warm-started model (built if needed) copied into
    `out_dir`; returns its report."""
    cached = cached_warm_start(config, cache_root)
    shutil.copytree(cached, out_dir, dirs_exist_ok=True)
    return json.loads((Path(out_dir) / REPORT_FILE).read_text())


def build_warm_started_model(out_dir: str | Path, config: WarmStartConfig | None = None) -> dict:
    """Builds the warm-started model into `out_dir` and returns the report written there."""
    config = config or WarmStartConfig()
    out = Path(out_dir)
    return asyncio.run(_build(out, config))


async def _build(out: Path, config: WarmStartConfig) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libra.rollout.tools.config import SandboxConfig
    from libra.rollout.tools.sandbox import SandboxPool
    from libra.tasks.sft import render_checked, render_demonstrations, render_direct_answer

    started = time.monotonic()
    torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    make_tiny_model(out, config.spec)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    suite = warm_start_suite(config)
    suite.write_collection(out / COLLECTION_FILE)
    train = suite.tasks[: config.num_train_tasks]
    val = suite.tasks[config.num_train_tasks : config.num_train_tasks + config.num_val_tasks]
    test = suite.tasks[config.num_train_tasks + config.num_val_tasks :]
    chat = warm_start_chat(tokenizer)

    sandbox = await SandboxPool(SandboxConfig(num_workers=2)).start()
    try:
        registry = warm_start_registry(config, out / COLLECTION_FILE, sandbox)
        tools = [registry[name] for name in registry.names]
        if config.tool_names == ["python"]:
            examples = await render_checked(chat, train, registry.call, _max_result_chars(), NUM_REPLAYED)
        else:
            examples = await render_demonstrations(chat, train, registry.call, _max_result_chars())
        # Batches by the length of each task's tool-path demonstration, so the direct answers mix
        # into batches of tool calls in their share instead of forming batches of their own.
        group_lengths = [len(example.token_ids) for example in examples]
        direct = random.Random(f"{config.seed}:direct-answers").sample(
            range(len(train)), round(config.direct_answer_fraction * len(train))
        )
        for index in direct:
            examples[index] = render_direct_answer(chat, train[index])
        logger.info(
            "rendered %d demonstrations (%d answering without a tool) in %.1f s",
            len(examples), len(direct), time.monotonic() - started,
        )  # fmt: skip

        async def evaluate_split(tasks):
            return await evaluate_local(model, tokenizer, chat, tools, tasks, config)

        history, kept_step = await _train(
            model, tokenizer, examples, group_lengths, evaluate_split, val, config
        )
        model.eval()
        test_summary = (await evaluate_split(test)).to_json()
    finally:
        await sandbox.close()

    model.save_pretrained(out, safe_serialization=True)
    kept = next(h for h in history if h["step"] == kept_step)
    report = {
        "recipe": RECIPE_VERSION,
        "cache_key": cache_key(config),
        "config": dataclasses.asdict(config),
        "chat": {
            "tools_in_prompt": False,
            "tools": config.tool_names,
            "retrieval_top_k": config.retrieval_top_k,
        },
        "evaluation_engine": "AgentLoop + in-process transformers greedy engine (libra.tasks.hf_engine)",
        "kept_step": kept_step,
        "in_band": config.success_low <= kept["success_rate"] <= config.success_high,
        "validation": kept,
        "history": history,
        "test": test_summary,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return report


async def _train(model, tokenizer, examples, group_lengths, evaluate_split, val, config: WarmStartConfig):
    """SFT with periodic validation; leaves `model` at the kept checkpoint. Returns the
    validation history and the kept step."""
    import torch

    from libra.tasks.sft import make_batches, masked_lm_loss

    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / config.warmup_steps)
    )
    history: list[dict] = []
    in_band: tuple[int, dict] | None = None  # (step, state_dict) of the last checkpoint in the band
    batches: list = []
    step, losses, started = 0, [], time.monotonic()
    while step < config.max_steps:
        if not batches:
            batches = make_batches(
                examples,
                config.batch_tokens,
                config.max_train_length,
                tokenizer.pad_token_id,
                rng,
                group_lengths,
            )
        model.train()
        loss = masked_lm_loss(model, batches.pop())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        losses.append(loss.item())
        if step % 10 == 0:
            logger.debug("step %d: loss %.3f, %.1f s", step, losses[-1], time.monotonic() - started)
        due = step >= config.first_eval_step and (step - config.first_eval_step) % config.eval_every == 0
        if not due and step < config.max_steps:
            continue
        model.eval()
        summary = (await evaluate_split(val)).to_json()
        entry = {"step": step, "train_loss": round(sum(losses) / len(losses), 4), **summary}
        entry["seconds"] = round(time.monotonic() - started, 1)
        history.append(entry)
        losses = []
        success = summary["success_rate"]
        logger.info(
            "step %d: loss %.3f, validation success %.3f, mean turns %.2f",
            step, entry["train_loss"], success, summary["mean_turns"],
        )  # fmt: skip
        if config.success_low <= success <= config.success_high:
            in_band = (step, copy.deepcopy(model.state_dict()))
        if success >= config.stop_at_success:
            break
    if in_band is not None and in_band[0] != step:
        model.load_state_dict(in_band[1])  # overshot the band: go back to the last step inside it
        return history, in_band[0]
    return history, step


def warm_start_suite(config: WarmStartConfig):
    """The recipe's procedural suite, split by index: train, then validation, then test tasks.
    The RL loop must draw its tasks from the same suite (its train split)."""
    from libra.tasks.procedural import generate_suite

    num_tasks = config.num_train_tasks + config.num_val_tasks + config.num_test_tasks
    return generate_suite(
        num_tasks, config.suite_seed, config.family, config.max_calls, config.distribution, config.difficulty
    )


def warm_start_chat(tokenizer):
    """The chat format the warm-started model was trained with: tools are offered to the agent loop
    but not listed in the system prompt (the task prompt names the tool; listing the schemas would
    add ~500 tokens to every context of a model that learned the calls from demonstrations)."""
    from libra.rollout.chat import ChatFormat

    return ChatFormat(tokenizer, tools=())


def warm_start_registry(config: WarmStartConfig, collection: str | Path, sandbox):
    """The tools of the recipe's family; `sandbox` is a started SandboxPool (for `python`)."""
    from libra.rollout.tools.config import ToolsConfig
    from libra.rollout.tools.registry import build_registry

    tools = ToolsConfig(
        enabled=config.tool_names, retrieval_corpus=str(collection), retrieval_top_k=config.retrieval_top_k
    )
    return build_registry(tools, sandbox if "python" in config.tool_names else None)


def _max_result_chars() -> int:
    from libra.rollout.config import AgentLoopConfig

    return AgentLoopConfig().max_tool_result_chars


async def evaluate_local(model, tokenizer, chat, tools, tasks, config: WarmStartConfig):
    """Greedy evaluation of `model` on `tasks` through the agent loop and the in-process engine."""
    from libra.tasks.hf_engine import LocalGreedyInstance, LocalPool
    from libra.tasks.policy_eval import agent_config, evaluate

    instance = LocalGreedyInstance(model, tokenizer.pad_token_id, config.spec.max_position_embeddings)
    pool = LocalPool(instance)
    try:
        summary, _ = await evaluate(
            pool, chat, tools, tasks, agent_config(config.max_turns, config.max_tokens_per_turn)
        )
    finally:
        await pool.close()
    return summary
