"""Tool episodes (agent.py) and context management (context.py).

Scripted turns are the ids a model would generate, built with the real tokenizer from
`chat.render` (data, not a stand-in for a library); one test drives episodes on the real
tiny engine. Every end state: final answer, unparsable call, cut-off turn, context
exceeded, max_turns, a failing environment, abort; keep-recent-k and discard-all rewrites
start new segments.
"""

import numpy as np
import pytest

from glm5_jax.data import chat
from glm5_jax.data import tokenizers
from glm5_jax.inference import GenerationOutput
from glm5_jax.rl.envs import agent
from glm5_jax.rl.envs import context as context_lib
from glm5_jax.rl.envs import tasks
from glm5_jax.rl.envs import tools
from glm5_jax.rl.envs.context import ContextPolicy

TOK = tokenizers.ByteTokenizer()
CALC = tasks.get("tool_calc")


def _problem(i=0):
  return CALC.problems("train", i + 1, seed=0)[i]


def _episode(problem=None, **kw):
  kw = {"max_turns": 4, "max_len": 512, **kw}
  return agent.Episode(CALC, problem or _problem(), TOK, "g000001/0", "g000001", 7, **kw)


def _turn_ids(message: dict, thinking=False) -> list[int]:
  """What a model generates for `message` after the generation prompt (stop token included)."""
  head = [{"role": "user", "content": "q"}]
  prompt = chat.render_prompt({"messages": head}, TOK, enable_thinking=thinking)
  return chat.render({"messages": head + [message]}, TOK).ids[len(prompt):].tolist()


def _call(expr: str) -> dict:
  return {"role": "assistant", "content": "",
          "tool_calls": [{"name": "calculator", "arguments": {"expression": expr}}]}


def _answer(text: str) -> dict:
  return {"role": "assistant", "content": text}


def _out(rng, ids, finish="stop", version=3) -> GenerationOutput:
  return GenerationOutput(request_id=0, token_ids=list(ids),
                          logprobs=rng.uniform(-5, 0, len(ids)).tolist(),
                          versions=[version] * len(ids), finish_reason=finish)


def _step(ep, rng, message, version=3):
  """Submits the episode's next prompt, feeds it `message` as the turn, runs its calls."""
  prompt = ep.next_prompt()
  out = _out(rng, _turn_ids(message), version=version)
  calls = ep.on_turn(out)
  if calls:
    ep.on_tool_results(agent.run_calls(calls, ep.tools))
  return prompt, out


def test_a_later_turn_keeps_the_earlier_turns_top_k_records(rng):
  """After a weight swap between turns the engine re-prefills the whole conversation and
  reports its top-k there again, under the new version. Each position keeps the record of
  the turn that sampled the token after it, the version the trainer compares it under."""
  p = _problem()
  ep = _episode(p)
  first = ep.next_prompt()
  o1 = _out(rng, _turn_ids(_call(p.prompt[len("calc: "):])), version=0)
  turn1 = range(len(first) - 1, len(first) + len(o1.token_ids) - 1)
  o1.topk_indices = {q: np.full((2, 4), 1, np.int32) for q in turn1}
  ep.on_tool_results(agent.run_calls(ep.on_turn(o1), ep.tools))
  second = ep.next_prompt()
  o2 = _out(rng, _turn_ids(_answer(p.answer)), version=1)
  end = len(first) + len(o1.token_ids) + len(second) + len(o2.token_ids) - 1
  o2.topk_indices = {q: np.full((2, 4), 2, np.int32) for q in range(end)}   # re-prefilled
  ep.on_turn(o2)
  [tr] = ep.trajectories()
  assert ep.done and sorted(tr.topk) == list(range(end))
  assert {int(tr.topk[q][0, 0]) for q in turn1} == {1}
  assert {int(tr.topk[q][0, 0]) for q in range(end) if q not in turn1} == {2}


