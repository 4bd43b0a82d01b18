"""GLM chat format: conversations rendered straight to token ids, with a per-token loss mask.

A conversation is never rendered to text and re-tokenized: each piece of text is encoded on
its own (`tokenizer.encode` never yields a special id) and the special tokens are inserted as
ids, so text that spells "<|user|>" or "<tool_call>" stays text, and RL stays token-in
token-out (GLM-5, arXiv 2602.15763). Public engines parse the same layout: llama.cpp's GLM-4.5
chat handler, SGLang's glm4_moe / glm47 detectors.

Layout (markers are single special ids, the rest is encoded text; right: the loss mask, 1 on
what the assistant produced):

  [gMASK] <sop>                                            prefix, 0
  <|system|> "\n" content                                  0
  <|user|> "\n" content                                    0
  <|assistant|> "\n"                                       0: written by the template
    <think> reasoning </think>                             1 (`<think></think>` when off)
    content                                                1
    <tool_call> NAME (<arg_key> K </arg_key>
                      <arg_value> V </arg_value>)* </tool_call>   1, per call
  <|observation|> "\n" (<tool_response> r </tool_response>)*      marker 1, rest 0
  ... <|endoftext|>                                        1 after a final assistant turn

The model ends its turn by emitting a stop token (`stop_ids`), which is the next turn's role
marker and carries the assistant's loss: `<|observation|>` after a turn with tool calls,
`<|user|>` before a user turn, `<|endoftext|>` after the last turn (`<|observation|>` again if
that turn made tool calls). GLM-5's config lists three eos ids (154820, 154827, 154829), which
in GLM's token order are these three.

Choices (where the public format leaves room):
  - The newline after a role marker is template-written: the generation prompt ends with
    `<|assistant|>` "\n" and the model's first token is `<think>`. No other newlines are added;
    text is rendered verbatim (not stripped), so render -> parse round trips exactly.
    (zai-org's GLM-4.7 `chat_template.jinja` writes no newline after role markers and a lone
    `</think>` for a turn without reasoning: a real GLM-5 checkpoint needs those two changes.)
  - Tool-call values: strings as they are, anything else JSON-encoded (`ensure_ascii=False`, as
    GLM-4.7's template `tojson`s them). Parsing decodes a value as JSON when that gives a
    non-string, so the string "5" comes back as the number 5 (the format cannot tell them apart
    without the tool's schema).
  - `<tool_response>` / `</tool_response>` are single ids (GLM-4.6V's tokenizer_config has them
    among its special tokens; not checked against GLM-5's own tokenizer.json);
    `get_chat_tokenizer` rejects a tokenizer.json without them.
  - Thinking modes (GLM-5 paper): interleaved = every assistant turn has a block, also one that
    only calls tools; turn-level = `reasoning` None (or "") renders the empty block, which is the
    assistant's output in `render` (loss 1: it learns to answer without thinking) and the
    template's in `render_prompt(enable_thinking=False)` (as serving engines write it);
    preserved = `preserve_reasoning=True` keeps every earlier block. `False` is GLM-4.5's
    history: assistant turns before the last user turn lose their reasoning (empty block) and,
    being rewritten history, all their loss.
  - `/nothink` in user text stays text; the turn-level switch is `enable_thinking`.

Conversation record (JSON): {"id": optional str, "messages": [{"role": "system"|"user",
"content": str}, {"role": "assistant", "content": str, "reasoning": str|None, "tool_calls":
[{"name": str, "arguments": {str: JSON value}}]}, {"role": "observation", "content": [str, ...]
(one result per call of the previous assistant turn; a str is one result)}], ...other keys}.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import numpy as np

from glm5_jax.data import tokenizers

PREFIX = ("[gMASK]", "<sop>")
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>",
                "observation": "<|observation|>"}
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")   # GLM-5's eos_token_id order
CHAT_TOKENS = PREFIX + tuple(ROLE_MARKERS.values()) + (
    "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
    "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>")

# Message fields per role: name -> allowed types. Every role needs `content` (an assistant's may
# be missing / None = ""); `reasoning` None or "" = thinking off for the turn; `tool_calls`
# missing / None = [].
_FIELDS = {
    "system": {"content": (str,)},
    "user": {"content": (str,)},
    "assistant": {"content": (str,), "reasoning": (str, type(None)), "tool_calls": (list,)},
    "observation": {"content": (str, list)},
}
# The role that may follow an assistant turn, by whether it made tool calls: its stop token.
_AFTER_ASSISTANT = {True: "observation", False: "user"}


@dataclasses.dataclass(frozen=True)
class Rendered:
  """A rendered conversation: ids int32 [n] and loss_mask float32 [n] (1 = assistant output)."""
  ids: np.ndarray
  loss_mask: np.ndarray


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class AssistantTurn:
  """What a model generated after the generation prompt.

  reasoning: the block's text (None when the block is empty or absent); content: the visible
  answer; tool_calls: the calls that parsed; ended_by: the stop token's name, None when the ids
  ran out (truncated); errors: format failures (unparsable tool calls, stray special tokens).
  """
  reasoning: str | None
  content: str
  tool_calls: list[ToolCall]
  ended_by: str | None
  errors: list[str]

  def to_message(self) -> dict:
    """The turn as a conversation message (append it to continue the conversation)."""
    return {"role": "assistant", "content": self.content, "reasoning": self.reasoning,
            "tool_calls": [dataclasses.asdict(c) for c in self.tool_calls]}


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

def get_chat_tokenizer(spec: str):
  """`bytes` or a tokenizer.json path; checks that every chat special token is one id."""
  tok = tokenizers.get_tokenizer(spec)
  _special_ids(tok)
  return tok


def _special_ids(tokenizer) -> dict[str, int]:
  return {name: tokenizer.special_id(name) for name in CHAT_TOKENS}


def stop_ids(tokenizer) -> tuple[int, ...]:
  """Ids that end an assistant turn: <|endoftext|>, <|user|>, <|observation|>."""
  return tuple(tokenizer.special_id(name) for name in STOP_TOKENS)


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------

def _fail(where: str, record, field: str, value, expected: str):
  rid = f" (id {record['id']!r})" if isinstance(record, dict) and "id" in record else ""
  shown = repr(value)
  shown = shown if len(shown) <= 80 else shown[:77] + "..."
  raise ValueError(f"{where}{rid}: {field}={shown}: {expected}")


def _check_tool_call(fail, field: str, call) -> dict:
  if not isinstance(call, dict) or set(call) - {"name", "arguments"} or "name" not in call:
    fail(field, call, "expected {'name': str, 'arguments': {str: JSON value}}")
  name, args = call["name"], call.get("arguments", {})
  if not isinstance(name, str) or not name or name != name.strip():
    fail(f"{field}.name", name, "expected a non-empty str without surrounding whitespace")
  if not isinstance(args, dict) or not all(isinstance(k, str) and k for k in args):
    fail(f"{field}.arguments", args, "expected a dict with non-empty str keys")
  try:
    json.dumps(args)
  except (TypeError, ValueError) as e:
    fail(f"{field}.arguments", args, f"expected JSON values ({e})")
  return {"name": name, "arguments": dict(args)}


def _check_message(fail, i: int, m) -> dict:
  field = f"messages[{i}]"
  if not isinstance(m, dict):
    fail(field, m, "expected a message dict with 'role' and 'content'")
  role = m.get("role")
  if not isinstance(role, str) or role not in _FIELDS:
    fail(f"{field}.role", role, f"expected one of {tuple(_FIELDS)}")
  unknown = sorted(set(m) - {"role"} - set(_FIELDS[role]))
  if unknown:
    fail(f"{field}", unknown, f"unknown key(s) for role {role!r}; allowed: "
         f"{['role', *_FIELDS[role]]}")
  out = {"role": role}
  if role == "assistant":
    m = {"content": "", "reasoning": None, "tool_calls": [], **m}
    m["content"] = "" if m["content"] is None else m["content"]
    m["tool_calls"] = [] if m["tool_calls"] is None else m["tool_calls"]
  elif "content" not in m:
    fail(f"{field}.content", None, f"a {role} message needs 'content'")
  for key, types in _FIELDS[role].items():
    if not isinstance(m[key], types):
      fail(f"{field}.{key}", m[key], f"expected {' or '.join(t.__name__ for t in types)}")
    out[key] = m[key]
  if role == "assistant":
    out["reasoning"] = out["reasoning"] or None
    out["tool_calls"] = [_check_tool_call(fail, f"{field}.tool_calls[{j}]", c)
                         for j, c in enumerate(m["tool_calls"])]
    if not (out["content"] or out["reasoning"] or out["tool_calls"]):
      fail(field, m, "empty assistant turn: expected content, reasoning or tool_calls")
  if role == "observation":
    results = [out["content"]] if isinstance(out["content"], str) else out["content"]
    if not all(isinstance(r, str) for r in results):
      fail(f"{field}.content", results, "expected a str or a list of str (one per tool call)")
    out["content"] = list(results)
  return out


def validate(record, where: str) -> dict:
  """A normalized copy of a conversation record, or ValueError naming `where` and the field.

  Normalized: an assistant message has content (str), reasoning (str or None) and tool_calls
  (list of {name, arguments}); an observation's content is a list of str.
  """
  fail = lambda field, value, expected: _fail(where, record, field, value, expected)
  if not isinstance(record, dict):
    fail("record", record, "expected a conversation dict with a 'messages' list")
  msgs = record.get("messages")
  if not isinstance(msgs, list) or not msgs:
    fail("messages", msgs, "expected a non-empty list of messages")
  out = [_check_message(fail, i, m) for i, m in enumerate(msgs)]
  for i, m in enumerate(out):
    prev = out[i - 1] if i else None
    if prev is not None and prev["role"] == "assistant":
      expected = _AFTER_ASSISTANT[bool(prev["tool_calls"])]
      if m["role"] != expected:
        fail(f"messages[{i}].role", m["role"], f"after an assistant turn with"
             f"{'' if prev['tool_calls'] else 'out'} tool calls comes {expected!r} (the turn's "
             "stop token is that role's marker)")
    if m["role"] == "observation":
      if prev is None or prev["role"] != "assistant":
        fail(f"messages[{i}].role", "observation", "an observation must follow an assistant "
             "turn with tool calls")
      if len(m["content"]) != len(prev["tool_calls"]):
        fail(f"messages[{i}].content", m["content"], f"expected one result per tool call of "
             f"messages[{i - 1}] ({len(prev['tool_calls'])})")
  return {**record, "messages": out}


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------

class _Piece(NamedTuple):
  special: bool     # True: `value` is a special token's name; False: text to encode
  value: str
  loss: float


def _arg_text(value) -> str:
  return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _assistant_pieces(m: dict, keep_reasoning: bool, loss: float) -> list[_Piece]:
  sp, tx = (lambda v: _Piece(True, v, loss)), (lambda v: _Piece(False, v, loss))
  out = [sp("<think>"), tx(m["reasoning"] if keep_reasoning and m["reasoning"] else ""),
         sp("</think>"), tx(m["content"])]
  for call in m["tool_calls"]:
    out += [sp("<tool_call>"), tx(call["name"])]
    for k, v in call["arguments"].items():
      out += [sp("<arg_key>"), tx(k), sp("</arg_key>"),
              sp("<arg_value>"), tx(_arg_text(v)), sp("</arg_value>")]
    out.append(sp("</tool_call>"))
  return out


def _messages_pieces(msgs: list[dict], preserve_reasoning: bool) -> list[_Piece]:
  """Prefix and every message; a role marker after an assistant turn carries its loss."""
  last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
  out = [_Piece(True, t, 0.0) for t in PREFIX]
  loss = 0.0                                  # loss of the previous assistant turn, else 0
  for i, m in enumerate(msgs):
    out += [_Piece(True, ROLE_MARKERS[m["role"]], loss), _Piece(False, "\n", 0.0)]
    if m["role"] == "assistant":
      trained = preserve_reasoning or i > last_user
      loss = 1.0 if trained else 0.0
      out += _assistant_pieces(m, keep_reasoning=trained, loss=loss)
      continue
    loss = 0.0
    if m["role"] == "observation":
      for r in m["content"]:
        out += [_Piece(True, "<tool_response>", 0.0), _Piece(False, r, 0.0),
                _Piece(True, "</tool_response>", 0.0)]
    else:
      out.append(_Piece(False, m["content"], 0.0))
  return out


def _to_ids(pieces: list[_Piece], tokenizer) -> Rendered:
  specials = _special_ids(tokenizer)
  ids, mask = [], []
  for p in pieces:
    piece = np.asarray([specials[p.value]], np.int32) if p.special else tokenizer.encode(p.value)
    ids.append(np.asarray(piece, np.int32))
    mask.append(np.full(len(piece), p.loss, np.float32))
  return Rendered(np.concatenate(ids), np.concatenate(mask))


def render(conversation, tokenizer, *, preserve_reasoning: bool = True,
           where: str = "conversation") -> Rendered:
  """A whole conversation (ending with an assistant turn) -> ids [n] and loss mask [n] (SFT)."""
  msgs = validate(conversation, where)["messages"]
  last = msgs[-1]
  if last["role"] != "assistant":
    _fail(where, conversation, f"messages[{len(msgs) - 1}].role", last["role"],
          "render needs a conversation that ends with an assistant turn (render_prompt takes "
          "one that ends with a user or observation turn)")
  pieces = _messages_pieces(msgs, preserve_reasoning)
  stop = "<|observation|>" if last["tool_calls"] else "<|endoftext|>"
  pieces.append(_Piece(True, stop, 1.0))        # the last turn is always trained
  return _to_ids(pieces, tokenizer)


def render_prompt(conversation, tokenizer, *, enable_thinking: bool = True,
                  preserve_reasoning: bool = True, where: str = "conversation") -> np.ndarray:
  """The messages so far (last one user or observation) + `<|assistant|>` "\\n": int32 [n].

  With enable_thinking=False the template also writes the empty block `<think></think>`.
  `render(conv).ids` starts with `render_prompt(conv minus its last turn)`, and the ids a
  model generates after this prompt are what `parse_assistant` reads.
  """
  msgs = validate(conversation, where)["messages"]
  if msgs[-1]["role"] not in ("user", "observation"):
    _fail(where, conversation, f"messages[{len(msgs) - 1}].role", msgs[-1]["role"],
          "render_prompt needs a conversation that ends with a user or observation turn")
  pieces = _messages_pieces(msgs, preserve_reasoning)
  pieces += [_Piece(True, "<|assistant|>", 0.0), _Piece(False, "\n", 0.0)]
  if not enable_thinking:
    pieces += [_Piece(True, "<think>", 0.0), _Piece(True, "</think>", 0.0)]
  return _to_ids(pieces, tokenizer).ids


def render_observation(results: list[str], tokenizer, *, enable_thinking: bool) -> np.ndarray:
  """Tool results -> the ids that follow the assistant's `<|observation|>` stop token: int32 [n].

  "\n", one `<tool_response>` r `</tool_response>` per result (in call order), then the next
  generation prompt `<|assistant|>` "\n" (+ `<think></think>` with enable_thinking=False, as
  `render_prompt` writes it). In a multi-turn tool episode, prompt + turn 1 (with its stop
  token) + observation 1 + turn 2 ... equals `render` of the same conversation token for
  token, so an RL episode appends these ids to its engine session and never re-renders
  (tokens in, tokens out).
  """
  if isinstance(results, str) or not all(isinstance(r, str) for r in results):
    raise ValueError(f"render_observation: results={results!r:.80}: expected a list of str "
                     "(one per tool call)")
  pieces = [_Piece(False, "\n", 0.0)]
  for r in results:
    pieces += [_Piece(True, "<tool_response>", 0.0), _Piece(False, r, 0.0),
               _Piece(True, "</tool_response>", 0.0)]
  pieces += [_Piece(True, "<|assistant|>", 0.0), _Piece(False, "\n", 0.0)]
  if not enable_thinking:
    pieces += [_Piece(True, "<think>", 0.0), _Piece(True, "</think>", 0.0)]
  return _to_ids(pieces, tokenizer).ids


# --------------------------------------------------------------------------------------
# Parsing what the model generated
# --------------------------------------------------------------------------------------

class _Seg(NamedTuple):
  special: str | None   # a special token's name, or None for a run of text
  text: str
  pos: int              # index of its first id


def _segments(ids, tokenizer) -> list[_Seg]:
  """ids -> special tokens and decoded runs of plain ids between them."""
  names = {i: n for n, i in tokenizer.special_tokens.items()}
  segs, run = [], []
  flush = lambda end: segs.append(_Seg(None, tokenizer.decode(run), end - len(run)))
  for pos, i in enumerate(int(i) for i in ids):
    if i in names:
      if run:
        flush(pos)
        run = []
      segs.append(_Seg(names[i], "", pos))
    else:
      run.append(i)
  if run:
    flush(len(ids))
  return segs


class _Malformed(Exception):
  pass


def _skip_space(body: list[_Seg], j: int) -> int:
  while j < len(body) and body[j].special is None and not body[j].text.strip():
    j += 1
  return j


def _take(body: list[_Seg], j: int, special: str) -> int:
  """The index after `special` at body[j] (whitespace-only text before it is skipped)."""
  j = _skip_space(body, j)
  if j == len(body) or body[j].special != special:
    got = "the end" if j == len(body) else (body[j].special or f"text {body[j].text[:30]!r}")
    raise _Malformed(f"expected {special}, got {got}")
  return j + 1


def _text(body: list[_Seg], j: int) -> tuple[str, int]:
  if j < len(body) and body[j].special is None:
    return body[j].text, j + 1
  return "", j


def _arg_value(text: str):
  try:
    value = json.loads(text)
  except ValueError:
    return text
  return text if isinstance(value, str) else value


def _tool_call(body: list[_Seg]) -> ToolCall:
  """The segments between <tool_call> and </tool_call> -> ToolCall, or _Malformed."""
  name, j = _text(body, 0)
  if not name.strip():
    raise _Malformed("no function name")
  args = {}
  while (j := _skip_space(body, j)) < len(body):
    j = _take(body, j, "<arg_key>")
    key, j = _text(body, j)
    j = _take(body, j, "</arg_key>")
    j = _take(body, j, "<arg_value>")
    value, j = _text(body, j)
    j = _take(body, j, "</arg_value>")
    if not key or key in args:
      raise _Malformed(f"argument name {key!r} is {'repeated' if key else 'empty'}")
    args[key] = _arg_value(value)
  return ToolCall(name.strip(), args)


def parse_assistant(ids, tokenizer) -> AssistantTurn:
  """The ids a model generated after `render_prompt` -> AssistantTurn; never raises on content.

  Format failures (an unclosed block, a tool call that does not parse, stray special tokens,
  text after a tool call, a stop token that does not match the tool calls) go to `errors`.
  """
  segs = _segments(ids, tokenizer)
  errors = []
  stop = next((k for k, s in enumerate(segs) if s.special in STOP_TOKENS), None)
  ended_by = None if stop is None else segs[stop].special
  if stop is not None:
    if stop + 1 < len(segs):
      errors.append(f"{len(ids) - segs[stop].pos - 1} ids after the stop token {ended_by} "
                    "(ignored)")
    segs = segs[:stop]
  reasoning, k = None, 0
  if segs and segs[0].special == "<think>":
    close = next((j for j, s in enumerate(segs) if s.special == "</think>"), None)
    end = len(segs) if close is None else close
    if close is None:
      errors.append("reasoning block <think> at token 0 is not closed")
    for s in segs[1:end]:
      if s.special is not None:
        errors.append(f"unexpected {s.special} at token {s.pos} inside the reasoning block")
    reasoning = "".join(s.text for s in segs[1:end]) or None
    k = end + 1
  content, calls, n_attempts = [], [], 0
  while k < len(segs):
    s = segs[k]
    if s.special == "<tool_call>":
      n_attempts += 1
      close = next((j for j in range(k + 1, len(segs)) if segs[j].special == "</tool_call>"),
                   None)
      try:
        if close is None:
          raise _Malformed("no </tool_call>")
        calls.append(_tool_call(segs[k + 1:close]))
      except _Malformed as e:
        errors.append(f"tool call at token {s.pos} does not parse: {e}")
      k = len(segs) if close is None else close + 1
      continue
    if s.special is not None:
      errors.append(f"unexpected {s.special} at token {s.pos}")
    elif n_attempts and s.text.strip():
      errors.append(f"text after a tool call at token {s.pos}: {s.text[:40]!r}")
      content.append(s.text)
    elif not n_attempts:
      content.append(s.text)
    k += 1
  if ended_by == "<|observation|>" and not n_attempts:
    errors.append("ended with <|observation|> but made no tool call")
  if ended_by in ("<|user|>", "<|endoftext|>") and n_attempts:
    errors.append(f"made tool calls but ended with {ended_by} (expected <|observation|>)")
  return AssistantTurn(reasoning, "".join(content), calls, ended_by, errors)
