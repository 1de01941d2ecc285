"""What the job trains on: the policy model's folder, its train and held-out tasks, the tools, and
the chat format that lists them in the prompt.

Two sources: the default, a warm-started tiny policy on its recipe's procedural suite; or
`tasks.dataset_path`'s records for the HF model `job.model`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from libra.config import LibraConfig
from libra.job.rollouts import TimedTool
from libra.tasks.datasets import TaskRecord

if TYPE_CHECKING:
    from libra.rollout.chat import ChatFormat
    from libra.rollout.tools.sandbox import SandboxPool


@dataclass
class TaskSource:
    model_dir: Path
    tasks: list[TaskRecord]
    eval_tasks: list[TaskRecord]
    """Held out: evaluated before the first step and after the last, never trained on."""
    chat: ChatFormat
    tools: list[TimedTool]


async def load_task_source(config: LibraConfig, sandbox: SandboxPool) -> TaskSource:
    """The tools (the sandbox among them) decide the prompt's tool list, so they come first."""
    if config.tasks.dataset_path is None:
        return await _procedural(config, sandbox)
    return _from_dataset(config, sandbox)


async def _procedural(config: LibraConfig, sandbox: SandboxPool) -> TaskSource:
    """The default: the warm-started tiny policy (`job.model`, else built once and cached) on its
    recipe's procedural suite, with the recipe's tools and chat format."""
    from transformers import AutoTokenizer

    from libra.tasks.warm_start import (
        COLLECTION_FILE,
        WarmStartConfig,
        cached_warm_start,
        warm_start_chat,
        warm_start_registry,
        warm_start_suite,
    )

    recipe = WarmStartConfig()
    if config.job.model:
        model_dir = Path(config.job.model)
    else:
        print("[libra] building (or reusing) the warm-started tiny policy ...", flush=True)
        model_dir = await asyncio.to_thread(cached_warm_start, recipe)
    if not (model_dir / COLLECTION_FILE).is_file():
        raise ValueError(
            f"job.model {str(model_dir)!r} has no {COLLECTION_FILE}: without tasks.dataset_path the "
            "job trains on the procedural tasks of a warm-started policy (leave job.model empty)"
        )
    # The warm-started policy's own suite (same difficulty and seed), its train split.
    suite = warm_start_suite(recipe).tasks
    registry = warm_start_registry(recipe, model_dir / COLLECTION_FILE, sandbox)
    return TaskSource(
        model_dir=model_dir,
        tasks=[t.record for t in suite[: recipe.num_train_tasks]],
        eval_tasks=[t.record for t in suite[recipe.num_train_tasks + recipe.num_val_tasks :]],
        chat=warm_start_chat(AutoTokenizer.from_pretrained(model_dir)),
        tools=[TimedTool(registry[name]) for name in registry.names],
    )


def _from_dataset(config: LibraConfig, sandbox: SandboxPool) -> TaskSource:
    """`tasks.dataset_path`'s records for the HF model `job.model`, with the tools of
    `tools.enabled` (checked against the records' task types) listed in the model's own chat
    template."""
    from transformers import AutoTokenizer

    from libra.job.rollouts import load_dataset_tasks
    from libra.rollout.chat import ChatFormat
    from libra.rollout.tools.registry import build_registry

    model_dir = Path(config.job.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"job.model {config.job.model!r} is not an HF model folder (no config.json)")
    tasks = load_dataset_tasks(config.tasks, config.tools)
    registry = build_registry(config.tools, sandbox)
    tools = [TimedTool(registry[name]) for name in registry.names]
    chat = ChatFormat(AutoTokenizer.from_pretrained(model_dir), tools=tools)
    return TaskSource(model_dir, tasks, eval_tasks=[], chat=chat, tools=tools)