def test_tool_episode_row_is_render_of_the_conversation_and_loss_is_the_samples(rng):
  p = _problem()
  ep = _episode(p)
  p1, o1 = _step(ep, rng, _call(p.prompt[len("calc: "):]), version=3)
  p2, o2 = _step(ep, rng, _answer(p.answer), version=4)
  assert ep.done and ep.status == "ok" and ep.reward == 1.0 and ep.error is None
  assert ep.new_session is False and (ep.turns, ep.tool_turns) == (2, 1)
  [tr] = ep.trajectories()
  # TITO: the row is what was submitted and what the engine generated, in order, and it is
  # the chat rendering of the conversation the episode holds.
  assert tr.tokens == p1 + o1.token_ids + p2 + o2.token_ids
  assert tr.tokens == chat.render({"messages": ep.messages}, TOK).ids.tolist()
  norm = lambda msgs: chat.validate({"messages": msgs}, "test")["messages"]
  assert norm(ep.messages) == norm(CALC.sft_record(p)["messages"])   # what SFT taught
  gen = np.r_[np.zeros(len(p1)), np.ones(len(o1.token_ids)), np.zeros(len(p2)),
              np.ones(len(o2.token_ids))]
  assert tr.loss_mask == gen.tolist()
  assert [x for x, m in zip(tr.rollout_logp, gen) if m] == o1.logprobs + o2.logprobs
  assert [x for x, m in zip(tr.rollout_logp, gen) if not m] == [0.0] * int((1 - gen).sum())
  assert tr.versions == [3 if m else -1 for m in gen[:len(p1) + len(o1.token_ids)]] + [
      4 if m else -1 for m in gen[len(p1) + len(o1.token_ids):]]
  assert (tr.id, tr.group_id, tr.prompt_index, tr.reward, tr.status) == (
      "g000001/0#0", "g000001", 7, 1.0, "ok")
  assert tr.finish_reason == "stop" and tr.oldest_version == 3 and tr.newest_version == 4


def test_a_wrong_final_answer_is_ok_with_reward_zero(rng):
  ep = _episode()
  _step(ep, rng, _answer("12"))
  assert (ep.done, ep.status, ep.reward, ep.turns, ep.tool_turns) == (True, "ok", 0.0, 1, 0)


def test_unparsable_tool_call_ends_ok_with_reward_zero_and_the_error(rng):
  ep = _episode()
  ep.next_prompt()
  ids = [TOK.special_id(t) if t in chat.CHAT_TOKENS else t for t in (
      "<tool_call>", *b"calculator", "<arg_key>", *b"expression", "</arg_key>",
      "</tool_call>", "<|observation|>")]
  assert ep.on_turn(_out(rng, ids)) == []
  assert (ep.done, ep.status, ep.reward) == (True, "ok", 0.0)
  assert "does not parse" in ep.error
  [tr] = ep.trajectories()
  assert tr.status == "ok" and tr.error == ep.error and sum(tr.loss_mask) == len(ids)


@pytest.mark.parametrize("finish", ["length", "cache_full"])
def test_a_cut_off_turn_is_truncated(rng, finish):
  ep = _episode()
  ep.next_prompt()
  ids = _turn_ids(_call("1+2"))[:-3]            # no stop token
  assert ep.on_turn(_out(rng, ids, finish=finish)) == []
  assert (ep.status, ep.reward) == ("truncated", 0.0) and finish in ep.error


def test_context_exceeded_is_truncated(rng):
  first = len(_episode().next_prompt()) + len(_turn_ids(_call("1+2")))
  ep = _episode(max_len=first + 4)               # the observation does not fit
  _step(ep, rng, _call("1+2"))
  assert (ep.done, ep.status, ep.reward) == (True, "truncated", 0.0)
  assert "context exceeded" in ep.error
  with pytest.raises(ValueError, match="after the episode ended"):
    ep.next_prompt()
  [tr] = ep.trajectories()
  assert tr.length == first and tr.status == "truncated"
  # A prompt that does not fit ends the episode before its first turn; its record remains.
  tiny = _episode(max_len=5)
  assert tiny.done and tiny.status == "truncated"
  [tr] = tiny.trajectories()
  assert sum(tr.loss_mask) == 0 and tr.status == "truncated"


