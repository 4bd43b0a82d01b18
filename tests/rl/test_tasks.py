"""RL tasks and rewards: disjoint deterministic splits, answers against plain references,
reward guards, SFT records, registry errors, and the Python task through the sandbox."""

import json
import re
import zlib

import numpy as np
import pytest

from glm5_jax.rl.envs import rewards
from glm5_jax.rl.envs import tasks
from glm5_jax.rl.envs.tasks import Problem
from glm5_jax.rl.envs.tasks import python_functions

TASKS = ("arith", "strings", "python_functions")


def _rng(name: str):
  return np.random.default_rng(zlib.crc32(name.encode()))


def _seeds(name: str, k: int):
  return [int(s) for s in _rng(name).integers(0, 2**31, size=k)]


# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------

def test_registries_list_the_tasks():
  assert tasks.names() == rewards.names() == TASKS


@pytest.mark.parametrize("get", [tasks.get, rewards.get])
def test_unknown_name_lists_the_known_ones(get):
  with pytest.raises(ValueError, match="'nope'.*arith.*strings.*python_functions"):
    get("nope")


@pytest.mark.parametrize("name, options, field", [
    ("arith", {"digits": 3}, "digits"),
    ("arith", {"min_digits": 0}, "min_digits=0"),
    ("arith", {"min_digits": 4, "max_digits": 3}, "max_digits=3"),
    ("arith", {"max_digits": 10}, "max_digits=10"),
    ("arith", {"ops": "+/"}, "ops='\\+/'"),
    ("strings", {"max_len": 33}, "max_len=33"),
    ("strings", {"ops": ("reverse", "upper")}, "upper"),
    ("strings", {"alphabet": "aB"}, "alphabet='aB'"),
    ("python_functions", {"templates": ("mul_add", "nope")}, "nope"),
    ("python_functions", {"n_tests": 0}, "n_tests=0"),
])
def test_bad_options_name_the_field(name, options, field):
  with pytest.raises(ValueError, match=field):
    tasks.get(name, **options)


def test_options_from_a_config_file_lists_are_accepted():
  assert tasks.get("arith", ops=["+", "-"]).config.ops == "+-"
  assert tasks.get("strings", ops=["sort"]).config.ops == ("sort",)


@pytest.mark.parametrize("split, n, seed", [("test", 1, 0), ("train", -1, 0), ("train", 1, -1),
                                             ("train", 1.5, 0)])
def test_problems_rejects_bad_arguments(split, n, seed):
  with pytest.raises(ValueError, match="split|n=|seed="):
    tasks.get("arith").problems(split, n, seed)


# --------------------------------------------------------------------------------------
# Splits: disjoint by content, deterministic per seed
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TASKS)
def test_train_and_heldout_never_share_a_problem(name):
  task = tasks.get(name)
  seeds = _seeds(f"test_train_and_heldout_never_share_a_problem_{name}", 3)
  train = {p.prompt for s in seeds for p in task.problems("train", 300, s)}
  heldout = {p.prompt for s in seeds for p in task.problems("heldout", 100, s)}
  assert train and heldout and not train & heldout
  assert all(tasks.split_of(name, q) == "train" for q in train)
  assert all(tasks.split_of(name, q) == "heldout" for q in heldout)


def test_split_partitions_a_whole_problem_space():
  """1-digit sums: all 100 problems enumerated; each split's draws are exactly its part."""
  task = tasks.get("arith", min_digits=1, max_digits=1, ops="+")
  space = {f"{a}+{b}=" for a in range(10) for b in range(10)}
  part = {s: {q for q in space if tasks.split_of("arith", q) == s} for s in tasks.SPLITS}
  assert part["heldout"] and part["train"]
  for split, prompts in part.items():
    for seed in _seeds(f"test_split_partitions_a_whole_problem_space_{split}", 3):
      got = {p.prompt for p in task.problems(split, len(prompts), seed)}
      assert got == prompts
    with pytest.raises(ValueError, match="too few problems"):
      task.problems(split, len(prompts) + 1, 0)


@pytest.mark.parametrize("name", TASKS)
def test_problems_are_deterministic_per_seed_and_distinct(name):
  task = tasks.get(name)
  s0, s1 = _seeds(f"test_problems_are_deterministic_per_seed_and_distinct_{name}", 2)
  a, b, c = (task.problems("heldout", 50, s) for s in (s0, s0, s1))
  assert a == b and a != c
  assert len({p.prompt for p in a}) == 50
  assert [p.id for p in a] == [f"{name}-heldout-{i:05d}" for i in range(50)]
  assert all(p.task == name and p.split == "heldout" for p in a)


