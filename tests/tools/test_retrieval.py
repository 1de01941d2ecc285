"""BM25 against a brute-force implementation of the formula and a hand-computed case."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from libra.rollout.tools.retrieval import BM25Index, Document, RetrievalTool, load_index, tokenize
from libra.trajectory import ToolStatus


def brute_force_bm25(docs: list[list[str]], query: list[str], k1: float, b: float) -> list[float]:
    """Straight from the definition, recounting everything per query term."""
    n = len(docs)
    avgdl = sum(len(d) for d in docs) / n
    scores = []
    for doc in docs:
        total = 0.0
        for term in query:
            df = sum(1 for d in docs if term in d)
            if df == 0:
                continue
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            tf = doc.count(term)
            total += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(doc) / avgdl))
        scores.append(total)
    return scores


def test_hand_computed_scores():
    # 3 docs, lengths 2, 3, 1 (avgdl 2); query "cat": df=2, idf=ln(1 + 1.5/2.5)=ln 1.6.
    index = BM25Index(
        [Document("a", "", "cat cat"), Document("b", "", "cat dog dog"), Document("c", "", "fish")],
        k1=1.2,
        b=0.75,
    )
    scores = index.scores("cat")
    idf = math.log(1.6)
    assert scores[0] == pytest.approx(idf * 2 * 2.2 / (2 + 1.2))  # |d| = avgdl: norm = k1
    assert scores[1] == pytest.approx(idf * 1 * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 1.5)))
    assert 2 not in scores
    assert [hit.document.doc_id for hit in index.search("cat", top_k=5)] == ["a", "b"]


def test_matches_brute_force_on_random_collections():
    rng = random.Random(7)
    vocabulary = [f"w{i}" for i in range(30)]
    for _ in range(20):
        docs = [
            [rng.choice(vocabulary) for _ in range(rng.randrange(1, 25))] for _ in range(rng.randrange(1, 15))
        ]
        k1, b = rng.uniform(0.5, 2.0), rng.uniform(0, 1)
        index = BM25Index([Document(str(i), "", " ".join(d)) for i, d in enumerate(docs)], k1=k1, b=b)
        query = [rng.choice(vocabulary) for _ in range(rng.randrange(1, 5))]
        expected = brute_force_bm25(docs, query, k1, b)
        got = index.scores(" ".join(query))
        assert [got.get(i, 0.0) for i in range(len(docs))] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_collection_on_disk_is_indexed_once_and_reloaded_when_changed(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [
        {"id": "1", "title": "Paris", "contents": "Paris is the capital of France."},
        {"id": "2", "text": "Berlin is the capital of Germany."},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    index = load_index(path)
    assert load_index(path) is index
    assert index.search("capital of germany", 1)[0].document.doc_id == "2"
    path.write_text(
        path.read_text() + json.dumps({"id": "3", "text": "Rome is the capital of Italy."}) + "\n"
    )
    assert load_index(path) is not index and len(load_index(path).documents) == 3
    (tmp_path / "bad.jsonl").write_text('{"id": "1", "text": "ok"}\n{"id": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_index(tmp_path / "bad.jsonl")


def test_retrieval_tool():
    index = BM25Index(
        [
            Document("d1", "Nile", "The Nile is the longest river in Africa."),
            Document("d2", "Amazon", "The Amazon carries the most water."),
        ]
    )
    tool = RetrievalTool(index, top_k=1)
    result = asyncio.run(tool({"query": "longest river"}))
    assert result.status == ToolStatus.SUCCESS
    assert result.content == "Doc 1 (id d1) Nile: The Nile is the longest river in Africa."
    assert asyncio.run(tool({"query": "zzz"})).content == "No documents found."
    assert asyncio.run(tool({})).status == ToolStatus.FAILURE
    assert tokenize("Hello, World-42!") == ["hello", "world", "42"]