def test_max_turns_is_truncated(rng):
  ep = _episode(max_turns=2)
  _step(ep, rng, _call("1+2"))
  assert not ep.done
  _step(ep, rng, _call("3+4"))
  assert (ep.done, ep.status, ep.reward) == (True, "truncated", 0.0)
  assert "max_turns=2" in ep.error


@pytest.mark.parametrize("status", ["env_error", "timeout"])
def test_a_failing_environment_ends_with_its_status(rng, status):
  def fails(expression):
    if status == "env_error":
      raise ConnectionError(f"calculator service down ({expression})")
    return tools.ToolResult("slow", "timeout")
  ep = _episode()
  ep.next_prompt()
  calls = ep.on_turn(_out(rng, _turn_ids(_call("1+2"))))
  ep.on_tool_results(agent.run_calls(calls, ep.tools,
                                     tools={"calculator": (fails, ("expression",))}))
  assert (ep.done, ep.status, ep.reward) == (True, status, 0.0)
  assert all(tr.status == status for tr in ep.trajectories())


def test_protocol_misuse_is_refused_and_abort_ends_aborted(rng):
  ep = _episode()
  with pytest.raises(ValueError, match="without a submitted prompt"):
    ep.on_turn(_out(rng, [1]))
  ep.next_prompt()
  with pytest.raises(ValueError, match="twice"):
    ep.next_prompt()
  calls = ep.on_turn(_out(rng, _turn_ids(_call("1+2"))))
  with pytest.raises(ValueError, match="1 tool results for 1 calls|2 tool results"):
    ep.on_tool_results(agent.run_calls(calls * 2, ep.tools))
  ep.abort("worker_dead")
  assert (ep.done, ep.status, ep.error) == (True, "aborted", "worker_dead")
  with pytest.raises(ValueError, match="max_turns=0"):
    _episode(max_turns=0)


# --------------------------------------------------------------------------------------
# Context management
# --------------------------------------------------------------------------------------

def _history(n):
  msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
  for i in range(n):
    msgs += [_call(f"{i}+1"), {"role": "observation", "content": [f"r{i}"]}]
  return msgs


def test_keep_recent_k_replaces_older_observations_only_once():
  msgs = _history(4)
  out = context_lib.keep_recent_k(msgs, 2)
  assert [m["content"] for m in out if m["role"] == "observation"] == [
      [context_lib.PLACEHOLDER], [context_lib.PLACEHOLDER], ["r2"], ["r3"]]
  assert [m for m in out if m["role"] != "observation"] == [
      m for m in msgs if m["role"] != "observation"]
  assert context_lib.keep_recent_k(out, 2) is None          # nothing left to replace
  assert context_lib.keep_recent_k(_history(2), 2) is None
  assert ContextPolicy("keep_recent_k", k=2, max_tokens=100).apply(msgs, 100) is None
  assert ContextPolicy("keep_recent_k", k=2, max_tokens=100).apply(msgs, 101) == out


def test_discard_all_keeps_system_and_user_past_the_threshold():
  msgs = _history(3)
  pol = ContextPolicy("discard_all", max_tokens=50)
  assert pol.apply(msgs, 50) is None
  assert pol.apply(msgs, 51) == msgs[:2]
  assert pol.apply(msgs[:2], 51) is None
  assert ContextPolicy().apply(msgs, 10**9) is None


def test_hierarchical_keeps_recent_k_below_the_threshold_and_discards_above():
  msgs = _history(3)
  pol = ContextPolicy("hierarchical", k=1, max_tokens=50)
  assert pol.apply(msgs, 50) == context_lib.keep_recent_k(msgs, 1) != msgs
  assert pol.apply(msgs, 51) == msgs[:2]


