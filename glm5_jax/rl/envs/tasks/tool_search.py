"""Which standard-library module is this? "which module: heap priority" -> search -> "heapq".

A problem picks a module of `tools.search_corpus()` (the running interpreter's stdlib
module docstrings) and `min_words`..`max_words` distinct words of its docstring's first
paragraph (not its name, no stop words, in their order) as the question; it is kept only when BM25 over the corpus
ranks that module first for the question, so the search tool always finds the answer in its
top hit. The SFT conversation calls `search(query=<the words>)`, shows the tool's real
output and answers the module name; the verifier compares the name exactly (GLM-5, arXiv
2602.15763, section 3: search agents with checkable answers, here at toy scale). The corpus,
so the problem set, depends on the Python version that builds it.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from glm5_jax.rl.envs import tools
from glm5_jax.rl.envs.tasks import problem as problem_lib

NAME = "tool_search"
TOOLS = ("search",)
MAX_RESPONSE_BYTES = 32
PREFIX = "which module: "
STOP_WORDS = frozenset(
    "a an and are as at be by for from in into is it of on or the this that to with".split())
_TRIES = 100


@dataclasses.dataclass(frozen=True)
class Config:
  """min_words, max_words: question length in words (1..6)."""
  min_words: int = 2
  max_words: int = 3

  def __post_init__(self):
    if not (isinstance(self.min_words, int) and isinstance(self.max_words, int)
            and 1 <= self.min_words <= self.max_words <= 6):
      raise ValueError(f"tool_search min_words={self.min_words}, max_words={self.max_words}: "
                       "expected 1 <= min_words <= max_words <= 6")


def _candidates(doc) -> list[str]:
  """Question words: the first paragraph's distinct words, not the name, no stop words."""
  name = set(tools.words(doc.name))
  seen = []
  for w in tools.words(doc.text):
    if len(w) > 2 and w not in STOP_WORDS and w not in name and w not in seen:
      seen.append(w)
  return seen


@functools.lru_cache(maxsize=4)
def _answerable(docs):
  """The docs whose name fits the answer cap (a reply also needs room around it)."""
  return tuple(d for d in docs if len(d.name) <= MAX_RESPONSE_BYTES - 8)


def sample(rng: np.random.Generator, config: Config) -> problem_lib.Content:
  """Prompt "which module: <words>", answer the module's name; BM25's top hit is the answer."""
  docs = tools.search_corpus()
  answers = _answerable(docs)
  for _ in range(_TRIES):
    doc = answers[int(rng.integers(len(answers)))]
    cands = _candidates(doc)
    k = int(rng.integers(config.min_words, config.max_words + 1))
    if len(cands) < k:
      continue
    picked = sorted(rng.choice(len(cands), size=k, replace=False).tolist())
    query = " ".join(cands[i] for i in picked)
    hits = tools.bm25(query, docs)
    if hits and hits[0][1].name == doc.name and (len(hits) == 1 or hits[1][0] < hits[0][0]):
      return problem_lib.Content(PREFIX + query, doc.name)
  raise ValueError(f"tool_search: no question in {_TRIES} tries whose top BM25 hit is its "
                   "module; the corpus is too small")


def solution_calls(problem) -> list[dict]:
  return [{"name": "search", "arguments": {"query": problem.prompt[len(PREFIX):]}}]


check = problem_lib.exact_answer
