"""A tiny model that has memorised a few tool-calling dialogs, so that greedy decoding drives the
agent loop through known paths: correct calculator calls, a malformed call, an unknown tool, and
a model that never stops calling tools.

A random model almost never emits `<tool_call>`; fine-tuning the factory's random model for a few
seconds on the exact token sequences the agent loop produces (prompt, model turns, tool-result
tokens from `ChatFormat`) makes it reproduce them. Loss is on the model's tokens only, as in RL.
The build checks that it does, with a margin any fp32 engine keeps (`MIN_MARGIN`), and fails
naming the dialog otherwise: a test never meets a model that does not follow its script.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from libra.rollout.chat import ChatFormat
from libra.rollout.tools.calculator import evaluate

logger = logging.getLogger(__name__)

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


MIN_MARGIN = 2.0
"""Logit margin every scripted token must hold over the runner-up (teacher-forced, fp32
transformers) before the model is accepted. The tests decode it with vLLM's CPU engine in fp32,
whose kernels (paged attention, fused norms, a KV cache filled in chunks) round differently from
transformers' greedy decoding used here: the tests allow 1e-3 between the two in logprobs and
call 1e-4 in logits a tie (`tests/sync/hf_reference.py`). At a margin of 2 (the scripted token
at least e^2 ~ 7x as likely as any other) both engines make the same greedy choice at every step
of every dialog, on any machine. A mean-loss threshold (the old stopping rule, loss < 0.01) does
not ensure it: it still let one token of the long answer sit at a margin of 1.4-2.8 depending on
the thread count, and which token comes closest to a tie depends on the machine's rounding."""
MAX_STEPS = 600
"""Full-batch steps before the build gives up (it needs 25-45: seconds)."""


class ScriptedModelError(RuntimeError):
    """Training ended without the model reproducing every dialog."""


def train_scripted_model(random_model_dir: Path, out_dir: Path, max_steps: int = MAX_STEPS) -> Path:
    """Fine-tunes the random model in `random_model_dir` on `dialogs` until greedy decoding
    reproduces every one of them with `MIN_MARGIN` to spare, then saves model and tokenizer to
    `out_dir`. Raises ScriptedModelError (naming the dialog and what the model produced, and
    writing nothing) if it does not after `max_steps` steps."""
    with one_torch_thread():
        return _train(random_model_dir, out_dir, max_steps)


def _train(random_model_dir: Path, out_dir: Path, max_steps: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    chat = scripted_chat(tokenizer)
    script = dialogs(chat)
    encoded = [encode(chat, d) for d in script]
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(max_steps + 1):
        model.train()
        out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
        # The margins of this batch's own forward decide when to check: the full check (unpadded
        # forwards and greedy decoding, ~1 s) runs once they all clear MIN_MARGIN, and at the end.
        margin = min_margin(out.logits.detach(), labels)
        if margin >= MIN_MARGIN or step == max_steps:
            model.eval()
            failure = first_failure(model, chat, script)
            if failure is None:
                break
            if step == max_steps:
                raise ScriptedModelError(
                    f"the scripted model does not reproduce its dialogs after {max_steps} steps: {failure}"
                )
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    logger.info("scripted model reproduces its dialogs after %d steps (min margin %.2f)", step, margin)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def min_margin(logits, labels) -> float:
    """The smallest (target logit - best other logit) over the labelled positions of a batch
    (transformers' shift: position i's logits predict label i+1)."""
    import torch

    logits, labels = logits[:, :-1], labels[:, 1:]
    keep = labels != -100
    chosen = logits[keep]
    targets = labels[keep]
    target_logit = chosen.gather(-1, targets[:, None]).squeeze(-1)
    others = chosen.scatter(-1, targets[:, None], float("-inf"))
    return float(torch.min(target_logit - others.max(-1).values))


def first_failure(model, chat: ChatFormat, script: list[Dialog]) -> str | None:
    """None if `model` (in eval mode) reproduces every dialog of `script`, else what went wrong
    with the first that it does not: each turn greedily decoded as the agent loop asks for it (the
    chat format's prompt, its stop tokens, the tool-result tokens appended between turns), and
    every scripted token's teacher-forced margin at least MIN_MARGIN."""
    import torch

    decode = chat.tokenizer.decode
    with torch.no_grad(), one_torch_thread():
        for dialog in script:
            ids, mask = encode(chat, dialog)
            logits = model(input_ids=torch.tensor([ids])).logits
            labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask, strict=True)]])
            margin = min_margin(logits, labels)
            context = chat.prompt_ids([{"role": "user", "content": dialog.question}])
            for index, turn in enumerate(dialog.turns):
                want = chat.tokenizer.encode(turn, add_special_tokens=False)
                got = model.generate(
                    torch.tensor([context]),
                    attention_mask=torch.ones(1, len(context), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=len(want) + 16,
                    eos_token_id=list(chat.stop_token_ids),
                    pad_token_id=chat.tokenizer.pad_token_id,
                )[0, len(context) :].tolist()
                if got != want:
                    return (
                        f"dialog {dialog.question!r}, turn {index}: greedy decoding produced "
                        f"{decode(got)!r}, the script says {turn!r}"
                    )
                context += want
                if index < len(dialog.tool_results):
                    context += chat.tool_result_ids(dialog.tool_results[index])
            if margin < MIN_MARGIN:
                return (
                    f"dialog {dialog.question!r}: reproduced, but a scripted token leads the runner-up "
                    f"by only {margin:.3f} < MIN_MARGIN={MIN_MARGIN} logits (another engine may break it)"
                )
    return None


@contextmanager
def one_torch_thread():
    """torch on one thread inside (restored after): the tiny model's ops are too small to share,
    and on a busy 2-core box a second thread made the check ~25x slower (1 s -> 25-30 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
