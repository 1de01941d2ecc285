"""Supervised fine-tuning on procedural demonstrations, rendered token for token as the agent loop
would produce them.

A demonstration is replayed through the real tools, then rendered with the agent loop's
`ChatFormat`: the prompt, each model turn (`<tool_call>…</tool_call>`, the stop token included),
the tool-result tokens `ChatFormat.tool_result_ids` appends, and the final answer ending with
`<|im_end|>`. The loss mask is what a trajectory's would be: 1 on model tokens, 0 on the prompt and
on tool results. So the model learns exactly the token sequences it will be fed and asked for.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from libra.rollout.chat import IM_END, TOOL_CALL_END, TOOL_CALL_START, ChatFormat
from libra.rollout.tools.base import ToolCall
from libra.tasks.procedural import ProceduralTask, replay_demonstration

ANSWER_START, ANSWER_END = "<answer>", "</answer>"
DIRECT_ANSWER_LEAD = "The answer is "
IGNORE_INDEX = -100
"""Label of tokens that carry no loss (transformers' convention)."""


@dataclass(frozen=True)
class Example:
    token_ids: list[int]
    loss_mask: list[int]


def tool_call_text(call: ToolCall) -> str:
    """A model turn calling `call`, in the chat template's own rendering of a call."""
    payload = json.dumps({"name": call.name, "arguments": call.arguments})
    return f"{TOOL_CALL_START}\n{payload}\n{TOOL_CALL_END}"


def render_example(chat: ChatFormat, task: ProceduralTask, tool_results: Sequence[str]) -> Example:
    """The demonstration of `task` with the given tool-result contents (one per call)."""
    if len(tool_results) != len(task.demonstration):
        raise ValueError(
            f"task {task.record.metadata}: {len(task.demonstration)} calls but {len(tool_results)} results"
        )
    encode = chat.tokenizer.encode
    ids = chat.prompt_ids([{"role": "user", "content": task.record.prompt}])
    mask = [0] * len(ids)
    for step, content in zip(task.demonstration, tool_results, strict=True):
        turn = encode(tool_call_text(step.call), add_special_tokens=False)
        result = chat.tool_result_ids(content)
        ids += turn + result
        mask += [1] * len(turn) + [0] * len(result)
    final = encode(task.final_response + IM_END, add_special_tokens=False)
    return Example(ids + final, mask + [1] * len(final))


def render_direct_answer(chat: ChatFormat, task: ProceduralTask) -> Example:
    """`task` answered at once, without a tool call (`DIRECT_ANSWER_LEAD` + the answer): the habit
    of a model that has not learned to rely on its tools. Only the answer's frame carries loss,
    not its value: the value is the tool's result, which a tiny model cannot compute, and
    learning to guess it would teach the answer token to ignore the result the tool path copies.
    The lead words keep the first-turn choice (call or answer) apart from the final turns of the
    tool path, which open with `<answer>` too."""
    encode = chat.tokenizer.encode
    ids = chat.prompt_ids([{"role": "user", "content": task.record.prompt}])
    opening, value, closing = (
        encode(DIRECT_ANSWER_LEAD + ANSWER_START, add_special_tokens=False),
        encode(task.record.ground_truth, add_special_tokens=False),
        encode(ANSWER_END + IM_END, add_special_tokens=False),
    )
    whole = DIRECT_ANSWER_LEAD + task.final_response + IM_END
    if opening + value + closing != encode(whole, add_special_tokens=False):
        raise ValueError(
            f"task {task.record.metadata}: final response {task.final_response!r} does not tokenize as "
            f"{ANSWER_START}value{ANSWER_END}"
        )
    mask = [0] * len(ids) + [1] * len(opening) + [0] * len(value) + [1] * len(closing)
    return Example(ids + opening + value + closing, mask)


async def render_demonstrations(
    chat: ChatFormat, tasks: Sequence[ProceduralTask], call_tool, max_result_chars: int
) -> list[Example]:
    """Replays every task's demonstration through `call_tool` (e.g. `ToolRegistry.call`) and
    renders it. Results are cut to `max_result_chars` as the agent loop cuts them. The replays run
    concurrently (each one's calls in order), so a sandbox pool's workers stay busy."""
    transcripts = await asyncio.gather(*(replay_demonstration(task, call_tool) for task in tasks))
    return [
        render_example(chat, task, [_cut(result.content, max_result_chars) for _, result in transcript])
        for task, transcript in zip(tasks, transcripts, strict=True)
    ]


def python_printed_results(task: ProceduralTask) -> list[str]:
    """The `python` tool's results for an arithmetic demonstration without running it: each call
    prints its step's value, one line. `render_checked` holds this against real replays."""
    if any(step.call.name != "python" for step in task.demonstration):
        raise ValueError(f"task {task.record.metadata}: only python demonstrations can be predicted")
    return [f"{step.expected_in_result}\n" for step in task.demonstration]


async def render_checked(
    chat: ChatFormat, tasks: Sequence[ProceduralTask], call_tool, max_result_chars: int, num_replayed: int
) -> list[Example]:
    """Like `render_demonstrations` for python-only tasks, but only the first `num_replayed` run
    through the tools (thousands of sandbox runs would cost a large part of a CPU build); the
    others use `python_printed_results`, and the replayed ones must render identically to their
    prediction (RuntimeError otherwise: the tool's output format changed)."""
    replayed = await render_demonstrations(chat, tasks[:num_replayed], call_tool, max_result_chars)
    predicted = [render_example(chat, task, python_printed_results(task)) for task in tasks]
    for index, example in enumerate(replayed):
        if example != predicted[index]:
            raise RuntimeError(
                f"task {tasks[index].record.metadata}: the python tool's real results differ from "
                "python_printed_results; render these demonstrations with render_demonstrations"
            )
    return predicted


def _cut(content: str, max_chars: int) -> str:
    # The same rule as AgentLoop._call_tool, so rendered results equal what the loop appends.
    return content if len(content) <= max_chars else content[:max_chars] + "\n[output truncated]"


@dataclass(frozen=True)
class Batch:
    input_ids: object
    """LongTensor [B, T], right-padded."""
    attention_mask: object
    labels: object
    """LongTensor [B, T]: the next-token targets' source ids, IGNORE_INDEX off the loss mask."""
    num_loss_tokens: int


def make_batches(
    examples: Sequence[Example],
    max_tokens: int,
    max_length: int,
    pad_token_id: int,
    rng: random.Random,
    group_lengths: Sequence[int] | None = None,
) -> list[Batch]:
    """One epoch of batches of similar length, at most `max_tokens` padded tokens each, in random
    order. Examples longer than `max_length` are cut to their first `max_length` tokens (the
    early turns of a long demonstration still teach). `group_lengths` (default: the examples' own
    lengths) decides which examples share a batch: batches made only of one kind of short example
    would each push one habit with the weight of many rows."""
    import torch

    lengths = group_lengths if group_lengths is not None else [len(e.token_ids) for e in examples]
    if len(lengths) != len(examples):
        raise ValueError(f"{len(lengths)} group lengths for {len(examples)} examples")
    order = sorted(range(len(examples)), key=lambda i: (lengths[i], rng.random()))
    groups, current, width = [], [], 0
    for index in order:
        length = min(len(examples[index].token_ids), max_length)
        if current and max(width, length) * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, width = [], 0
        current.append(index)
        width = max(width, length)
    if current:
        groups.append(current)
    rng.shuffle(groups)
    batches = []
    for group in groups:
        rows = [examples[i] for i in group]
        width = max(min(len(r.token_ids), max_length) for r in rows)
        input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for row, example in enumerate(rows):
            ids = torch.tensor(example.token_ids[:max_length])
            mask = torch.tensor(example.loss_mask[:max_length], dtype=torch.bool)
            input_ids[row, : len(ids)] = ids
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.where(mask, ids, IGNORE_INDEX)
        num_loss = int((labels != IGNORE_INDEX).sum())
        batches.append(Batch(input_ids, attention, labels, num_loss))
    return batches


def masked_lm_loss(model, batch: Batch):
    """Mean cross-entropy of the next token over loss-mask tokens (transformers shifts labels)."""
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
