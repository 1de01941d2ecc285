"""A tiny model that has memorised a few tool-calling dialogs, so that greedy decoding drives the
agent loop through known paths: correct calculator calls, a malformed call, an unknown tool, and
a model that never stops calling tools.

A random model almost never emits `<tool_call>`; fine-tuning the factory's random model for a few
seconds on the exact token sequences the agent loop produces (prompt, model turns, tool-result
tokens from `ChatFormat`) makes it reproduce them. Loss is on the model's tokens only, as in RL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from libra.rollout.chat import ChatFormat
from libra.rollout.tools.calculator import evaluate

CALCULATOR_QUESTIONS = ("12+7", "3*45", "(5+6)*3")
MALFORMED_QUESTION = "Please break the calculator."
UNKNOWN_TOOL_QUESTION = "What is the weather in Paris?"
LOOPING_QUESTION = "Keep counting forever."
LONG_ANSWER_QUESTION = "Count to sixty."
"""Answered without tools in one long turn (~170 tokens): long enough to interrupt mid-turn."""
_FINAL = "Sorry, I cannot."


@dataclass(frozen=True)
class Dialog:
    question: str
    turns: tuple[str, ...]
    """Model turns in order; each but the last ends with </tool_call>."""
    tool_results: tuple[str, ...]
    """What the loop appends after each tool call (the tool's output or its error text)."""


def _call(name: str, arguments: dict | str) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def dialogs(chat: ChatFormat) -> list[Dialog]:
    """The memorised dialogs. Error texts come from running the real agent-loop paths' messages,
    so they match what the loop will append."""
    out = []
    for expression in CALCULATOR_QUESTIONS:
        value = evaluate(expression)
        result = str(int(value)) if float(value).is_integer() else str(value)
        out.append(
            Dialog(
                f"What is {expression}?",
                (_call("calculator", {"expression": expression}), f"The answer is {result}.<|im_end|>"),
                (result,),
            )
        )
    malformed = '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>'
    out.append(
        Dialog(MALFORMED_QUESTION, (malformed, _FINAL + "<|im_end|>"), (_error_text(chat, malformed),))
    )
    weather = _call("weather", {"city": "Paris"})
    unknown = "error: unknown tool 'weather'; available: ['calculator']"
    out.append(Dialog(UNKNOWN_TOOL_QUESTION, (weather, _FINAL + "<|im_end|>"), (unknown,)))
    loop_call = _call("calculator", {"expression": "1+1"})
    out.append(Dialog(LOOPING_QUESTION, (loop_call,) * 3, ("2",) * 3))
    count = ", ".join(str(n) for n in range(1, 61))
    out.append(Dialog(LONG_ANSWER_QUESTION, (f"{count}.<|im_end|>",), ()))
    return out


def _error_text(chat: ChatFormat, turn_text: str) -> str:
    from libra.rollout.chat import ToolCallError

    try:
        chat.parse_tool_call(chat.tokenizer.encode(turn_text, add_special_tokens=False))
    except ToolCallError as e:
        return f"error: {e}"
    raise AssertionError("the malformed dialog parses")


def encode(chat: ChatFormat, dialog: Dialog) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on model tokens), built as the agent loop builds them."""
    ids = chat.prompt_ids([{"role": "user", "content": dialog.question}])
    mask = [0] * len(ids)
    for index, turn in enumerate(dialog.turns):
        turn_ids = chat.tokenizer.encode(turn, add_special_tokens=False)
        ids += turn_ids
        mask += [1] * len(turn_ids)
        if index < len(dialog.tool_results):
            result_ids = chat.tool_result_ids(dialog.tool_results[index])
            ids += result_ids
            mask += [0] * len(result_ids)
    return ids, mask


def scripted_chat(tokenizer) -> ChatFormat:
    """The chat format the scripted model is trained and used with: tools are not listed in the
    system prompt (it keeps sequences short, so training takes seconds); the loop still has them."""
    return ChatFormat(tokenizer, tools=())


def train_scripted_model(random_model_dir: Path, out_dir: Path, max_steps: int = 300) -> Path:
    """Fine-tunes the random model in `random_model_dir` on `dialogs` until greedy decoding
    reproduces them; saves model and tokenizer to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    chat = scripted_chat(tokenizer)
    encoded = [encode(chat, d) for d in dialogs(chat)]
    length = max(len(ids) for ids, _ in encoded)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (length - len(ids)) for ids, _ in encoded])
    labels = torch.tensor(
        [
            [t if m else -100 for t, m in zip(ids, mask, strict=True)] + [-100] * (length - len(ids))
            for ids, mask in encoded
        ]
    )
    attention = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids, _ in encoded])
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(max_steps):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:  # every model token then has probability > ~0.99 given its prefix
            break
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