@pytest.mark.parametrize("kw, match", [
    ({"kind": "keep_last"}, "kind='keep_last'.*keep_recent_k"),
    ({"k": -1}, "k=-1"), ({"max_tokens": 1.5}, "max_tokens=1.5"),
    ({"kind": "discard_all"}, "max_tokens=0.*discard_all"),
    ({"kind": "hierarchical"}, "max_tokens=0.*hierarchical"),
])
def test_bad_context_policy_names_the_field(kw, match):
  with pytest.raises(ValueError, match=match):
    ContextPolicy(**kw)


def test_keep_recent_k_rewrite_starts_a_new_segment_without_loss_on_its_prompt(rng):
  ep = _episode(context=ContextPolicy("keep_recent_k", k=1))
  prompts, outs = [], []
  for i in range(3):
    p, o = _step(ep, rng, _call(f"{i}+1"), version=i)
    prompts.append(p)
    outs.append(o)
    assert ep.new_session == (i >= 1)              # a rewrite once an observation is old
  _step(ep, rng, _answer("x"), version=9)
  trs = ep.trajectories()
  assert [t.segment_id for t in trs] == [0, 1, 2] and ep.num_segments == 3
  assert [t.id for t in trs] == ["g000001/0#0", "g000001/0#1", "g000001/0#2"]
  assert {(t.status, t.reward) for t in trs} == {("ok", 0.0)}
  # Segment 0: prompt, turn 0, observation 0, turn 1 (its sampled tokens only).
  assert trs[0].tokens == prompts[0] + outs[0].token_ids + prompts[1] + outs[1].token_ids
  # Segment 1 starts with the re-rendered conversation, observation 0 replaced (no loss).
  head = ep.messages[:1] + [_call("0+1"),
                            {"role": "observation", "content": [context_lib.PLACEHOLDER]}]
  want = chat.render_prompt({"messages": head + [_call("1+1"), {"role": "observation",
                                                                  "content": ["2"]}]}, TOK,
                            enable_thinking=False).tolist()
  assert trs[1].tokens[:len(want)] == want == prompts[2]
  assert trs[1].loss_mask == [0.0] * len(want) + [1.0] * len(outs[2].token_ids)
  assert trs[1].versions[len(want):] == [2] * len(outs[2].token_ids)
  assert chat.parse_assistant(trs[2].tokens[-len(_turn_ids(_answer("x"))):], TOK).content == "x"


def test_discard_all_restarts_from_the_prompt_in_a_new_segment(rng):
  first = len(_episode().next_prompt())
  ep = _episode(context=ContextPolicy("discard_all", max_tokens=first + 30))
  p0, _ = _step(ep, rng, _call("1+2"))              # row ~ first + 40 > T: discard
  assert ep.new_session and ep.messages == _episode().messages
  p1, _ = _step(ep, rng, _answer(ep.problem.answer))
  assert p1 == p0 and ep.status == "ok" and ep.reward == 1.0
  assert [t.segment_id for t in ep.trajectories()] == [0, 1]


# --------------------------------------------------------------------------------------
# On the real tiny engine
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tiny_cfg, tiny_params):
  from glm5_jax.inference import Engine  # pylint: disable=g-import-not-at-top
  return Engine(tiny_cfg, tiny_params, max_batch=4, max_len=128, block_size=64,
                prefill_chunk=64, steps_per_sync=4)


class _Recording(agent.Episode):
  """An Episode that keeps what it asked the engine to process."""

  def next_prompt(self):
    ids = super().next_prompt()
    self.submitted = getattr(self, "submitted", []) + [ids]
    return ids


