"""Multi-turn tool episodes: a state machine between a rollout engine and the tools.

GLM-5 (arXiv 2602.15763, section 3) trains agents on multi-turn rollouts with tool calls,
tokens in and tokens out (TITO): what the engine sampled goes to the loss untouched. An
`Episode` holds one rollout of one problem; it never calls the engine or a tool itself, so
one rollout worker drives many episodes on one engine (continuous batching, a session per
episode) and runs their tool calls where it likes (a thread pool):

  ep = Episode(task, problem, tokenizer, "g000003/1", "g000003", 17, max_turns=4, max_len=512)
  while not ep.done:
    ids = ep.next_prompt()                 # first: the prompt; then: observation ids
    if ep.new_session: ...                 # open a new engine session (first turn, rewrite)
    out = <engine turn on ids in the episode's session>
    calls = ep.on_turn(out)                # records out's tokens; [] on a final answer
    if not ep.done:
      ep.on_tool_results([tools.call(c.name, c.arguments, allowed=ep.tools) for c in calls])
  ep.trajectories()                        # one Trajectory per segment, ep.status, ep.reward

`Driver` is that loop over many episodes on one engine (rollout workers, evaluation, tests),
with the tool calls in a thread pool.

Token accounting of a segment (one engine session; `glm5_jax/rl/algorithm/trajectory.py`): its row
is every id submitted (loss 0) and every id the engine generated (loss 1, with the engine's
raw log-prob, weight version and DSA top-k), in order; the observation ids come from
`chat.render_observation`, so the row equals `chat.render` of the conversation. A context
rewrite (`glm5_jax/rl/envs/context.py`) starts a new segment whose first ids are the rewritten
conversation, re-rendered (loss 0), in a new session.

How an episode ends (status, reward; every segment carries both):
  final answer (a turn without tool calls)  "ok", the task's reward of its text (guarded as
                                            `glm5_jax.rl.envs.rewards`); a reward function that
                                            raises: "env_error"
  a turn with a format error (a tool call   "ok", reward 0, `error` says what: the policy's
  that does not parse, stray markers)       mistake is a learning signal, not filtered
  a turn cut off (no stop token: the        "truncated", reward 0
  engine's max_new_tokens or max_len)
  context exceeded (the next prompt does    "truncated", reward 0
  not fit max_len after context management)
  tool calls on turn max_turns              "truncated", reward 0
  a tool result with status env_error /     that status, reward 0 (filtered and refilled by
  timeout (the environment failed)          `glm5_jax/rl/algorithm/groups.py`)
  `abort(reason)` (the orchestrator)        "aborted", reward 0
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import time
from typing import Sequence

from glm5_jax.data import chat
from glm5_jax.inference import SamplingParams
from glm5_jax.rl.algorithm.trajectory import Trajectory
from glm5_jax.rl.envs import context as context_lib
from glm5_jax.rl.envs import rewards as rewards_lib
from glm5_jax.rl.envs import tools as tools_lib
from glm5_jax.rl.envs.tasks import problem as problem_lib


class _Segment:
  """One row: token-aligned lists (trajectory.py's fields) and the engine's top-k."""

  def __init__(self):
    self.tokens, self.loss_mask, self.rollout_logp, self.versions = [], [], [], []
    self.topk: dict | None = None
    self.routing: dict | None = None
    self.finish_reason = ""

  def add_prompt(self, ids):
    n = len(ids)
    self.tokens += [int(i) for i in ids]
    self.loss_mask += [0.0] * n
    self.rollout_logp += [0.0] * n
    self.versions += [-1] * n

  def add_generated(self, out):
    n = len(out.token_ids)
    if len(out.logprobs) != n or len(out.versions) != n:
      raise ValueError(f"GenerationOutput {out.request_id}: {n} token ids, "
                       f"{len(out.logprobs)} logprobs, {len(out.versions)} versions")
    self.tokens += [int(i) for i in out.token_ids]
    self.loss_mask += [1.0] * n
    self.rollout_logp += [float(x) for x in out.logprobs]
    self.versions += [int(v) for v in out.versions]
    if out.topk_indices:
      # A position keeps its first record: a later turn re-prefills the conversation after a
      # weight swap, and the new version's top-k there is not the one that chose the earlier
      # tokens (the trainer compares each token under the version that sampled it).
      self.topk = {**out.topk_indices, **(self.topk or {})}
    if out.routing:                        # the same first-record rule
      self.routing = {**out.routing, **(self.routing or {})}
    self.finish_reason = out.finish_reason


def reward_fn(task):
  """fn(problem, response, *, truncated) -> [0, 1]: task.check behind rewards' guards."""
  return functools.partial(rewards_lib.guarded, task=task.name, check=task.check,
                           max_bytes=task.max_response_bytes)


def stream_of(rollout_id: str, turn: int) -> int:
  """The engine sampling stream of a turn: distinct per rollout and turn, stable (blake2b)."""
  digest = hashlib.blake2b(f"{rollout_id}\0{turn}".encode(), digest_size=4).digest()
  return int.from_bytes(digest, "big") & 0x7FFFFFFF


def first_prompt(problem, tokenizer, *, enable_thinking: bool, system: str | None = None
                 ) -> list[int]:
  """The ids an episode of `problem` submits first: [system?, user], the assistant's turn
  opened."""
  return chat.render_prompt({"messages": problem_lib.prompt_messages(problem, system=system)},
                            tokenizer, enable_thinking=enable_thinking).tolist()


class Episode:
  """One rollout of one problem as a multi-turn tool episode (module docstring)."""

  def __init__(self, task, problem, tokenizer, rollout_id: str, group_id, prompt_index: int,
               *, max_turns: int, max_len: int,
               context: context_lib.ContextPolicy = context_lib.ContextPolicy(),
               enable_thinking: bool = False, system: str | None = None):
    if not isinstance(max_turns, int) or max_turns < 1:
      raise ValueError(f"Episode max_turns={max_turns!r}: expected an int >= 1")
    if not isinstance(max_len, int) or max_len < 2:
      raise ValueError(f"Episode max_len={max_len!r}: expected an int >= 2 (engine rows)")
    self.task, self.problem, self.tokenizer = task, problem, tokenizer
    self.rollout_id, self.group_id, self.prompt_index = rollout_id, group_id, prompt_index
    self.max_turns, self.max_len = max_turns, max_len
    self.context, self.enable_thinking = context, enable_thinking
    self.tools: tuple[str, ...] = tuple(getattr(task, "tools", ()))
    self.messages = problem_lib.prompt_messages(problem, system=system)
    self.turns = 0
    self.tool_turns = 0        # assistant turns that called a tool
    self.done, self.status, self.reward, self.error = False, "ok", 0.0, None
    self.last_turn: chat.AssistantTurn | None = None
    self._segments: list[_Segment] = []
    self._calls: list[chat.ToolCall] = []
    self._pending = self._render_prompt()
    self.new_session = True
    self._check_fits(len(self._pending))

  # ------------------------------------------------------------------ the protocol
  @property
  def stream(self) -> int:
    """Sampling stream for the next turn (`Engine.submit(stream=...)`)."""
    return stream_of(self.rollout_id, self.turns)

  def next_prompt(self) -> list[int]:
    """Ids to submit for the next turn; `new_session` says whether to open a new session."""
    if self.done or self._pending is None:
      raise ValueError(f"episode {self.rollout_id}: next_prompt() "
                       + ("after the episode ended" if self.done else
                          "twice without on_turn / on_tool_results in between"))
    if self.new_session:
      self._segments.append(_Segment())
    ids, self._pending = self._pending, None
    self._segments[-1].add_prompt(ids)
    return list(ids)

  def on_turn(self, out) -> list[chat.ToolCall]:
    """Records the engine's output for the submitted prompt; returns the calls to run."""
    if self.done or self._pending is not None or self._calls:
      raise ValueError(f"episode {self.rollout_id}: on_turn() without a submitted prompt")
    self._segments[-1].add_generated(out)
    self.turns += 1
    turn = self.last_turn = chat.parse_assistant(out.token_ids, self.tokenizer)
    self.tool_turns += bool(turn.tool_calls)
    if turn.ended_by is None or out.finish_reason != "stop":
      self._end("truncated", f"turn {self.turns} cut off ({out.finish_reason}, "
                f"{len(out.token_ids)} tokens, no stop token)")
    elif turn.errors:
      self._end("ok", f"turn {self.turns}: " + "; ".join(turn.errors))
    elif turn.tool_calls and self.turns >= self.max_turns:
      self._end("truncated", f"max_turns={self.max_turns} reached with tool calls pending")
    elif turn.tool_calls:
      self.messages.append(turn.to_message())
      self._calls = list(turn.tool_calls)
    else:
      self.messages.append(turn.to_message())
      reward, err = rewards_lib.safe_call(reward_fn(self.task), self.problem, turn.content,
                                          truncated=False)
      self._end("ok" if err is None else "env_error", err, reward)
    return list(self._calls)

  def on_tool_results(self, results: Sequence[tools_lib.ToolResult]) -> None:
    """Appends the observation (one result per call, in order) and prepares the next prompt."""
    if self.done or not self._calls:
      raise ValueError(f"episode {self.rollout_id}: on_tool_results() without tool calls")
    if len(results) != len(self._calls):
      raise ValueError(f"episode {self.rollout_id}: {len(results)} tool results for "
                       f"{len(self._calls)} calls")
    self._calls = []
    failed = next((r for r in results if r.status != "ok"), None)
    if failed is not None:
      self._end(failed.status, f"tool failed ({failed.status}): {failed.text}")
      return
    texts = [r.text for r in results]
    self.messages.append({"role": "observation", "content": texts})
    obs = chat.render_observation(texts, self.tokenizer,
                                  enable_thinking=self.enable_thinking).tolist()
    row = len(self._segments[-1].tokens) + len(obs)
    rewritten = self.context.apply(self.messages, row)
    if rewritten is None:
      self._pending, self.new_session = obs, False
      self._check_fits(row)
    else:
      self.messages = rewritten
      self._pending, self.new_session = self._render_prompt(), True
      self._check_fits(len(self._pending))

  def abort(self, reason: str) -> None:
    """Ends the episode "aborted" (shutdown, a dead worker); no-op when already done."""
    self.fail("aborted", reason)

  def fail(self, status: str, error: str) -> None:
    """Ends the episode with a failure `status` ("env_error", "timeout", "aborted") found
    outside it, e.g. an environment that could not be set up; no-op when already done."""
    if status not in ("env_error", "timeout", "aborted"):
      raise ValueError(f"Episode.fail: status={status!r}, expected 'env_error', 'timeout' "
                       "or 'aborted'")
    if not self.done:
      self._end(status, error)

  # ------------------------------------------------------------------ results
  def trajectories(self) -> list[Trajectory]:
    """One Trajectory per segment that has sampled tokens (the first segment if none has:
    the rollout's record of how it ended)."""
    segs = [(i, s) for i, s in enumerate(self._segments) if any(s.loss_mask)]
    if not segs:
      first = self._segments[0] if self._segments else None
      if first is None:          # ended before any prompt was submitted
        first = _Segment()
        first.add_prompt(self._render_prompt())
      segs = [(0, first)]
    return [Trajectory(tokens=list(s.tokens), loss_mask=list(s.loss_mask),
                       rollout_logp=list(s.rollout_logp), versions=list(s.versions),
                       rollout_id=self.rollout_id, group_id=self.group_id, segment_id=i,
                       status=self.status, reward=self.reward, finish_reason=s.finish_reason,
                       topk=s.topk, routing=s.routing, error=self.error,
                       prompt_index=self.prompt_index)
            for i, s in segs]

  @property
  def num_segments(self) -> int:
    return len(self._segments)

  # ------------------------------------------------------------------ internals
  def _render_prompt(self) -> list[int]:
    return chat.render_prompt({"messages": self.messages}, self.tokenizer,
                              enable_thinking=self.enable_thinking).tolist()

  def _check_fits(self, row: int) -> None:
    if row > self.max_len:
      self._end("truncated", f"context exceeded: the next prompt needs {row} rows > "
                f"max_len={self.max_len}")

  def _end(self, status: str, error: str | None, reward: float = 0.0) -> None:
    self.done, self.status, self.error, self.reward = True, status, error, float(reward)
    self._pending, self._calls = None, []


def run_calls(calls: Sequence[chat.ToolCall], allowed, tools=None) -> list[tools_lib.ToolResult]:
  """Runs an episode's tool calls in order (`tools.call`, which never raises)."""
  return [tools_lib.call(c.name, c.arguments, allowed=allowed, tools=tools) for c in calls]


class _InlineTools:
  """Runs an episode's tool calls in the driver's pool as they are (no latency, no faults)."""

  @staticmethod
  def submit(pool, calls, allowed):
    return pool.submit(run_calls, calls, allowed)


class Driver:
  """Drives many episodes on one engine: submits their turns (a session each), steps the
  engine, and runs their tool calls in a thread pool so a slow tool stalls only its own
  episode. Single-threaded towards the engine (a rollout worker's loop, evaluation, tests).

    driver = Driver(engine, tokenizer, max_new_tokens=64, temperature=1.0)
    ended = driver.run(episodes, seed=0)       # or: driver.add(ep, seed); driver.poll()

  tools: what runs a turn's calls: `submit(pool, calls, allowed) -> Future of ToolResults`
  (default: `run_calls` as is; rollout workers add simulated latency and faults);
  on_turn(ep, out): a hook after each engine turn is recorded; record_topk: ask the engine
  for each layer's DSA top-k, record_routing: for each MoE layer's routed experts (the
  trainer compares both, and may replay the experts).
  """

  def __init__(self, engine, tokenizer, *, max_new_tokens: int, temperature: float,
               tools=None, threads: int = 8, on_turn=None, record_topk: bool = True,
               record_routing: bool = False):
    self.engine, self.tok = engine, tokenizer
    self.tools = _InlineTools() if tools is None else tools
    self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tools")
    self.max_new_tokens, self.temperature = max_new_tokens, temperature
    self.on_turn, self.record_topk, self.record_routing = on_turn, record_topk, record_routing
    self.stop_ids = chat.stop_ids(tokenizer)
    self._ready: list = []              # episodes whose next turn is to be submitted
    self._by_rid: dict = {}             # engine request id -> episode
    self._tools: dict = {}              # future -> episode
    self._session: dict = {}            # id(episode) -> engine session id
    self._seed: dict = {}               # id(episode) -> sampling seed
    self.stats = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "turns": 0,
                  "engine_steps": 0}

  @property
  def in_flight(self) -> int:
    return len(self._ready) + len(self._by_rid) + len(self._tools)

  def add(self, episode: Episode, seed: int) -> None:
    self._seed[id(episode)] = seed
    self._ready.append(episode)

  def _submit(self, ep: Episode) -> bool:
    """Submits ep's next turn; False if the episode ended instead."""
    key = id(ep)
    if ep.new_session or key not in self._session:
      if key in self._session:
        self.engine.end_session(self._session.pop(key))
      self._session[key] = self.engine.new_session()
    stream = ep.stream
    prompt = ep.next_prompt()
    conversation = len(self.engine.session_tokens(self._session[key]))
    sp = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                        stop_token_ids=self.stop_ids, seed=self._seed[key])
    try:
      (rid,) = self.engine.submit(prompt, sp, session_id=self._session[key],
                                  record_topk=self.record_topk, stream=stream,
                                  record_routing=self.record_routing)
    except ValueError as e:        # the engine refused the turn (the episode checks max_len)
      ep.abort(f"engine refused the turn: {e}")
      return False
    self.stats["prompt_tokens"] += conversation + len(prompt)   # the turn's whole prompt
    self._by_rid[rid] = ep
    return True

  def _close(self, ep: Episode) -> None:
    sid = self._session.pop(id(ep), None)
    if sid is not None:
      self.engine.end_session(sid)
    self._seed.pop(id(ep), None)

  def poll(self) -> list[Episode]:
    """One round: submits ready turns, one engine step, collects finished tool calls.
    Returns the episodes that ended in it."""
    ended = []
    ready, self._ready = self._ready, []
    for ep in ready:
      if ep.done or not self._submit(ep):
        ended.append(ep)
    if self.engine.num_unfinished:
      self.stats["engine_steps"] += 1
      for out in self.engine.step():
        ep = self._by_rid.pop(out.request_id)
        self.stats["turns"] += 1
        self.stats["cached_prompt_tokens"] += out.num_cached_prompt_tokens
        calls = ep.on_turn(out)
        if self.on_turn is not None:
          self.on_turn(ep, out)
        if ep.done:
          ended.append(ep)
        elif calls:
          self._tools[self.tools.submit(self.pool, calls, ep.tools)] = ep
        else:
          self._ready.append(ep)
    for fut in [f for f in self._tools if f.done()]:
      ep = self._tools.pop(fut)
      ep.on_tool_results(fut.result())
      (ended if ep.done else self._ready).append(ep)
    for ep in ended:
      self._close(ep)
    return ended

  def run(self, episodes: Sequence[Episode], seed: int = 0) -> list[Episode]:
    """Runs `episodes` to their end; returns them in the order they ended."""
    for ep in episodes:
      self.add(ep, seed)
    ended = []
    while self.in_flight:
      ended += self.poll()
      if not self.engine.num_unfinished and self._tools and not self._ready:
        time.sleep(0.001)                       # only tools running: do not spin
    return ended

  def close(self) -> None:
    self.pool.shutdown(wait=False, cancel_futures=True)
