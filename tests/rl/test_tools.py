"""Tools (calculator, python, search), their statuses, and the tool tasks' SFT data."""

import functools
import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from glm5_jax.data import chat
from glm5_jax.data import tokenizers
from glm5_jax.rl.envs import tasks
from glm5_jax.rl.envs import tools
from glm5_jax.rl.envs.tasks import tool_search

# --------------------------------------------------------------------------------------
# calculator
# --------------------------------------------------------------------------------------


def _random_expr(rng, depth=3) -> str:
  if depth == 0 or rng.integers(3) == 0:
    return str(int(rng.integers(0, 10**int(rng.integers(1, 6)))))
  op = ["+", "-", "*", "//", "%"][int(rng.integers(5))]
  return f"({_random_expr(rng, depth - 1)}{op}{_random_expr(rng, depth - 1)})"


def test_calculator_equals_python_on_random_integer_expressions(rng):
  for _ in range(200):
    expr = _random_expr(rng)
    try:
      want = str(eval(expr))  # pylint: disable=eval-used  (the test's oracle, trusted input)
    except ZeroDivisionError:
      want = "error: division by zero"
    assert tools.call("calculator", {"expression": expr}) == tools.ToolResult(want), expr


@pytest.mark.parametrize("expr, want", [
    ("7/2", "3.5"), ("-3**2", "-9"), ("2**-1", "0.5"), ("1.5*4", "6.0"), (" 12 + 30 ", "42"),
    ("2**300", "error: exponent 300 is too large"),
    ("10**59*10", "error: result has more than 60 digits"),
    ("1e308*10", "error: result has more than 60 digits"),
    ("__import__('os').system('echo hi')", "error: unsupported Call"),
    ("(1).__class__", "error: unsupported Attribute"),
    ("x+1", "error: unsupported Name"),
    ("1+", "error: cannot parse '1+'"),
    ("'a'*3", "error: unsupported Constant"),
])
def test_calculator_values_and_refusals_are_ok_results(expr, want):
  got = tools.call("calculator", {"expression": expr})
  assert got.status == "ok" and got.text.startswith(want), got


# --------------------------------------------------------------------------------------
# registry: the model's mistakes are "ok", the environment's are not
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, args, want", [
    ("calc", {"expression": "1"}, "error: unknown tool 'calc'; tools: calculator, python, "
                                  "search"),
    ("calculator", {}, "error: calculator takes arguments expression; missing expression"),
    ("calculator", {"expression": "1", "x": 2}, "error: calculator takes arguments "
                                                "expression; unknown x"),
])
def test_bad_calls_are_ok_results_that_name_the_mistake(name, args, want):
  assert tools.call(name, args) == tools.ToolResult(want)


def test_a_tool_outside_the_episodes_tools_is_unknown():
  got = tools.call("python", {"code": "print(1)"}, allowed=("calculator",))
  assert got == tools.ToolResult("error: unknown tool 'python'; tools: calculator")


def test_a_tool_that_raises_or_returns_garbage_is_an_env_error():
  def broken(expression):
    raise OSError(f"disk gone while computing {expression}")
  registry = {"calculator": (broken, ("expression",)),
              "odd": (lambda: "not a ToolResult", ())}
  got = tools.call("calculator", {"expression": "1+1"}, tools=registry)
  assert got.status == "env_error" and "OSError: disk gone while computing 1+1" in got.text
  assert tools.call("odd", {}, tools=registry).status == "env_error"
  with pytest.raises(ValueError, match="status='broken'"):
    tools.ToolResult("x", "broken")


# --------------------------------------------------------------------------------------
# python (the sandbox)
# --------------------------------------------------------------------------------------

def test_python_returns_stdout_and_the_error_tail_as_ok():
  assert tools.call("python", {"code": "print(sum(range(10)))"}) == tools.ToolResult("45\n")
  got = tools.call("python", {"code": "print('a'); 1/0"})
  assert got.status == "ok" and got.text.startswith("a\n[error]")
  assert "ZeroDivisionError" in got.text