def test_episodes_on_the_real_engine_keep_its_tokens_untouched(tiny_engine, rng):
  from glm5_jax.inference import SamplingParams  # pylint: disable=g-import-not-at-top
  eps = [_Recording(CALC, _problem(i), TOK, f"g000002/{i}", "g000002", 0, max_turns=3,
                    max_len=tiny_engine.max_len) for i in range(3)]
  outs = {}
  sp = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=chat.stop_ids(TOK),
                      seed=int(rng.integers(1000)))
  driver = agent.Driver(tiny_engine, TOK, max_new_tokens=sp.max_new_tokens,
                        temperature=sp.temperature,
                        on_turn=lambda ep, out: outs.setdefault(ep.rollout_id, []).append(out))
  assert sorted(map(id, driver.run(eps, seed=sp.seed))) == sorted(map(id, eps))
  driver.close()
  assert tiny_engine.num_unfinished == 0
  for ep in eps:
    assert ep.done and ep.status in ("ok", "truncated")
    [tr] = ep.trajectories()
    gen = outs[ep.rollout_id]
    assert tr.tokens == [i for p, o in zip(ep.submitted, gen) for i in p + o.token_ids]
    assert tr.loss_mask == [float(k) for p, o in zip(ep.submitted, gen)
                            for k in [0] * len(p) + [1] * len(o.token_ids)]
    assert [x for x, m in zip(tr.rollout_logp, tr.loss_mask) if m] == [
        x for o in gen for x in o.logprobs]
    assert [v for v, m in zip(tr.versions, tr.loss_mask) if m] == [0] * int(sum(tr.loss_mask))
    assert tr.topk and set(tr.topk) >= {len(ep.submitted[0]) - 1}
  # Distinct sampling streams per rollout: the three samples differ.
  assert len({tuple(outs[ep.rollout_id][0].token_ids) for ep in eps}) == 3


# --------------------------------------------------------------------------------------
# Interactive chat (chat_session.py, experiments/chat.py)
# --------------------------------------------------------------------------------------

class _ScriptedEngine:
  """Sessions and turns as the Engine has them, each turn's ids taken from `script` (data):
  records every session's tokens so the test can compare them with chat.render."""

  def __init__(self, script):
    self.script, self.sessions, self.ended, self._turns = list(script), {}, [], {}

  def new_session(self):
    sid = f"s{len(self.sessions)}"
    self.sessions[sid] = []
    return sid

  def end_session(self, sid):
    self.ended.append(sid)

  def submit(self, ids, sampling, *, session_id):
    del sampling
    ids_out = self.script.pop(0)
    self.sessions[session_id] += list(ids) + ids_out
    self._turns[len(self._turns)] = ids_out
    return [len(self._turns) - 1]

  def wait(self, rids):
    return [GenerationOutput(r, self._turns[r], [0.0] * len(self._turns[r]),
                             [0] * len(self._turns[r]), "stop") for r in rids]


def test_chat_reply_runs_tool_calls_and_continues_the_session():
  from glm5_jax.rl.envs import chat_session  # pylint: disable=g-import-not-at-top
  engine = _ScriptedEngine([_turn_ids(_call("17*23")), _turn_ids(_answer("391")),
                            _turn_ids(_answer("bye"))])
  lines = []
  msgs = chat_session.run(engine, TOK, ["17*23?\n", "\n", "thanks\n", "/quit\n", "more\n"],
                          None, tools=("calculator",), write=lines.append)
  assert lines == ["user: 17*23?", 'tool: calculator({"expression": "17*23"}) -> [ok] 391',
                   "assistant: 391", "user: thanks", "assistant: bye"]
  assert [m["role"] for m in msgs] == ["user", "assistant", "observation", "assistant", "user",
                                       "assistant"]
  # Session 0 holds the first reply: exactly the chat rendering of that conversation.
  assert engine.sessions["s0"] == chat.render({"messages": msgs[:4]}, TOK).ids.tolist()
  assert engine.ended == ["s0", "s1"] and not engine.script
  with pytest.raises(ValueError, match="'shell'"):
    chat_session.run(engine, TOK, [], None, tools=("shell",))


