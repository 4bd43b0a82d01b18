"""Context management for long tool episodes: keep-recent-k and discard-all.

GLM-5 (arXiv 2602.15763, section 3, context management for search agents):
  keep-recent-k: observations older than the last k tool turns are replaced by the fixed
    text "Tool result is omitted to save tokens." (k = 5 in the paper);
  discard-all: when the whole context exceeds T tokens, every turn after the prompt
    (system + user) is dropped and the episode goes on from there.

A policy works on the conversation's message list (`glm5_jax/data/chat.py` records) and
says whether to rewrite it: `apply(messages, n_tokens) -> new messages or None`. A rewrite
breaks the token prefix the engine has cached and the policy sampled from, so the episode
starts a new segment (`glm5_jax/rl/envs/agent.py`): its prompt is the re-rendered conversation
(no loss), the turns sampled after it carry the loss, and it runs in a new engine session.

  kind          rewrites when                                   to
  "none"        never                                           -
  "keep_recent_k"  n_tokens > max_tokens (0: on every turn) and  observations before the last
                   an observation before the last k is not yet   k replaced by PLACEHOLDER
                   the placeholder
  "discard_all" n_tokens > max_tokens and there is a turn after  the leading system / user
                the prompt                                      messages only
  "hierarchical"  the paper's combination: discard_all past max_tokens, keep_recent_k on
                  every other turn
"""

from __future__ import annotations

import dataclasses

KINDS = ("none", "keep_recent_k", "discard_all", "hierarchical")
PLACEHOLDER = "Tool result is omitted to save tokens."


@dataclasses.dataclass(frozen=True)
class ContextPolicy:
  """kind: one of KINDS; k: observations kept by keep_recent_k; max_tokens: the threshold T
  (keep_recent_k: 0 = rewrite on every turn; discard_all, hierarchical: must be > 0)."""
  kind: str = "none"
  k: int = 5
  max_tokens: int = 0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"ContextPolicy kind={self.kind!r}: expected one of {KINDS}")
    for field in ("k", "max_tokens"):
      v = getattr(self, field)
      if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"ContextPolicy {field}={v!r}: expected an int >= 0")
    if self.kind in ("discard_all", "hierarchical") and self.max_tokens <= 0:
      raise ValueError(f"ContextPolicy max_tokens={self.max_tokens}: {self.kind} needs the "
                       "threshold T > 0")

  def apply(self, messages: list[dict], n_tokens: int) -> list[dict] | None:
    """The rewritten messages, or None to keep the context (and its segment) as it is.

    messages: the conversation so far (ending with an observation); n_tokens: its length in
    tokens as the engine holds it (the segment's row after the observation).
    """
    if self.kind == "hierarchical":
      return (discard_all(messages) if n_tokens > self.max_tokens
              else keep_recent_k(messages, self.k))
    if self.kind == "none" or n_tokens <= self.max_tokens:
      return None
    if self.kind == "keep_recent_k":
      return keep_recent_k(messages, self.k)
    return discard_all(messages)


def keep_recent_k(messages: list[dict], k: int) -> list[dict] | None:
  """Observations before the last k: every result replaced by PLACEHOLDER (None: no change)."""
  obs = [i for i, m in enumerate(messages) if m["role"] == "observation"]
  old = obs[:len(obs) - k] if k else obs
  content = lambda m: [m["content"]] if isinstance(m["content"], str) else m["content"]
  if all(r == PLACEHOLDER for i in old for r in content(messages[i])):
    return None
  out = list(messages)
  for i in old:
    out[i] = {**messages[i], "content": [PLACEHOLDER] * len(content(messages[i]))}
  return out


def discard_all(messages: list[dict]) -> list[dict] | None:
  """The leading system / user messages only (None: nothing after them)."""
  head = 0
  while head < len(messages) and messages[head]["role"] in ("system", "user"):
    head += 1
  return None if head == len(messages) else list(messages[:head])