def test_python_timeout_has_status_timeout():
  registry = {"python": (functools.partial(tools.python, timeout_s=0.5), ("code",))}
  t0 = time.perf_counter()
  got = tools.call("python", {"code": "while True: pass"}, tools=registry)
  assert got == tools.ToolResult("timeout after 0.5 s", "timeout")
  assert time.perf_counter() - t0 < 5.0


# --------------------------------------------------------------------------------------
# search
# --------------------------------------------------------------------------------------

def test_search_corpus_is_fast_deterministic_and_read_not_imported():
  code = ("import sys, time; t = time.perf_counter(); from glm5_jax.rl.envs import tools; "
          "c = tools.search_corpus(); dt = time.perf_counter() - t; "
          "print(len(c), dt, 'antigravity' in sys.modules or 'tkinter' in sys.modules, "
          "hash(tuple(c)) == hash(tools.search_corpus()))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout.split()
  assert int(out[0]) >= 50 and float(out[1]) < 1.0 and out[2:] == ["False", "True"], out
  names = [d.name for d in tools.search_corpus()]
  assert names == sorted(names) and len(set(names)) == len(names)
  assert "heapq" in names and tools.search_corpus() is tools.search_corpus()


def test_bm25_matches_the_formula_on_a_hand_made_corpus():
  docs = (tools.Doc("alpha", "-", "red fish blue fish"), tools.Doc("beta", "-", "red car"),
          tools.Doc("gamma", "-", "green tea and more green"))
  ix_terms = [f"{d.name} {d.name} {d.text}".split() for d in docs]
  avg = sum(map(len, ix_terms)) / 3

  def score(i, q):
    s = 0.0
    for t in q.split():
      df = sum(t in terms for terms in ix_terms)
      f = ix_terms[i].count(t)
      if f:
        idf = math.log(1 + (3 - df + 0.5) / (df + 0.5))
        s += idf * f * 2.5 / (f + 1.5 * (0.25 + 0.75 * len(ix_terms[i]) / avg))
    return s

  got = tools.bm25("Fish, RED!", docs)
  assert [d.name for _, d in got] == ["alpha", "beta"]
  np.testing.assert_allclose([s for s, _ in got], [score(0, "fish red"), score(1, "fish red")],
                             rtol=1e-12)
  assert tools.bm25("purple", docs) == []


def test_search_tool_lists_the_top_hits():
  got = tools.call("search", {"query": "heap queue algorithm"})
  assert got.status == "ok"
  lines = got.text.split("\n")
  assert lines[0].startswith("heapq: ") and len(lines) <= tools.SEARCH_HITS
  assert tools.call("search", {"query": "zzzqqq"}) == tools.ToolResult("no results")


# --------------------------------------------------------------------------------------
# tool tasks
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", tasks.tool_names())
def test_tool_task_sft_record_teaches_the_call_and_renders(name):
  task = tasks.get(name)
  tok = tokenizers.ByteTokenizer()
  # tool_python: each check runs the sandbox (~0.2 s), so fewer problems.
  for p in task.problems("train", 3 if name == "tool_python" else 20, seed=3):
    rec = task.sft_record(p)
    user, call, obs, answer = rec["messages"]
    assert user == {"role": "user", "content": p.prompt}
    assert [c["name"] for c in call["tool_calls"]] == list(task.tools)
    # The observation is what the tool really returns; the answer is the reference answer.
    c = call["tool_calls"][0]
    assert obs["content"] == [tools.call(c["name"], c["arguments"]).text]
    assert answer["content"] == p.answer and task.check(p, answer["content"]) == 1.0
    r = chat.render(rec, tok)
    assert len(r.ids) < 400
    # Both assistant turns carry loss, the observation does not.
    text = tok.decode(r.ids[r.loss_mask > 0], skip_special_tokens=False)
    assert text.startswith(f"<think></think><tool_call>{c['name']}<arg_key>")
    assert text.endswith(f"</tool_call><|observation|><think></think>{p.answer}<|endoftext|>")
    assert "<tool_response>" not in text


def test_tool_calc_answers_are_calculator_results_and_search_answers_top_hits():
  for p in tasks.get("tool_calc").problems("train", 50, seed=0):
    assert p.prompt.startswith("calc: ") and len(p.prompt) <= 20
    assert tools.calculate(p.prompt[len("calc: "):]) == p.answer
  for p in tasks.get("tool_search").problems("heldout", 50, seed=0):
    query = p.prompt[len(tool_search.PREFIX):]
    hits = tools.bm25(query)
    assert hits[0][1].name == p.answer and (len(hits) == 1 or hits[1][0] < hits[0][0])
    assert p.answer not in query.split() and len(p.prompt) <= 64


def test_tool_python_reference_outputs_are_what_the_sandbox_prints():
  task = tasks.get("tool_python")
  problems = task.problems("train", 200, seed=1)
  for sig in ("sum(range(", "len(set(", "[::-1]", "''.join(sorted(", "sum(map(int"):
    assert any(sig in p.prompt for p in problems), sig
  for p in problems[:: 40]:
    code = p.prompt[len("py: "):]
    assert tools.call("python", {"code": code}) == tools.ToolResult(p.answer + "\n")
    assert eval(code.replace("print(", "str(", 1)) == p.answer  # pylint: disable=eval-used
  assert max(len(p.prompt) for p in problems) <= 64
  assert max(len(p.answer) for p in problems) <= task.max_response_bytes


def test_tool_task_options_are_checked_and_registered_apart():
  assert set(tasks.tool_names()) == {"tool_calc", "tool_search", "tool_python"}
  assert not set(tasks.tool_names()) & set(tasks.names())
  with pytest.raises(ValueError, match="max_digits=10"):
    tasks.get("tool_calc", max_digits=10)
  with pytest.raises(ValueError, match="min_words=0"):
    tasks.get("tool_search", min_words=0)
  with pytest.raises(ValueError, match="templates=.*'nope'"):
    tasks.get("tool_python", templates=("nope",))
  with pytest.raises(ValueError, match="'nope'.*tool_calc.*tool_search"):
    tasks.get("nope")


def test_write_sft_data_cli_writes_tool_conversations(tmp_path):
  out = tmp_path / "calc.jsonl"
  subprocess.run([sys.executable, "-m", "experiments.write_sft_data", "--task=tool_calc",
                  "--n=30", f"--out={out}", "--options=max_digits=4"], check=True,
                 capture_output=True)
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(recs) == 30 and all(r["id"].startswith("tool_calc-train-") for r in recs)
  assert all(r["messages"][1]["tool_calls"][0]["name"] == "calculator" for r in recs)
  for r in recs:
    chat.validate(r, "written")


def test_no_tool_fraction_mixes_direct_answers_into_the_tool_sft_data(tmp_path):
  task = tasks.get("tool_calc", min_digits=1, max_digits=2)
  path = str(tmp_path / "mix.jsonl")
  assert task.write_sft(path, 400, seed=3, no_tool_fraction=0.7) == 400
  recs = [json.loads(line) for line in open(path)]
  problems = task.problems("train", 400, seed=3)
  direct = [len(r["messages"]) == 2 for r in recs]
  assert 0.63 < np.mean(direct) < 0.77            # 0.7 of 400, binomial sigma 0.023
  for r, p, d in zip(recs, problems, direct):
    chat.validate(r, "written")
    assert r == (tasks.sft_record(p) if d else task.sft_record(p))
  again = str(tmp_path / "again.jsonl")
  task.write_sft(again, 400, seed=3, no_tool_fraction=0.7)
  assert open(again).read() == open(path).read()
  task.write_sft(again, 50, seed=3, no_tool_fraction=0.0)
  assert all(len(json.loads(line)["messages"]) == 4 for line in open(again))
  with pytest.raises(ValueError, match="no_tool_fraction=1.5"):
    task.write_sft(again, 5, seed=3, no_tool_fraction=1.5)
  with pytest.raises(ValueError, match="'arith' calls no tools"):
    tasks.get("arith").write_sft(again, 5, seed=3, no_tool_fraction=0.5)