@pytest.mark.parametrize("name", TASKS)
def test_500_heldout_problems_of_short_prompts_and_answers(name):
  task = tasks.get(name)
  ps = task.problems("heldout", 500, 0)
  assert len(ps) == 500
  assert max(len(p.prompt.encode()) for p in ps) <= 48
  assert max(len(p.answer.encode()) for p in ps) <= 48


# --------------------------------------------------------------------------------------
# Problems against plain references
# --------------------------------------------------------------------------------------

def test_arith_answers_and_operands():
  task = tasks.get("arith", min_digits=2, max_digits=3, ops="-*")
  for p in task.problems("train", 400, _seeds("test_arith_answers_and_operands", 1)[0]):
    a, op, b = re.fullmatch(r"(\d+)([-*])(\d+)=", p.prompt).groups()
    assert all(2 <= len(v) <= 3 and v[0] != "0" for v in (a, b))
    want = int(a) - int(b) if op == "-" else int(a) * int(b)
    assert p.answer == str(want)


def _reverse(s):
  out = ""
  for ch in s:
    out = ch + out
  return out


def _dedupe(s):
  out = ""
  for ch in s:
    if ch not in out:
      out += ch
  return out


def test_strings_answers():
  refs = {"reverse": _reverse, "sort": lambda s: "".join(sorted(s)), "dedupe": _dedupe}
  task = tasks.get("strings", min_len=2, max_len=5, alphabet="abc")
  ps = task.problems("train", 300, _seeds("test_strings_answers", 1)[0])
  assert {p.prompt.split()[0] for p in ps} == set(refs)
  for p in ps:
    op, s = p.prompt.split(" ")
    assert 2 <= len(s) <= 5 and set(s) <= set("abc")
    assert p.answer == refs[op](s)
  assert [_dedupe(s) for s in ("aabca", "cba", "")] == ["abc", "cba", ""]


def test_python_hidden_tests_hand_checked():
  """mul_add with a=3, b=1: the expected results are 3x+1 on the hidden arguments."""
  t = python_functions.TEMPLATES["mul_add"]
  p = {"a": 3, "b": 1}
  assert t.prompt.format(**p) == "f(x): x times 3 plus 1"
  assert t.solution.format(**p) == "def f(x): return x*3+1"
  assert [t.reference(**p)(x) for x in (0, 5, 10)] == [1, 16, 31]
  for q in tasks.get("python_functions", templates=("between",)).problems("train", 20, 0):
    a, b = map(int, re.fullmatch(r"f\(x\): is x between (\d+) and (\d+)", q.prompt).groups())
    for args, want in q.tests:
      (x,) = eval(args)  # pylint: disable=eval-used
      assert want == repr(a <= x <= b)
    assert {"True", "False"} <= {want for _, want in q.tests}   # the boundary cases


# --------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------

def _problem(task, prompt, answer, tests=()):
  return Problem(f"{task}-test-00000", task, "heldout", prompt, answer, tests)


@pytest.mark.parametrize("response, want", [
    ("-408", 1.0), (" -408\n", 1.0), ("\t-408 \r\n", 1.0),        # outer whitespace ignored
    ("408", 0.0), ("-409", 0.0),                                 # wrong
    ("- 408", 0.0), ("-0408", 0.0), ("-408.0", 0.0), ("-4,08", 0.0), ("(-408)", 0.0),
    ("-408 apples", 0.0), ("= -408", 0.0), ("-408\n-408", 0.0), ("", 0.0),   # format
    ("-408" + " " * 29, 0.0),                                    # 33 bytes: over the cap
])
def test_arith_reward(response, want):
  p = _problem("arith", "12-420=", "-408")
  assert rewards.get("arith")(p, response, truncated=False) == want


def test_length_cap_and_truncation():
  cases = [("arith", "1+1=", "2"), ("strings", "sort cba", "abc"),
           ("python_functions", "f(x): x times 3 plus 1", "def f(x): return x*3+1")]
  for name, prompt, answer in cases:
    p = _problem(name, prompt, answer, (("(5,)", "16"),))
    fn = rewards.get(name)
    cap = tasks.get(name).max_response_bytes
    assert fn(p, answer, truncated=False) == 1.0
    assert fn(p, answer, truncated=True) == fn(p, answer, truncated=np.bool_(True)) == 0.0
    assert fn(p, answer + " " * (cap - len(answer)), truncated=False) == 1.0
    assert fn(p, answer + " " * (cap - len(answer) + 1), truncated=False) == 0.0


