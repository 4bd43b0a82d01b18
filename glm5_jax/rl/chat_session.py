"""An interactive chat with tool calls, for people to try a model (`experiments/chat.py`).

Each user line starts a new engine session holding the conversation so far, re-rendered
(`chat.render_prompt`); within the reply the model may call tools: each call runs
(`glm5_jax.rl.tools.call`, only the `tools` given), the results are appended to the session
as an observation (`chat.render_observation`) and the model continues, up to `max_turns`
model turns per user line. Commands: `/reset` forgets the conversation, `/quit` ends.

Printed, one line each: `assistant: <text>` (and `thinking: <text>` when there is
reasoning), `tool: name(args) -> [status] result`, `format error: ...` for a turn that does
not parse (it is dropped from the history), and `(no answer: <why>)` when the turn was cut
off or the context is full.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable

from glm5_jax.data import chat
from glm5_jax.rl import tools as tools_lib


def _one_line(text: str) -> str:
  return text.replace("\n", "\\n")


def _generate(engine, sid, ids, sampling):
  return engine.wait(engine.submit(ids, sampling, session_id=sid))[0]


def reply(engine, tokenizer, messages: list[dict], sampling, *, tools: tuple[str, ...],
          max_turns: int, enable_thinking: bool, write: Callable[[str], None]) -> list[dict]:
  """The model's reply to `messages` (ending with a user turn); returns the messages to
  append (assistant turns and observations), [] when the reply failed."""
  new: list[dict] = []
  sid = engine.new_session()
  try:
    ids = chat.render_prompt({"messages": messages}, tokenizer,
                             enable_thinking=enable_thinking).tolist()
    for _ in range(max_turns):
      try:
        out = _generate(engine, sid, ids, sampling)
      except ValueError as e:                       # the conversation no longer fits
        write(f"(no answer: {e}; /reset starts over)")
        return []
      turn = chat.parse_assistant(out.token_ids, tokenizer)
      if turn.reasoning:
        write(f"thinking: {_one_line(turn.reasoning)}")
      if turn.ended_by is None:
        write(f"assistant: {_one_line(turn.content)}")
        write(f"(no answer: cut off after {len(out.token_ids)} tokens, {out.finish_reason})")
        return []
      if turn.errors or not (turn.content or turn.reasoning or turn.tool_calls):
        write(f"assistant: {_one_line(turn.content)}")
        write("format error: " + ("; ".join(turn.errors) or "empty turn"))
        return []
      if turn.content:
        write(f"assistant: {_one_line(turn.content)}")
      new.append(turn.to_message())
      if not turn.tool_calls:
        return new
      results = [tools_lib.call(c.name, c.arguments, allowed=tools) for c in turn.tool_calls]
      for c, r in zip(turn.tool_calls, results):
        write(f"tool: {c.name}({json.dumps(c.arguments, ensure_ascii=False)}) -> "
              f"[{r.status}] {_one_line(r.text)}")
      new.append({"role": "observation", "content": [r.text for r in results]})
      ids = chat.render_observation([r.text for r in results], tokenizer,
                                    enable_thinking=enable_thinking).tolist()
    write(f"(no answer: max_turns={max_turns} model turns used)")
    return []
  finally:
    engine.end_session(sid)


def run(engine, tokenizer, lines: Iterable[str], sampling, *, tools: tuple[str, ...] = (),
        max_turns: int = 4, enable_thinking: bool = False, system: str | None = None,
        write: Callable[[str], None] = print) -> list[dict]:
  """Reads user lines until they run out or `/quit`; returns the conversation's messages."""
  unknown = sorted(set(tools) - set(tools_lib.TOOLS))
  if unknown:
    raise ValueError(f"--tools: {unknown} unknown; expected some of {tuple(tools_lib.TOOLS)}")
  head = [] if system is None else [{"role": "system", "content": system}]
  messages = list(head)
  for line in lines:
    line = line.rstrip("\n")
    if not line.strip():
      continue
    if line.strip() == "/quit":
      break
    if line.strip() == "/reset":
      messages = list(head)
      write("(conversation reset)")
      continue
    write(f"user: {line}")
    messages.append({"role": "user", "content": line})
    new = reply(engine, tokenizer, messages, sampling, tools=tuple(tools),
                max_turns=max_turns, enable_thinking=enable_thinking, write=write)
    if new:
      messages += new
    else:                                 # a failed reply leaves no trace in the history
      messages.pop()
  return messages
