"""Question answering over a local document set with a `search` tool (BM25, no downloads).

The documents are either generated from a seed — short fact sheets about invented towns, so no
model can know the answers without searching — or read from a directory of .txt files (then the
tasks, with their answers, are given too). `search(query)` returns the top documents by Okapi
BM25 (k1=1.5, b=0.75, lower-cased word tokens). The reward is 1 when the answer's words appear,
in order, in the final reply. Questions are split into training and held-out ones by a hash of
the question (`eval_fraction`), so evaluation asks only questions training never asked.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pathlib
import random
import re
from collections.abc import Sequence

from nonstop.agentic.environment import SPLITS, Split, Task, ToolEnvironment, check_split, split_of
from nonstop.agentic.tools import Tool, ToolSet
from nonstop.models.chat import Message, ToolCall

_WORD = re.compile(r"\w+")
_SYLLABLES = ("ka", "lo", "mi", "ru", "ven", "dor", "sel", "tam", "bri", "zo", "nel", "gar")
_EXPORTS = ("copper", "wool", "salt", "glass", "honey", "timber", "silk", "tea")
_PROVINCES = ("Varn", "Osk", "Peld", "Thyme", "Ulm", "Quessa")


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Document:
    title: str
    text: str


class BM25Index:
    """Okapi BM25 over a fixed list of documents."""

    def __init__(self, documents: Sequence[Document], *, k1: float = 1.5, b: float = 0.75):
        if not documents:
            raise ValueError("BM25Index needs at least one document")
        self.documents = list(documents)
        self.k1, self.b = k1, b
        self._tf = [collections.Counter(tokenize(f"{d.title} {d.text}")) for d in documents]
        self._length = [sum(tf.values()) for tf in self._tf]
        self._mean_length = sum(self._length) / len(self._length)
        df = collections.Counter(term for tf in self._tf for term in tf)
        n = len(documents)
        self._idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def scores(self, query: str) -> list[float]:
        terms = tokenize(query)
        scores = []
        for tf, length in zip(self._tf, self._length, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / self._mean_length)
            scores.append(sum(self._idf.get(t, 0.0) * tf[t] * (self.k1 + 1) / (tf[t] + norm)
                              for t in terms if t in tf))  # fmt: skip
        return scores

    def search(self, query: str, k: int = 3) -> list[Document]:
        """The top `k` documents with a positive score, best first (ties by position)."""
        scores = self.scores(query)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [self.documents[i] for i in order[:k] if scores[i] > 0]


def load_documents(directory: str | pathlib.Path) -> list[Document]:
    """Every .txt file under `directory`, titled by its file name without the suffix."""
    paths = sorted(pathlib.Path(directory).rglob("*.txt"))
    return [Document(title=p.stem, text=p.read_text(encoding="utf-8")) for p in paths]


def generate_corpus(seed: int, num_docs: int = 24) -> tuple[list[Document], list[Task]]:
    """Fact sheets about invented towns and three questions per town."""
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < num_docs:
        names.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize())
    documents, tasks = [], []
    for name in sorted(names):
        province, export = rng.choice(_PROVINCES), rng.choice(_EXPORTS)
        year = rng.randint(1100, 1900)
        text = (f"{name} is a town in the province of {province}. It was founded in {year}. "
                f"Its main export is {export}.")  # fmt: skip
        documents.append(Document(title=name, text=text))
        tasks += [
            Task(prompt=f"In which province is {name}?", answer=province, info={"doc": name}),
            Task(prompt=f"When was {name} founded?", answer=str(year), info={"doc": name}),
            Task(prompt=f"What is the main export of {name}?", answer=export, info={"doc": name}),
        ]
    return documents, tasks


def contains_answer(task: Task, reply: str) -> float:
    """1.0 if the answer's words appear consecutively in the reply (case-insensitive)."""
    answer, words = tokenize(task.answer), tokenize(reply)
    n = len(answer)
    return float(n > 0 and any(words[i : i + n] == answer for i in range(len(words) - n + 1)))


def format_hits(hits: Sequence[Document]) -> str:
    return "\n".join(f"[{d.title}] {d.text}" for d in hits) if hits else "No results."


def search_tool(index: BM25Index, *, k: int = 3) -> Tool:
    def search(query: str) -> str:
        return format_hits(index.search(query, k))

    return Tool(
        search, name="search", description="Search the document collection.",
        parameters={"type": "object", "required": ["query"],
                    "properties": {"query": {"type": "string", "minLength": 1}}},
        timeout_s=5.0,
    )  # fmt: skip


class RetrievalEnv(ToolEnvironment):
    """Questions over a document set. Pass `documents` and `tasks` (e.g. from load_documents) or
    neither, to use the corpus generated from `corpus_seed`."""

    system_prompt = "Use the search tool to find the answer, then reply with it."

    def __init__(
        self,
        *,
        documents: Sequence[Document] | None = None,
        tasks: Sequence[Task] | None = None,
        corpus_seed: int = 0,
        top_k: int = 3,
        max_turns: int = 4,
        index: BM25Index | None = None,
        eval_fraction: float = 0.25,
    ):
        if (documents is None) != (tasks is None):
            raise ValueError("RetrievalEnv: give both documents and tasks, or neither")
        if documents is None:
            documents, tasks = generate_corpus(corpus_seed)
        if not tasks:
            raise ValueError("RetrievalEnv: tasks must not be empty")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(
                f"RetrievalEnv.eval_fraction={eval_fraction!r} is invalid; "
                "expected a number in (0, 1), exclusive"
            )
        self.tasks = list(tasks)
        self.eval_fraction = eval_fraction
        self.splits: dict[Split, list[Task]] = {
            split: [t for t in self.tasks if split_of(t.prompt, eval_fraction) == split]
            for split in SPLITS
        }
        self.index = index or BM25Index(documents)  # share one index across episodes
        self.top_k = top_k
        super().__init__(tools=ToolSet([search_tool(self.index, k=top_k)]),
                         reward_fn=contains_answer, max_turns=max_turns)  # fmt: skip

    def sample_task(self, seed: int, split: Split = "train") -> Task:
        """A question of `split` (by a hash of the question)."""
        check_split(split)
        if not self.splits[split]:
            raise ValueError(
                f"RetrievalEnv.eval_fraction={self.eval_fraction} leaves no {split} "
                f"question among {len(self.tasks)}; change it or add tasks"
            )
        return random.Random(seed).choice(self.splits[split])

    def demonstration(self, task: Task) -> list[Message]:
        call = ToolCall(name="search", arguments={"query": task.prompt}, id="call_0")
        hits = format_hits(self.index.search(task.prompt, self.top_k))
        return [
            Message.system(self.system_prompt),
            Message.user(task.prompt),
            Message.assistant(tool_calls=[call]),
            Message.tool(hits, tool_call_id="call_0", name="search"),
            Message.assistant(task.answer),
        ]
