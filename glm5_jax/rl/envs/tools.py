"""Tools an RL episode can call: a calculator, a Python sandbox, search over local docs.

  result = tools.call("calculator", {"expression": "4821*937"})
  result.text, result.status                      # "4517277", "ok"

Each tool takes its arguments as the chat format parses them (`glm5_jax/data/chat.py`:
`ToolCall.arguments`) and returns a `ToolResult`: the text the model reads in its next
observation, and a status (GLM-5, arXiv 2602.15763, section 3: environment failures are
recorded and filtered, not scored):

  "ok"         the tool ran; also when the MODEL erred (unknown tool, missing or extra
               argument, an expression that does not parse, a program that raises): the text
               tells it what went wrong, and the episode goes on;
  "env_error"  the environment failed (the sandbox could not start, a tool raised);
  "timeout"    the tool ran out of time (the sandbox's wall or CPU limit).

Tools (`TOOLS`, name -> (function, argument names)):
  calculator(expression)  + - * / // % ** and parentheses on int / float literals, evaluated
                          over the `ast` (no eval); results capped at `MAX_DIGITS` digits.
  python(code)            runs `code` in `glm5_jax.rl.envs.sandbox.run_python`; the text is its
                          stdout (and the tail of stderr when it fails), capped.
  search(query)           BM25 (Robertson and Zaragoza 2009; k1 = 1.5, b = 0.75) over the
                          first paragraphs of the docstrings of the running interpreter's
                          standard library modules (`search_corpus`, read from the source
                          files, never imported), returns the top `SEARCH_HITS` as
                          "module: first line of its docstring" lines.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import math
import operator
import os
import re
import sysconfig
import tokenize
from typing import Any, Callable

from glm5_jax.rl.envs import sandbox

STATUSES = ("ok", "env_error", "timeout")
MAX_DIGITS = 60              # calculator: longest integer result (and exponent bound)
MAX_TEXT = 400               # characters of tool output the model reads
PYTHON_TIMEOUT_S = 5.0
SEARCH_HITS = 3
BM25_K1, BM25_B = 1.5, 0.75


@dataclasses.dataclass(frozen=True)
class ToolResult:
  text: str
  status: str = "ok"

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f"ToolResult.status={self.status!r}: expected one of {STATUSES}")


def _clip(text: str) -> str:
  return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


# --------------------------------------------------------------------------------------
# calculator
# --------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _CalcError(ValueError):
  pass


def _too_big(x) -> bool:
  return (isinstance(x, int) and abs(x) >= 10**MAX_DIGITS) or (
      isinstance(x, float) and not math.isfinite(x))


def _eval(node):
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return node.value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_eval(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    a, b = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow) and abs(b) > MAX_DIGITS * 4:
      raise _CalcError(f"exponent {b} is too large")
    try:
      out = _BINARY[type(node.op)](a, b)
    except ZeroDivisionError:
      raise _CalcError("division by zero") from None
    except OverflowError:
      raise _CalcError("result too large") from None
    if isinstance(out, complex):
      raise _CalcError("complex result")
    if _too_big(out):
      raise _CalcError(f"result has more than {MAX_DIGITS} digits")
    return out
  raise _CalcError(f"unsupported {type(node).__name__}: only numbers, + - * / // % ** and "
                   "parentheses")


def calculate(expression: str) -> str:
  """The value of an arithmetic expression, or raises _CalcError (shown to the model)."""
  if len(expression) > 200:
    raise _CalcError("expression longer than 200 characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError:
    raise _CalcError(f"cannot parse {expression!r}") from None
  value = _eval(tree.body)
  return repr(value) if isinstance(value, float) else str(value)


def calculator(expression) -> ToolResult:
  try:
    return ToolResult(calculate(str(expression)))
  except _CalcError as e:
    return ToolResult(f"error: {e}")


# --------------------------------------------------------------------------------------
# python
# --------------------------------------------------------------------------------------

def python(code, *, timeout_s: float = PYTHON_TIMEOUT_S) -> ToolResult:
  """Runs `code` in the sandbox; its stdout (+ stderr's tail when it did not exit 0)."""
  try:
    r = sandbox.run_python(str(code), timeout_s=timeout_s)
  except sandbox.SandboxError as e:
    return ToolResult(f"sandbox failed: {e}", "env_error")
  if r.status == "timeout":
    return ToolResult(f"timeout after {timeout_s:g} s", "timeout")
  text = r.stdout
  if r.status != "ok":
    text += f"[{r.status}] " + r.stderr[-200:]
  return ToolResult(_clip(text))


# --------------------------------------------------------------------------------------
# search
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Doc:
  name: str        # module name, e.g. "heapq", "json" (a package), "email.mime.text"
  summary: str     # first line of its docstring (what `search` shows)
  text: str        # its first paragraph, at most 80 words (what BM25 indexes, with the name)


def _docstring(path: str) -> str | None:
  """The module docstring: the first statement if it is a string (read up to 32 KiB)."""
  try:
    with open(path, "rb") as f:
      head = f.read(32 * 1024)
    toks = tokenize.tokenize(iter(head.splitlines(keepends=True)).__next__)
    for t in toks:
      if t.type in (tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
        continue
      if t.type != tokenize.STRING:
        return None
      value = ast.literal_eval(t.string)
      return value if isinstance(value, str) else None
  except (OSError, SyntaxError, ValueError, tokenize.TokenError, UnicodeDecodeError):
    return None
  return None


_SKIP = ("test", "tests", "idle_test", "idlelib", "encodings", "site-packages", "dist-packages",
         "this", "antigravity")


def _module_files(root: str) -> list[tuple[str, str]]:
  """(dotted module name, path) of the stdlib's modules and packages (tests, codecs, IDLE
  and installed packages left out), sorted by name."""
  out = []

  def walk(directory: str, prefix: str):
    for entry in sorted(os.listdir(directory)):
      path = os.path.join(directory, entry)
      stem = entry[:-3] if entry.endswith(".py") else entry
      if not (stem.isascii() and stem.isidentifier()) or stem.startswith("_") or stem in _SKIP:
        continue
      if entry.endswith(".py") and os.path.isfile(path):
        out.append((prefix + stem, path))
      elif os.path.isfile(os.path.join(path, "__init__.py")):
        out.append((prefix + stem, os.path.join(path, "__init__.py")))
        walk(path, prefix + stem + ".")

  walk(root, "")
  return sorted(out)


@functools.lru_cache(maxsize=None)
def search_corpus(root: str | None = None) -> tuple[Doc, ...]:
  """Docs of the standard library's modules whose docstring's first line has >= 3 words
  and is not another module's (so each answer is unique).

  Built from the source files (read, never imported), sorted by module name: the same list
  on every call with the same interpreter. root: the stdlib directory (default: this
  interpreter's `sysconfig.get_paths()["stdlib"]`). Cached per root.
  """
  root = root or sysconfig.get_paths()["stdlib"]
  docs = []
  for name, path in _module_files(root):
    doc = _docstring(path)
    if not doc or not doc.strip():
      continue
    lines = doc.strip().splitlines()
    summary = " ".join(lines[0].split())
    end = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
    text = " ".join(" ".join(lines[:end]).split()[:80])
    if len(words(summary)) >= 3:
      docs.append(Doc(name, summary, text))
  counts = collections.Counter(d.summary for d in docs)
  return tuple(d for d in docs if counts[d.summary] == 1)


def words(text: str) -> list[str]:
  """Lowercased alphanumeric words: the terms BM25 matches."""
  return re.findall(r"[a-z0-9]+", text.lower())


@dataclasses.dataclass(frozen=True)
class _Index:
  docs: tuple[Doc, ...]
  tf: tuple[collections.Counter, ...]
  lengths: tuple[int, ...]
  idf: dict[str, float]
  avg_len: float


@functools.lru_cache(maxsize=None)
def _index(docs: tuple[Doc, ...]) -> _Index:
  """Terms of each doc's name + text (name repeated: a module's name is its best key)."""
  tf = tuple(collections.Counter(words(f"{d.name} {d.name} {d.text}")) for d in docs)
  df = collections.Counter(t for c in tf for t in c)
  n = len(docs)
  idf = {t: math.log(1 + (n - k + 0.5) / (k + 0.5)) for t, k in df.items()}
  lengths = tuple(sum(c.values()) for c in tf)
  return _Index(docs, tf, lengths, idf, sum(lengths) / max(n, 1))


def bm25(query: str, docs: tuple[Doc, ...] | None = None) -> list[tuple[float, Doc]]:
  """(score, doc) of the docs matching any query word, best first (ties: corpus order)."""
  ix = _index(search_corpus() if docs is None else docs)
  terms = [t for t in words(query) if t in ix.idf]
  scored = []
  for i, (c, n) in enumerate(zip(ix.tf, ix.lengths)):
    s = 0.0
    for t in terms:
      f = c.get(t, 0)
      if f:
        s += ix.idf[t] * f * (BM25_K1 + 1) / (f + BM25_K1 * (1 - BM25_B + BM25_B * n / ix.avg_len))
    if s > 0:
      scored.append((s, i))
  scored.sort(key=lambda si: (-si[0], si[1]))
  return [(s, ix.docs[i]) for s, i in scored]


def search(query) -> ToolResult:
  hits = bm25(str(query))[:SEARCH_HITS]
  if not hits:
    return ToolResult("no results")
  return ToolResult(_clip("\n".join(f"{d.name}: {d.summary}" for _, d in hits)))


# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------

Tool = tuple[Callable[..., ToolResult], tuple[str, ...]]
TOOLS: dict[str, Tool] = {
    "calculator": (calculator, ("expression",)),
    "python": (python, ("code",)),
    "search": (search, ("query",)),
}


def call(name: str, arguments: dict[str, Any], *, allowed=None,
         tools: dict[str, Tool] | None = None) -> ToolResult:
  """Runs tool `name`; never raises.

  allowed: the tool names this episode may use (default: all of `tools`); tools: the
  registry (default `TOOLS`; tests pass their own). A mistake of the model is an "ok" result
  that names it; a tool that raises is an "env_error" result.
  """
  tools = TOOLS if tools is None else tools
  allowed = tuple(tools) if allowed is None else tuple(allowed)
  if name not in tools or name not in allowed:
    return ToolResult(f"error: unknown tool {name!r}; tools: {', '.join(allowed)}")
  fn, params = tools[name]
  missing = [p for p in params if p not in arguments]
  extra = sorted(set(arguments) - set(params))
  if missing or extra:
    return ToolResult(f"error: {name} takes arguments {', '.join(params)}"
                      + (f"; missing {', '.join(missing)}" if missing else "")
                      + (f"; unknown {', '.join(extra)}" if extra else ""))
  try:
    result = fn(**{p: arguments[p] for p in params})
  except Exception as e:  # pylint: disable=broad-exception-caught
    return ToolResult(f"{name} failed: {type(e).__name__}: {e}", "env_error")
  if not isinstance(result, ToolResult):
    return ToolResult(f"{name} returned {type(result).__name__}, expected a ToolResult",
                      "env_error")
  return result
