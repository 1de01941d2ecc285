"""Procedural agentic tasks: deterministic per seed, long-tailed call counts, ground truth and
demonstrations that real tools reproduce."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from libra.rollout.tools.interpreter import PythonInterpreterTool
from libra.rollout.tools.registry import ToolRegistry
from libra.rollout.tools.retrieval import RetrievalTool, load_index
from libra.tasks.datasets import TaskType
from libra.tasks.procedural import generate_suite, replay_demonstration, sample_num_calls
from libra.tasks.rewards import math_reward


def test_same_seed_same_tasks_other_seed_other_tasks():
    a, b = generate_suite(20, seed=3, family="mixed"), generate_suite(20, seed=3, family="mixed")
    assert a.tasks == b.tasks and a.documents == b.documents
    c = generate_suite(20, seed=4, family="mixed")
    assert [t.record.prompt for t in a.tasks] != [t.record.prompt for t in c.tasks]
    assert {t.record.metadata["family"] for t in a.tasks} == {"arithmetic", "lookup"}


def test_call_counts_are_long_tailed():
    rng = random.Random(0)
    counts = Counter(sample_num_calls(rng, max_calls=24) for _ in range(5000))
    assert counts[1] > counts[2] > counts[4] > counts[8]  # decreasing
    assert counts[1] / 5000 == pytest.approx(1 / sum(k**-1.5 for k in range(1, 25)), abs=0.03)
    assert sum(v for k, v in counts.items() if k >= 10) > 50  # a real tail
    geometric = Counter(sample_num_calls(rng, 24, "geometric") for _ in range(5000))
    assert geometric[1] / 5000 == pytest.approx(0.35, abs=0.03)
    with pytest.raises(ValueError, match="distribution"):
        sample_num_calls(rng, 5, "uniform")


def test_arithmetic_ground_truth_by_evaluating_the_prompt():
    # Independent check: execute the equations as written in the prompt.
    for task in generate_suite(30, seed=1, family="arithmetic").tasks:
        lines = [line for line in task.record.prompt.splitlines() if line.startswith("x_")]
        assert len(lines) == task.num_calls + 1 == len(task.demonstration) + 1
        scope: dict = {}
        for line in lines:
            exec(line, {}, scope)
        assert str(scope[f"x_{task.num_calls}"]) == task.record.ground_truth
        assert task.record.task_type == TaskType.PROCEDURAL
        assert math_reward(task.final_response, task.record.ground_truth) == 1.0


def test_demonstrations_replay_through_the_real_tools(loop, pool, tmp_path):
    suite = generate_suite(12, seed=5, family="mixed", max_calls=6)
    corpus = suite.write_collection(tmp_path / "collection.jsonl")
    registry = ToolRegistry([PythonInterpreterTool(pool), RetrievalTool(load_index(corpus), top_k=1)])
    for task in suite.tasks:
        transcript = loop.run_until_complete(replay_demonstration(task, registry.call))
        assert len(transcript) == task.num_calls
        # The last result names the answer: a model imitating the transcript gets reward 1.
        assert task.record.ground_truth in transcript[-1][1].content
        if task.record.metadata["family"] == "arithmetic":
            assert transcript[-1][1].content.strip() == task.record.ground_truth


def test_lookup_chains_need_every_hop():
    suite = generate_suite(10, seed=2, family="lookup")
    index = load_index_from(suite)
    for task in suite.tasks:
        # The first document names the second key, never the answer (unless it is one hop).
        first = index.search(task.demonstration[0].call.arguments["query"], 1)[0].document.text
        assert (task.record.ground_truth in first) == (task.num_calls == 1)
    assert len({d["id"] for d in suite.documents}) == len(suite.documents)


def load_index_from(suite):
    from libra.rollout.tools.retrieval import BM25Index, Document

    return BM25Index([Document(d["id"], d["title"], d["text"]) for d in suite.documents])


def test_bad_arguments():
    with pytest.raises(ValueError, match="family"):
        generate_suite(1, family="chess")
    with pytest.raises(ValueError, match="num_tasks"):
        generate_suite(-1)
