"""Local retrieval: Okapi BM25 over a JSONL document collection on disk, and the `retrieve` tool.

The index is an inverted list (term -> [(document, term frequency)]) so a query only touches the
documents that share a term with it. It is built once per collection file and cached in memory,
keyed by the file's path, size and modification time.

Scoring (Robertson/Spärck Jones with the Lucene idf, which is never negative):
    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
    score(d, q) = sum over query terms t (with repeats) of
                  idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.rollout.tools.base import ToolResult
from libra.rollout.tools.interpreter import truncate
from libra.trajectory import ToolStatus

_TOKEN = re.compile(r"\w+", re.UNICODE)


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens; the same function serves documents and queries."""
    return _TOKEN.findall(text.lower())


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class Hit:
    document: Document
    score: float


def load_documents(path: str | Path) -> list[Document]:
    """Reads `{"id", "text" | "contents", "title"?}` lines (Search-R1's corpus uses "contents")."""
    documents = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({exc.msg})") from None
            text = record.get("text", record.get("contents"))
            if not isinstance(text, str):
                raise ValueError(f"{path}:{line_number}: a document needs a string 'text' or 'contents'")
            doc_id = str(record.get("id", line_number))
            documents.append(Document(doc_id, str(record.get("title", "")), text))
    return documents


class BM25Index:
    def __init__(self, documents: list[Document], k1: float = 1.2, b: float = 0.75) -> None:
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.documents = documents
        self.k1, self.b = k1, b
        self._postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self._doc_lengths: list[int] = []
        for index, document in enumerate(documents):
            terms = Counter(tokenize(f"{document.title} {document.text}"))
            self._doc_lengths.append(sum(terms.values()))
            for term, count in terms.items():
                self._postings[term].append((index, count))
        num_docs = len(documents)
        self.avg_doc_length = sum(self._doc_lengths) / num_docs if num_docs else 0.0
        self._idf = {
            term: math.log(1.0 + (num_docs - len(postings) + 0.5) / (len(postings) + 0.5))
            for term, postings in self._postings.items()
        }

    def scores(self, query: str) -> dict[int, float]:
        """BM25 score of every document sharing a term with `query` (document index -> score)."""
        scores: dict[int, float] = defaultdict(float)
        k1, b, avgdl = self.k1, self.b, self.avg_doc_length or 1.0
        for term in tokenize(query):
            idf = self._idf.get(term)
            if idf is None:
                continue
            for index, tf in self._postings[term]:
                norm = k1 * (1.0 - b + b * self._doc_lengths[index] / avgdl)
                scores[index] += idf * tf * (k1 + 1.0) / (tf + norm)
        return scores

    def search(self, query: str, top_k: int = 3) -> list[Hit]:
        """The `top_k` best documents, best first; ties go to the earlier document."""
        ranked = sorted(self.scores(query).items(), key=lambda item: (-item[1], item[0]))
        return [Hit(self.documents[index], score) for index, score in ranked[:top_k]]


_cache: dict[tuple[str, int, int], BM25Index] = {}
_cache_lock = threading.Lock()


def load_index(path: str | Path) -> BM25Index:
    """The index of the collection at `path`, built on first use and cached until the file changes."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        index = _cache.get(key)
        if index is None:
            index = BM25Index(load_documents(resolved))
            _cache[key] = index
        return index


def format_hits(hits: list[Hit]) -> str:
    if not hits:
        return "No documents found."
    parts = []
    for rank, hit in enumerate(hits, start=1):
        title = f" {hit.document.title}" if hit.document.title else ""
        parts.append(f"Doc {rank} (id {hit.document.doc_id}){title}: {hit.document.text}")
    return "\n".join(parts)


class RetrievalTool:
    """`retrieve`: the top documents of the local collection for a search query."""

    name = "retrieve"
    description = "Search the local document collection and return the best matching documents."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "Search keywords."}},
        "required": ["query"],
    }

    def __init__(self, index: BM25Index, top_k: int = 3, max_result_chars: int = 4000) -> None:
        self.index = index
        self.top_k = top_k
        self.max_result_chars = max_result_chars

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        start = time.monotonic()
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return ToolResult("error: argument 'query' must be a non-empty string", ToolStatus.FAILURE)
        # In-memory and sub-millisecond on tool-sized collections: no thread hop needed.
        hits = self.index.search(query, self.top_k)
        content = truncate(format_hits(hits), self.max_result_chars)
        return ToolResult(content, ToolStatus.SUCCESS, time.monotonic() - start)