@pytest.mark.slow    # ~7 s of compilation (one-lane prefill) on top of the episodes test
def test_chat_on_the_real_engine_prints_turns_and_forgets_failed_replies(tiny_engine):
  from glm5_jax.inference import SamplingParams  # pylint: disable=g-import-not-at-top
  from glm5_jax.rl.envs import chat_session  # pylint: disable=g-import-not-at-top
  lines = []
  # The episodes test's shapes (prompt length, max_new_tokens): no new compilation.
  sp = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=chat.stop_ids(TOK))
  first, second = _problem(0).prompt, _problem(1).prompt
  msgs = chat_session.run(tiny_engine, TOK, [first + "\n", "/reset\n", second + "\n"], sp,
                          tools=("calculator",), write=lines.append)
  assert lines[0] == f"user: {first}" and lines.index("(conversation reset)") > 0
  assert f"user: {second}" in lines
  # Random weights rarely stop within 8 tokens: a cut-off reply is reported, not kept.
  cut = [s for s in lines if s.startswith("(no answer: cut off after 8 tokens")]
  assert len(cut) + sum(m["role"] == "assistant" for m in msgs) >= 1
  assert [m["content"] for m in msgs if m["role"] == "user"] in ([], [second])
  assert tiny_engine.num_unfinished == 0


@pytest.mark.slow
def test_chat_cli_reads_stdin_with_a_saved_checkpoint(tmp_path, tiny_cfg, tiny_params):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from glm5_jax import orbax_io  # pylint: disable=g-import-not-at-top
  wd = orbax_io.save_params(str(tmp_path / "ckpt"), tiny_cfg, tiny_params)
  run = subprocess.run(
      [sys.executable, "-m", "experiments.chat", f"--checkpoint={wd}", "--tools=calculator",
       "--max_new_tokens=6", "--max_len=128", "--temperature=0"],
      input="what is 2+2?\n/reset\nhello\n", capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  out = run.stdout.splitlines()
  assert out[0] == "user: what is 2+2?" and "(conversation reset)" in out
  assert "user: hello" in out
  bad = subprocess.run([sys.executable, "-m", "experiments.chat",
                        f"--checkpoint={tmp_path / 'missing'}"], input="", capture_output=True,
                       text=True, timeout=300)
  assert bad.returncode != 0 and "error:" in bad.stderr


class _BatchEngine:
  """`engine.generate` as the GRPO evaluation calls it, each response's ids from `script`."""
  max_batch = 2

  def __init__(self, script):
    self.script, self.prompts = list(script), []

  def generate(self, prompts, sampling):
    assert sampling.temperature == 0.0
    self.prompts += prompts
    return [GenerationOutput(0, ids, [0.0] * len(ids), [0] * len(ids), "stop")
            for ids in (self.script.pop(0) for _ in prompts)]


def test_heldout_accuracy_counts_answers_and_thinking_turns():
  from glm5_jax.rl.envs import rewards  # pylint: disable=g-import-not-at-top
  from glm5_jax.rl.envs import rollout  # pylint: disable=g-import-not-at-top
  arith = tasks.get("arith", min_digits=1, max_digits=2, ops="+")
  problems = arith.problems("heldout", 3, seed=0)
  worked = lambda p, answer: {"role": "assistant", "content": answer,
                              "reasoning": arith.reasoning(p)}
  engine = _BatchEngine([_turn_ids(_answer(problems[0].answer), thinking=True),
                         _turn_ids(worked(problems[1], problems[1].answer), thinking=True),
                         _turn_ids(worked(problems[2], "x"), thinking=True)])
  ev = rollout.heldout_accuracy(engine, arith, rewards.get("arith"), problems, TOK,
                                max_new_tokens=32, enable_thinking=True)
  assert ev == {"accuracy": 2 / 3, "reward_mean": 2 / 3, "thinking_rate": 2 / 3, "problems": 3}
  assert engine.prompts == [rollout.prompt_ids(arith, p, TOK, enable_thinking=True)
                            for p in problems]