@pytest.mark.parametrize("response, want", [
    ("olleh", 1.0), ("olleh\n", 1.0), ("hello", 0.0), ("OLLEH", 0.0), ("o l l e h", 0.0),
    ("'olleh'", 0.0), ("olleh.", 0.0), ("reverse olleh", 0.0),
])
def test_strings_reward(response, want):
  p = _problem("strings", "reverse hello", "olleh")
  assert rewards.get("strings")(p, response, truncated=False) == want


def test_reward_of_another_tasks_problem_raises_and_safe_call_returns_zero():
  p = _problem("strings", "sort cba", "abc")
  with pytest.raises(ValueError, match="'arith'.*'strings'"):
    rewards.get("arith")(p, "abc", truncated=False)
  r, err = rewards.safe_call(rewards.get("arith"), p, "abc", truncated=False)
  assert r == 0.0 and err.startswith("ValueError: ")


def test_reward_rejects_bad_argument_types():
  p = _problem("arith", "1+1=", "2")
  with pytest.raises(TypeError, match="response"):
    rewards.get("arith")(p, 2, truncated=False)
  with pytest.raises(TypeError, match="truncated"):
    rewards.get("arith")(p, "2", truncated=None)


def test_safe_call_turns_failures_into_zero():
  p = _problem("arith", "1+1=", "2")

  def boom(problem, response, *, truncated):
    raise RuntimeError(f"verifier down on {problem.id}")

  assert rewards.safe_call(boom, p, "2", truncated=False) == (
      0.0, "RuntimeError: verifier down on arith-test-00000")
  for bad in (1.5, -0.1, float("nan"), None, "1"):
    r, err = rewards.safe_call(lambda *a, **k: bad, p, "2", truncated=False)
    assert r == 0.0 and "expected a number in [0, 1]" in err
  assert rewards.safe_call(lambda *a, **k: np.float32(0.5), p, "2", truncated=False) == (0.5, None)
  assert rewards.safe_call(rewards.get("arith"), p, "2", truncated=False) == (1.0, None)


# --------------------------------------------------------------------------------------
# SFT records
# --------------------------------------------------------------------------------------

def test_sft_record_schema():
  p = _problem("arith", "1+1=", "2")
  assert tasks.sft_record(p) == {"id": "arith-test-00000", "messages": [
      {"role": "user", "content": "1+1="},
      {"role": "assistant", "content": "2", "reasoning": None}]}
  assert tasks.sft_record(p, system="Answer.")["messages"][0] == {"role": "system",
                                                                   "content": "Answer."}


@pytest.mark.parametrize("name", TASKS)
def test_write_sft_writes_training_conversations(name, tmp_path):
  task = tasks.get(name)
  path = str(tmp_path / "sft.jsonl")
  seed = _seeds(f"test_write_sft_writes_training_conversations_{name}", 1)[0]
  assert task.write_sft(path, 40, seed) == 40
  with open(path) as f:
    records = [json.loads(line) for line in f]
  assert records == [task.sft_record(p) for p in task.problems("train", 40, seed)]
  assert all(tasks.split_of(name, r["messages"][0]["content"]) == "train" for r in records)


# --------------------------------------------------------------------------------------
# Python functions through the sandbox
# --------------------------------------------------------------------------------------

@pytest.fixture
def mul_add():
  """f(x) = 3x + 1 with three hidden tests."""
  return _problem("python_functions", "f(x): x times 3 plus 1", "def f(x): return x*3+1",
                  (("(0,)", "1"), ("(5,)", "16"), ("(-2,)", "-5")))


def _reward(problem, response):
  return rewards.get("python_functions")(problem, response, truncated=False)


def test_python_every_template_solution_passes_its_hidden_tests():
  for name in python_functions.TEMPLATES:
    task = tasks.get("python_functions", templates=(name,))
    (p,) = task.problems("heldout", 1, _seeds(f"test_python_template_{name}", 1)[0])
    assert _reward(p, p.answer) == 1.0, (name, p)


