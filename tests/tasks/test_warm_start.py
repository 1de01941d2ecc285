"""The warm-started tiny policy (issue #5): SFT rendering in the agent loop's exact token format,
the in-process evaluation engine against an independent greedy reference, the cache key, and
the built model's measured behaviour on held-out procedural tasks.

The built model comes from `cached_warm_start` (built once per machine under
~/.cache/libra/tiny-models/<key>; set LIBRA_CACHE_DIR to move it). Its test needs root for the
python tool's sandbox, like the other sandbox tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from libra.rollout.chat import ChatFormat, ToolCallError
from libra.rollout.tools.base import ToolCall
from libra.rollout.types import SamplingSpec
from libra.tasks.procedural import generate_suite
from libra.tasks.sft import (
    DIRECT_ANSWER_LEAD,
    IGNORE_INDEX,
    Example,
    make_batches,
    python_printed_results,
    render_checked,
    render_demonstrations,
    render_direct_answer,
    render_example,
    tool_call_text,
)
from libra.tasks.tiny_model import TinyModelSpec
from libra.tasks.warm_start import WarmStartConfig, cache_key


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    from libra.tasks.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("warm") / "random")


@pytest.fixture(scope="session")
def tokenizer(random_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(random_model_dir)


# ---------------------------------------------------------------- the easy arithmetic family


def test_easy_arithmetic_ground_truth_by_running_the_prompt():
    """Independent check: run the prompt's steps as Python statements, in order."""
    suite = generate_suite(60, seed=2, family="arithmetic", max_calls=6, difficulty="easy")
    assert {t.num_calls for t in suite.tasks} >= {1, 2, 3}
    for task in suite.tasks:
        lines = task.record.prompt.splitlines()
        scope = {"x": int(lines[0].removeprefix("Start with x=").split(".")[0])}
        steps = [line for line in lines if line.startswith("step ")]
        assert len(steps) == task.num_calls == len(task.demonstration)
        for number, (line, step) in enumerate(zip(steps, task.demonstration, strict=True), start=1):
            label, statement = line.split(": ", 1)
            assert label == f"step {number}"
            assert step.call.arguments["code"] == f"# step {number}\nx={scope['x']}\n{statement}\nx"
            exec(statement, {}, scope)
            assert 0 <= scope["x"] < 100 and step.expected_in_result == str(scope["x"])
        assert task.record.ground_truth == str(scope["x"])
        assert task.final_response == f"<answer>{scope['x']}</answer>"


def test_difficulty_is_validated_and_standard_is_unchanged():
    with pytest.raises(ValueError, match="difficulty"):
        generate_suite(1, difficulty="hard")
    assert (
        generate_suite(8, seed=1, family="mixed").tasks
        == generate_suite(8, seed=1, family="mixed", difficulty="standard").tasks
    )


@pytest.mark.multiprocess  # sandbox worker processes for the python tool
def test_easy_demonstrations_replay_through_the_python_tool(loop, pool, tokenizer):
    from libra.rollout.tools.interpreter import PythonInterpreterTool
    from libra.tasks.procedural import replay_demonstration

    tool = PythonInterpreterTool(pool)

    async def call(c):
        return await tool(c.arguments)

    tasks = generate_suite(8, seed=4, family="arithmetic", max_calls=6, difficulty="easy").tasks
    for task in tasks:
        transcript = loop.run_until_complete(replay_demonstration(task, call))
        assert [r.content for _, r in transcript] == python_printed_results(task)
    # Rendering with the prediction checked against 3 replays: what rendering 8 replays gives.
    chat = ChatFormat(tokenizer, tools=())
    checked = loop.run_until_complete(render_checked(chat, tasks, call, 4000, num_replayed=3))
    assert checked == loop.run_until_complete(render_demonstrations(chat, tasks, call, 4000))

    async def wrong(c):  # a tool whose output format differs from the prediction
        result = await tool(c.arguments)
        return dataclasses.replace(result, content=f"value: {result.content}")

    with pytest.raises(RuntimeError, match="python_printed_results"):
        loop.run_until_complete(render_checked(chat, tasks, wrong, 4000, num_replayed=3))


def test_tokenizer_keeps_easy_demonstrations_short(tokenizer):
    """The factory's tokenizer knows the warm-start family's text: small numbers are one token,
    and a six-call demonstration fits comfortably in the recipe's training length."""
    for number in range(100):  # as in a result line, after `x=` in a call, and in `<answer>`
        assert len(tokenizer.encode(f"{number}", add_special_tokens=False)) == 1, number
    chat = ChatFormat(tokenizer, tools=())
    suite = generate_suite(300, seed=7, family="arithmetic", max_calls=6, difficulty="easy")
    lengths = {}
    for task in suite.tasks:
        example = render_example(chat, task, [f"{s.expected_in_result}\n" for s in task.demonstration])
        lengths[task.num_calls] = max(lengths.get(task.num_calls, 0), len(example.token_ids))
    assert lengths[1] <= 160 and lengths[6] <= WarmStartConfig().max_train_length


