"""Procedural agentic tasks for the CPU: problems whose solution takes a long-tailed number of
tool calls, generated from a seed with their ground truth and an ideal tool-call transcript.

Two families:
  - `arithmetic`: a chain x_0 -> x_1 -> … -> x_k of modular arithmetic steps; the reference
    solution makes one `python` call per step. (A Turing-complete interpreter lets a strong model
    fold the chain into one call; the tool-call count is what the *demonstration* uses, and what a
    tiny model learns to imitate.)
  - `lookup`: a chain of k lookups in a generated document collection, where each document names
    the key of the next one, so the calls are genuinely sequential: the next query is only known
    after the previous result. Solved with the `retrieve` tool (BM25 over the collection).
The `easy` difficulty of `arithmetic` is the warm-start family of a tiny policy: two-digit values,
one-digit constants, numbered steps written in terms of `x`, and a `# step i` comment in each
reference call, so that each call is copied from the prompt (the step's line) and the previous
result rather than computed.
The number of calls k is drawn from a truncated Zipf law (or a geometric one): most tasks need a
few calls, a few need many — the long tail the C-MLFQ scheduler exists for.

Everything is a function of (seed, index): the same seed gives the same tasks and collection.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from libra.rollout.tools.base import ToolCall, ToolResult
from libra.tasks.datasets import TaskRecord, TaskType
from libra.trajectory import ToolStatus

FAMILIES = ("arithmetic", "lookup")
DIFFICULTIES = ("standard", "easy")


def sample_num_calls(
    rng: random.Random,
    max_calls: int = 24,
    distribution: str = "zipf",
    zipf_exponent: float = 1.5,
    geometric_p: float = 0.35,
) -> int:
    """k in 1..max_calls: P(k) ∝ k^-exponent (`zipf`) or (1-p)^(k-1) (`geometric`)."""
    if max_calls < 1:
        raise ValueError(f"max_calls must be >= 1, got {max_calls}")
    if distribution == "zipf":
        weights = [k**-zipf_exponent for k in range(1, max_calls + 1)]
    elif distribution == "geometric":
        if not 0 < geometric_p <= 1:
            raise ValueError(f"geometric_p must be in (0, 1], got {geometric_p}")
        weights = [(1 - geometric_p) ** (k - 1) for k in range(1, max_calls + 1)]
    else:
        raise ValueError(f"distribution must be 'zipf' or 'geometric', got {distribution!r}")
    return rng.choices(range(1, max_calls + 1), weights=weights)[0]


@dataclass(frozen=True)
class DemoStep:
    """One call of the reference solution and what its result must contain."""

    call: ToolCall
    expected_in_result: str


@dataclass(frozen=True)
class ProceduralTask:
    record: TaskRecord
    num_calls: int
    demonstration: tuple[DemoStep, ...]
    final_response: str
    """The reference solution's last turn (it holds `<answer>…</answer>`)."""


@dataclass
class ProceduralSuite:
    tasks: list[ProceduralTask]
    documents: list[dict[str, str]] = field(default_factory=list)
    """The `lookup` family's collection (`{"id", "title", "text"}`), shared by all its tasks."""

    def write_collection(self, path: str | Path) -> Path:
        """Writes the collection as JSONL for `RetrievalTool` / `tools.retrieval_corpus`."""
        path = Path(path)
        with open(path, "w", encoding="utf-8") as f:
            for document in self.documents:
                f.write(json.dumps(document) + "\n")
        return path


# ---------------------------------------------------------------- arithmetic chains