@pytest.mark.parametrize("response, want", [
    ("def f(x): return x*3+1", 1.0),
    ("def f(x):\n  y = 3 * x\n  return y + 1\n", 1.0),
    ("def f(x): print('hi'); return x*3+1", 1.0),                # own prints are ignored
    ("def f(x): return x*3", 0.0),                               # wrong
    ("def f(x): return float(x*3+1)", 0.0),                      # type-exact: 16.0 != 16
    ("def g(x): return x*3+1", 0.0),                             # no f
    ("def f(x): return x*3+1 if x >= 0 else 0", 0.0),            # fails a hidden case
    ("```python\ndef f(x): return x*3+1\n```", 0.0),             # fenced: not Python
    ("def f(x) return x*3+1", 0.0),                              # syntax error
    ("def f(x): return 1 // (x - x)", 0.0),                      # raises
    ("import sys\nsys.exit(0)\ndef f(x): return x*3+1", 0.0),    # exits before the tests
])
def test_python_reward(mul_add, response, want):
  assert _reward(mul_add, response) == want


def test_python_infinite_loop_scores_zero_within_the_timeout(mul_add, monkeypatch):
  monkeypatch.setattr(python_functions, "TIMEOUT_S", 1.0)
  assert _reward(mul_add, "def f(x):\n  while True: pass") == 0.0
  assert _reward(mul_add, "while True: pass") == 0.0


def test_python_memory_hog_scores_zero(mul_add):
  assert _reward(mul_add, "def f(x): return len(bytearray(2**31)) + x*3+1") == 0.0


@pytest.mark.parametrize("cheat", [
    # a marker of its own: no nonce
    "print('PASS')\nprint('0' * 32, '[\"1\", \"16\", \"-5\"]')\ndef f(x): return 0",
    # reads stdin for the nonce: the harness has consumed it
    "import sys\nn = sys.stdin.readline().strip()\nprint(n, '[\"1\", \"16\", \"-5\"]')\n"
    "def f(x): return 0",
    # steals the nonce from the harness and prints a result line, then the harness prints
    # its own: two nonce lines
    "import __main__\nprint(__main__._nonce, '[\"1\", \"16\", \"-5\"]')\n"
    "def f(x): return x*3+1",
    # steals the nonce, prints results for inputs it guessed, and exits before the harness
    "import __main__, os\nprint(__main__._nonce, '[\"1\", \"4\", \"7\"]', flush=True)\n"
    "os._exit(0)",
])
def test_python_code_cannot_fake_the_pass_line(mul_add, cheat):
  assert _reward(mul_add, cheat) == 0.0


def test_arith_reasoning_is_the_column_addition_of_the_answer():
  task = tasks.get("arith", min_digits=1, max_digits=4, ops="+")
  for p in task.problems("train", 300, _seeds("test_arith_reasoning_column_addition", 1)[0]):
    a, b = (int(x) for x in p.prompt[:-1].split("+"))
    steps = [re.fullmatch(r"(\d)\+(\d)(?:\+(1))?=(\d+)", s).groups()
             for s in task.reasoning(p).split(",")]
    width = max(len(str(a)), len(str(b)))
    assert len(steps) == width
    carry = 0
    for k, (x, y, c, total) in enumerate(steps):      # ones column first
      assert (int(x), int(y)) == (a // 10**k % 10, b // 10**k % 10)
      assert int(c or 0) == carry and int(total) == int(x) + int(y) + carry
      carry = int(total) // 10
    assert steps[-1][3] + "".join(str(int(s[3]) % 10) for s in steps[-2::-1]) == p.answer
  with pytest.raises(ValueError, match="'\\+' only"):
    task.reasoning(_problem("arith", "3-4=", "-1"))


def test_think_fraction_mixes_worked_reasoning_into_the_sft_data(tmp_path):
  task = tasks.get("arith", min_digits=1, max_digits=2, ops="+")
  path = str(tmp_path / "mix.jsonl")
  assert task.write_sft(path, 300, seed=5, think_fraction=0.3) == 300
  recs = [json.loads(line) for line in open(path)]
  thinking = [r["messages"][-1]["reasoning"] is not None for r in recs]
  assert 0.22 < np.mean(thinking) < 0.38            # 0.3 of 300, binomial sigma 0.026
  for r, p, t in zip(recs, task.problems("train", 300, seed=5), thinking):
    want = tasks.sft_record(p)
    if t:
      want["messages"][-1]["reasoning"] = task.reasoning(p)
    assert r == want
  with pytest.raises(ValueError, match="think_fraction=-0.1"):
    task.write_sft(path, 5, seed=5, think_fraction=-0.1)
  with pytest.raises(ValueError, match="'strings' writes no reasoning.*arith"):
    tasks.get("strings").write_sft(path, 5, seed=5, think_fraction=0.5)