# ---------------------------------------------------------------- config and cache key


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"family": "poems"}, "family"),
        ({"max_steps": 0}, "max_steps"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"success_low": 0.6, "success_high": 0.5}, "success_low"),
        ({"batch_tokens": 100}, "batch_tokens"),
        ({"difficulty": "hard"}, "difficulty"),
        ({"direct_answer_fraction": 1.0}, "direct_answer_fraction"),
        ({"direct_answer_fraction": -0.1}, "direct_answer_fraction"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WarmStartConfig(**kwargs)


def test_cache_key_is_a_function_of_every_input():
    base = WarmStartConfig()
    assert cache_key(base) == cache_key(WarmStartConfig())
    changed = [
        dataclasses.replace(base, spec=TinyModelSpec(seed=1)),
        dataclasses.replace(base, suite_seed=1),
        dataclasses.replace(base, num_train_tasks=base.num_train_tasks + 1),
        dataclasses.replace(base, learning_rate=base.learning_rate * 2),
        dataclasses.replace(base, stop_at_success=base.success_low),
        dataclasses.replace(base, direct_answer_fraction=0.0),
    ]
    keys = {cache_key(c) for c in changed}
    assert cache_key(base) not in keys and len(keys) == len(changed)


# ---------------------------------------------------------------- rendering


def test_rendered_demonstration_is_the_agent_loops_token_sequence(tokenizer):
    """Prompt, each call turn (stop token included), `tool_result_ids` of each result, final
    answer with EOS: concatenated without re-tokenization, loss mask 1 exactly on model turns,
    and each call turn parses back to the demonstrated call."""
    chat = ChatFormat(tokenizer, tools=())
    task = next(t for t in generate_suite(40, seed=3, family="arithmetic").tasks if t.num_calls >= 2)
    results = [step.expected_in_result for step in task.demonstration]
    example = render_example(chat, task, results)

    expected = chat.prompt_ids([{"role": "user", "content": task.record.prompt}])
    expected_mask = [0] * len(expected)
    for step, result in zip(task.demonstration, results, strict=True):
        turn = tokenizer.encode(tool_call_text(step.call), add_special_tokens=False)
        assert turn[-1] == chat.tool_call_end_id  # the stop token ends the turn, as vLLM returns it
        assert chat.parse_tool_call(turn) == step.call
        result_ids = chat.tool_result_ids(result)
        expected += turn + result_ids
        expected_mask += [1] * len(turn) + [0] * len(result_ids)
    final = tokenizer.encode(task.final_response, add_special_tokens=False) + [chat.eos_id]
    assert example.token_ids == expected + final
    assert example.loss_mask == expected_mask + [1] * len(final)


def test_direct_answer_trains_the_choice_and_the_frame_not_the_value(tokenizer):
    """No call: the prompt, then the lead words and the answer tags with loss, the value without
    (a guessed value would teach the answer token to ignore the tool result it copies)."""
    chat = ChatFormat(tokenizer, tools=())
    task = generate_suite(1, seed=0, family="arithmetic", difficulty="easy").tasks[0]
    example = render_direct_answer(chat, task)
    prompt = chat.prompt_ids([{"role": "user", "content": task.record.prompt}])
    assert example.token_ids[: len(prompt)] == prompt and not any(example.loss_mask[: len(prompt)])
    answer = example.token_ids[len(prompt) :]
    assert answer[-1] == chat.eos_id
    assert tokenizer.decode(answer, skip_special_tokens=True) == DIRECT_ANSWER_LEAD + task.final_response
    value = tokenizer.encode(task.record.ground_truth, add_special_tokens=False)
    untrained = [t for t, m in zip(answer, example.loss_mask[len(prompt) :], strict=True) if not m]
    assert untrained == value
    # The first model token is not the one the tool path's final turns open with.
    assert tokenizer.decode(answer[:1]).strip() != "<"


def test_render_refuses_a_result_count_that_does_not_match(tokenizer):
    chat = ChatFormat(tokenizer, tools=())
    task = generate_suite(1, seed=0, family="lookup").tasks[0]
    with pytest.raises(ValueError, match="results"):
        render_example(chat, task, [])


def test_tool_call_text_round_trips_through_the_parser(tokenizer):
    chat = ChatFormat(tokenizer, tools=())
    call = ToolCall("python", {"code": 'x = 5\nprint("a\\"b", x % 7)'})
    assert chat.parse_tool_call(tokenizer.encode(tool_call_text(call), add_special_tokens=False)) == call
    with pytest.raises(ToolCallError):
        chat.parse_tool_call(tokenizer.encode("<tool_call>\n{oops\n</tool_call>", add_special_tokens=False))


def test_batches_cover_an_epoch_with_masked_labels_and_a_token_cap():
    rng = random.Random(0)
    examples = []
    for index in range(23):
        length = rng.randint(5, 60)
        ids = [100 + index] * length
        mask = [rng.randint(0, 1) for _ in range(length)]
        examples.append(Example(ids, mask))
    batches = make_batches(examples, max_tokens=128, max_length=40, pad_token_id=0, rng=random.Random(1))
    rows = 0
    for batch in batches:
        assert batch.input_ids.numel() <= 128
        rows += batch.input_ids.shape[0]
        for row in range(batch.input_ids.shape[0]):
            first = int(batch.input_ids[row, 0])
            example = examples[first - 100]
            cut = min(len(example.token_ids), 40)
            labels = batch.labels[row].tolist()
            masked = [
                t if m else IGNORE_INDEX for t, m in zip(example.token_ids, example.loss_mask, strict=True)
            ]
            assert labels[:cut] == masked[:cut]
            assert all(label == IGNORE_INDEX for label in labels[cut:])
            assert int(batch.attention_mask[row].sum()) == cut
        assert batch.num_loss_tokens == int((batch.labels != IGNORE_INDEX).sum())
    assert rows == len(examples)


def test_group_lengths_decide_which_examples_share_a_batch():
    """Short examples grouped by another length join the batches of that length, in their share,
    instead of forming batches of their own."""
    short = [Example([1] * 4, [1] * 4) for _ in range(8)]
    long = [Example([2] * 30, [1] * 30) for _ in range(8)]
    examples = short + long

    def kinds(batches):
        return [sorted({int(row[0]) for row in b.input_ids}) for b in batches]

    own = make_batches(examples, max_tokens=128, max_length=40, pad_token_id=0, rng=random.Random(0))
    assert [1] in kinds(own)  # by their own lengths the short ones form a batch of their own
    paired = [30] * 16  # each short example grouped as if it were a long one
    mixed = make_batches(examples, 128, 40, 0, random.Random(0), group_lengths=paired)
    assert all(kind == [1, 2] for kind in kinds(mixed) if len(kind) > 0) and len(kinds(mixed)) == 4
    with pytest.raises(ValueError, match="group lengths"):
        make_batches(examples, 128, 40, 0, random.Random(0), group_lengths=[30])


# ---------------------------------------------------------------- the in-process engine


def _reference_greedy(model, context: list[int], stop_ids: set[int], max_tokens: int) -> list[int]:
    """Greedy decoding by full forward passes over the unpadded context (no cache, no batch)."""
    import torch

    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([context + out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] in stop_ids:
                break
    return out


def test_local_engine_batches_like_unbatched_greedy_decoding(random_model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from libra.tasks.hf_engine import LocalGreedyInstance

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()
    chat = ChatFormat(tokenizer, tools=())
    contexts = [
        chat.prompt_ids([{"role": "user", "content": text}])
        for text in ("What is 2+2?", "Start at the registry entry kazori17 and follow it.", "x")
    ]
    # A frequent token of the random model's greedy output serves as a stop token, so rows stop at
    # different lengths inside one batch.
    probe = _reference_greedy(model, contexts[0], set(), 12)
    stops = (probe[5], chat.eos_id)
    sampling = [SamplingSpec(temperature=0.0, max_tokens=n, stop_token_ids=stops) for n in (12, 7, 20)]
    instance = LocalGreedyInstance(model, tokenizer.pad_token_id, max_model_len=512)

    async def generate_all():
        calls = [
            instance.generate(f"r{i}", c, s) for i, (c, s) in enumerate(zip(contexts, sampling, strict=True))
        ]
        segments = await asyncio.gather(*calls)
        await instance.close()
        return segments

    segments = asyncio.run(generate_all())
    for context, spec, segment in zip(contexts, sampling, segments, strict=True):
        expected = _reference_greedy(model, context, set(stops), spec.max_tokens)
        assert segment.token_ids == expected
        stopped = expected[-1] in stops
        assert (segment.stop_token_id == expected[-1]) == stopped
        logprobs = segment.chunks[0].logprobs
        with torch.no_grad():
            reference = model(input_ids=torch.tensor([context + expected])).logits[0].log_softmax(-1)
        for i, token in enumerate(expected):
            assert logprobs[i] == pytest.approx(float(reference[len(context) - 1 + i, token]), abs=1e-4)


def test_local_engine_refuses_sampling(random_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from libra.tasks.hf_engine import LocalGreedyInstance

    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    instance = LocalGreedyInstance(model, tokenizer.pad_token_id, max_model_len=64)
    with pytest.raises(ValueError, match="greedily"):
        asyncio.run(instance.generate("r", [1, 2], SamplingSpec(temperature=1.0)))
