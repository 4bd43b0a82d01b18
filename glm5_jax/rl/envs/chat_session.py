"""An interactive chat with tool calls, for people to try a model (`experiments/chat.py`).

Each user line starts a new engine session holding the conversation so far, re-rendered
(`chat.render_prompt`); within the reply the model may call tools: each call runs
(`glm5_jax.rl.envs.tools.call`, only the `tools` given), the results are appended to the session
as an observation (`chat.render_observation`) and the model continues, up to `max_turns`
model turns per user line. Commands: `/reset` forgets the conversation, `/quit` ends.

Printed, one line each: `assistant: <text>` (and `thinking: <text>` when there is
reasoning), `tool: name(args) -> [status] result`, `format error: ...` for a turn that does
not parse (it is dropped from the history), `(no answer: <why>)` when the turn was cut off
or the context is full, and `(cancelled)` for a reply stopped by `Interrupts` (Ctrl-C).
A line of bytes that is not UTF-8 is reported through `warn` and skipped.

Seeds: model turn t of the chat (counted from 0 over the whole chat, tool rounds, failed and
cancelled turns included) samples with `turn_seed(seed, t)`, so every turn draws fresh noise
and the same seed with the same input lines replays the chat exactly.

Ctrl-C (`Interrupts`, installed by the CLI as the SIGINT handler): during a reply it only
sets a flag, which the reply checks between engine steps (`Engine.step`) and between tool
calls; the turn is then cancelled through `Engine.cancel` and the chat returns to the
prompt. A KeyboardInterrupt is never raised inside the engine: jaxlib compiles on XLA's
threads while the main thread waits interruptibly, so an exception raised in that wait
leaves a compile running, and the interpreter's teardown under it segfaults. At the prompt
(no device work in flight) Ctrl-C raises KeyboardInterrupt; so does a second Ctrl-C during
one reply, once that reply has been cancelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import sys
from typing import Callable, Iterable, Iterator

import numpy as np

from glm5_jax.data import chat
from glm5_jax.rl.envs import tools as tools_lib


def turn_seed(seed: int, turn: int) -> int:
  """The sampling seed of model turn `turn` (>= 0) of a chat with seed `seed`: NumPy's
  independent child `turn` of the seed, `SeedSequence(seed mod 2**64, spawn_key=(turn,))`,
  in [0, 2**31) (the engine's int32 seed)."""
  if turn < 0:
    raise ValueError(f"turn_seed: turn={turn!r}, expected an int >= 0")
  ss = np.random.SeedSequence(seed % 2**64, spawn_key=(turn,))
  return int(ss.generate_state(1, np.uint32)[0] >> 1)


class Interrupts:
  """A SIGINT handler (`signal.signal(signal.SIGINT, interrupts)`) for the chat.

  Inside `deferred()` a SIGINT is counted (`count`), never raised, and `requested` turns
  true; outside it raises KeyboardInterrupt.
  """

  def __init__(self):
    self.busy, self.count = False, 0

  def __call__(self, signum, frame):
    del signum, frame
    if not self.busy:
      raise KeyboardInterrupt
    self.count += 1

  @property
  def requested(self) -> bool:
    return self.count > 0

  @contextlib.contextmanager
  def deferred(self):
    """SIGINTs inside are counted (from 0), not raised."""
    self.busy, self.count = True, 0
    try:
      yield self
    finally:
      self.busy = False


def _one_line(text: str) -> str:
  return text.replace("\n", "\\n")


def _generate(engine, sid, ids, sampling, cancelled: Callable[[], bool] | None):
  """The turn's GenerationOutput; None when `cancelled()` came true first (checked after
  every engine step, so a turn that finished in the step a Ctrl-C landed in is dropped too;
  a request still running is cancelled, as it is when an exception goes through)."""
  [rid] = engine.submit(ids, sampling, session_id=sid)
  if cancelled is None:
    return engine.wait([rid])[0]
  out = None
  try:
    while out is None and not cancelled():
      out = next((o for o in engine.step() if o.request_id == rid), None)
  finally:
    if out is None:
      engine.cancel(rid)
  return None if cancelled() else out


def _for_turn(sampling, turn: int):
  if sampling is None:                    # an engine stand-in that ignores sampling
    return None
  return dataclasses.replace(sampling, seed=turn_seed(sampling.seed, turn))


def reply(engine, tokenizer, messages: list[dict], sampling, *, tools: tuple[str, ...],
          max_turns: int, enable_thinking: bool, write: Callable[[str], None],
          turns: Iterator[int] | None = None,
          cancelled: Callable[[], bool] | None = None) -> list[dict]:
  """The model's reply to `messages` (ending with a user turn); returns the messages to
  append (assistant turns and observations), [] when the reply failed or was cancelled.

  `turns` numbers the chat's model turns (their seeds: `turn_seed`); `cancelled` (None: the
  reply is not cancellable) is polled between engine steps and tool calls.
  """
  turns = itertools.count() if turns is None else turns
  new: list[dict] = []
  sid = engine.new_session()
  try:
    ids = chat.render_prompt({"messages": messages}, tokenizer,
                             enable_thinking=enable_thinking).tolist()
    for _ in range(max_turns):
      try:
        out = _generate(engine, sid, ids, _for_turn(sampling, next(turns)), cancelled)
      except ValueError as e:                       # the conversation no longer fits
        write(f"(no answer: {e}; /reset starts over)")
        return []
      if out is None:
        write("(cancelled)")
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
      if cancelled is not None and cancelled():
        write("(cancelled)")
        return []
      new.append({"role": "observation", "content": [r.text for r in results]})
      ids = chat.render_observation([r.text for r in results], tokenizer,
                                    enable_thinking=enable_thinking).tolist()
    write(f"(no answer: max_turns={max_turns} model turns used)")
    return []
  finally:
    engine.end_session(sid)


def _decode(line: str | bytes, n: int, warn: Callable[[str], None]) -> str | None:
  """`line` as text; None (reported through `warn`) when its bytes are not UTF-8."""
  if isinstance(line, str):
    return line
  try:
    return line.decode("utf-8")
  except UnicodeDecodeError as e:
    bad = line[e.start:e.end].hex(" ")
    warn(f"error: input line {n} is not UTF-8 ({e.reason}: byte(s) {bad} at offset "
         f"{e.start}); skipped")
    return None


def _stderr(s: str) -> None:
  print(s, file=sys.stderr, flush=True)


def run(engine, tokenizer, lines: Iterable[str | bytes], sampling, *,
        tools: tuple[str, ...] = (), max_turns: int = 4, enable_thinking: bool = False,
        system: str | None = None, write: Callable[[str], None] = print,
        warn: Callable[[str], None] = _stderr,
        interrupts: Interrupts | None = None) -> list[dict]:
  """Reads user lines (str, or UTF-8 bytes) until they run out or `/quit`; returns the
  conversation's messages.

  With `interrupts` (installed as the SIGINT handler) each reply runs `deferred` and is
  cancellable (`Engine.step` / `Engine.cancel`); a second SIGINT during one reply raises
  KeyboardInterrupt once the reply is cancelled, as one at the prompt does.
  """
  unknown = sorted(set(tools) - set(tools_lib.TOOLS))
  if unknown:
    raise ValueError(f"--tools: {unknown} unknown; expected some of {tuple(tools_lib.TOOLS)}")
  if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
    raise ValueError(f"--max_turns={max_turns!r}: expected an int >= 1")
  head = [] if system is None else [{"role": "system", "content": system}]
  messages, turns = list(head), itertools.count()
  cancelled = None if interrupts is None else (lambda: interrupts.requested)
  for n, line in enumerate(lines, 1):
    line = _decode(line, n, warn)
    if line is None:
      continue
    line = line.rstrip("\n")
    if not line.strip():
      continue
    if line.strip() == "/quit":
      break
    if line.strip() == "/reset":
      messages = list(head)
      write("(conversation reset)")
      continue
    messages.append({"role": "user", "content": line})
    with interrupts.deferred() if interrupts else contextlib.nullcontext():
      write(f"user: {line}")            # from here on Ctrl-C cancels this reply
      new = reply(engine, tokenizer, messages, sampling, tools=tuple(tools),
                  max_turns=max_turns, enable_thinking=enable_thinking, write=write,
                  turns=turns, cancelled=cancelled)
    if new:
      messages += new
    else:                                 # a failed reply leaves no trace in the history
      messages.pop()
    if interrupts and interrupts.count > 1:
      raise KeyboardInterrupt             # Ctrl-C twice during one reply: quit
  return messages