_STEPS: tuple[tuple[str, Callable[[int, int, int], int]], ...] = (
    ("(x * {a} + {b}) % 1000", lambda x, a, b: (x * a + b) % 1000),
    ("(x * x + {a}) % 997", lambda x, a, b: (x * x + a) % 997),
    ("abs(x - {a}) * {b} % 1009", lambda x, a, b: abs(x - a) * b % 1009),
    ("x // {b} + {a}", lambda x, a, b: x // b + a),
)


def _arithmetic_task(rng: random.Random, num_calls: int, meta: dict) -> ProceduralTask:
    x = rng.randrange(1, 1000)
    lines, steps = [f"x_0 = {x}"], []
    for i in range(1, num_calls + 1):
        template, apply = rng.choice(_STEPS)
        a, b = rng.randrange(2, 50), rng.randrange(2, 50)
        expression = template.format(a=a, b=b)
        lines.append(f"x_{i} = {expression.replace('x', f'x_{i - 1}')}")
        code = f"x = {x}\nprint({expression})"
        x = apply(x, a, b)
        steps.append(DemoStep(ToolCall("python", {"code": code}), str(x)))
    prompt = (
        "Compute the sequence step by step, using the python tool once per step:\n"
        + "\n".join(lines)
        + f"\nWhat is x_{num_calls}? Give the final answer as <answer>number</answer>."
    )
    record = TaskRecord(prompt, str(x), TaskType.PROCEDURAL, meta)
    return ProceduralTask(record, num_calls, tuple(steps), f"<answer>{x}</answer>")


# Values stay in 0..99 and constants are one digit, so every number is one token.
_EASY_STEPS: tuple[tuple[str, Callable[[int, int], int]], ...] = (
    ("(x + {a}) % 100", lambda x, a: (x + a) % 100),
    ("(x * {a}) % 100", lambda x, a: (x * a) % 100),
    ("abs(x - {a})", lambda x, a: abs(x - a)),
    ("x // {a} + {a}", lambda x, a: x // a + a),
)


def _easy_arithmetic_task(rng: random.Random, num_calls: int, meta: dict) -> ProceduralTask:
    """Each reference call is `# step i` / `x=<value>` / the step's statement / `x` (the printed
    value). Values are written `x=<value>` everywhere (prompt, calls) and statements as in the
    prompt, so that a call copies the very tokens of the prompt and of the last result: a byte-level
    BPE gives `=75` and the result line `75` the same number token, where `x = 75` would not."""
    x = start = rng.randrange(1, 100)
    lines, steps = [], []
    for i in range(1, num_calls + 1):
        template, apply = rng.choice(_EASY_STEPS)
        a = rng.randrange(2, 10)
        statement = "x = " + template.format(a=a)
        lines.append(f"step {i}: {statement}")
        code = f"# step {i}\nx={x}\n{statement}\nx"
        x = apply(x, a)
        steps.append(DemoStep(ToolCall("python", {"code": code}), str(x)))
    prompt = (
        f"Start with x={start}. Run each step with the python tool, one call per step:\n"
        + "\n".join(lines)
        + f"\nWhat is x after step {num_calls}? Give the final answer as <answer>number</answer>."
    )
    record = TaskRecord(prompt, str(x), TaskType.PROCEDURAL, meta)
    return ProceduralTask(record, num_calls, tuple(steps), f"<answer>{x}</answer>")


# ---------------------------------------------------------------- lookup chains

_SYLLABLES = (
    "ka",
    "zo",
    "ri",
    "mu",
    "te",
    "vos",
    "lin",
    "dar",
    "quo",
    "xe",
    "pil",
    "gor",
    "nu",
    "sha",
    "bex",
)


def _fresh_key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = "".join(rng.choice(_SYLLABLES) for _ in range(3)) + str(rng.randrange(10, 100))
        if key not in taken:
            taken.add(key)
            return key


def _lookup_task(
    rng: random.Random, num_calls: int, meta: dict, taken: set[str], documents: list[dict[str, str]]
) -> ProceduralTask:
    keys = [_fresh_key(rng, taken) for _ in range(num_calls + 1)]
    steps = []
    for i in range(num_calls):
        documents.append(
            {
                "id": f"doc-{keys[i]}",
                "title": f"Registry entry {keys[i]}",
                "text": f"The registry entry {keys[i]} points to {keys[i + 1]}.",
            }
        )
        steps.append(DemoStep(ToolCall("retrieve", {"query": f"registry entry {keys[i]}"}), keys[i + 1]))
    prompt = (
        f"Start at the registry entry {keys[0]}. Each entry points to another one; use the retrieve "
        f"tool to follow the pointers {num_calls} time{'s' if num_calls > 1 else ''}. Which entry do you "
        "reach? Give the final answer as <answer>entry</answer>."
    )
    record = TaskRecord(prompt, keys[-1], TaskType.PROCEDURAL, meta)
    return ProceduralTask(record, num_calls, tuple(steps), f"<answer>{keys[-1]}</answer>")


# ---------------------------------------------------------------- generation


def generate_suite(
    num_tasks: int,
    seed: int = 0,
    family: str = "arithmetic",
    max_calls: int = 24,
    distribution: str = "zipf",
    difficulty: str = "standard",
) -> ProceduralSuite:
    """`num_tasks` tasks of `family` (`arithmetic`, `lookup` or `mixed`), deterministic in `seed`.
    `difficulty="easy"` makes the arithmetic tasks small and copyable (lookup tasks are unchanged)."""
    if family not in (*FAMILIES, "mixed"):
        raise ValueError(f"procedural family must be one of {(*FAMILIES, 'mixed')}, got {family!r}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"procedural difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    if num_tasks < 0:
        raise ValueError(f"num_tasks must be >= 0, got {num_tasks}")
    suite_rng = random.Random(f"libra-procedural:{seed}")
    taken: set[str] = set()
    suite = ProceduralSuite(tasks=[])
    for index in range(num_tasks):
        rng = random.Random(f"libra-procedural:{seed}:{index}")
        task_family = family if family != "mixed" else suite_rng.choice(FAMILIES)
        num_calls = sample_num_calls(rng, max_calls, distribution)
        meta = {"family": task_family, "seed": seed, "index": index, "num_calls": num_calls}
        if task_family == "arithmetic" and difficulty == "easy":
            suite.tasks.append(_easy_arithmetic_task(rng, num_calls, meta))
        elif task_family == "arithmetic":
            suite.tasks.append(_arithmetic_task(rng, num_calls, meta))
        else:
            suite.tasks.append(_lookup_task(rng, num_calls, meta, taken, suite.documents))
    return suite


async def replay_demonstration(task: ProceduralTask, call_tool) -> list[tuple[ToolCall, ToolResult]]:
    """Runs the reference solution through real tools (`call_tool(ToolCall) -> ToolResult`, e.g.
    `ToolRegistry.call`) and returns the exact transcript; raises ValueError if a result lacks
    what the demonstration expects (the generator and the tools disagree)."""
    transcript = []
    for number, step in enumerate(task.demonstration, start=1):
        result = await call_tool(step.call)
        if result.status != ToolStatus.SUCCESS or step.expected_in_result not in result.content:
            raise ValueError(
                f"demonstration step {number} of task {task.record.metadata}: expected "
                f"{step.expected_in_result!r} in the {result.status.name} result {result.content[:200]!r}"
            )
        transcript.append((step.call, result))
    return transcript
