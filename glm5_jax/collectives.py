"""The collectives of a compiled XLA program, counted from its HLO text.

`collective_stats(compiled.as_text())` gives, per kind (all-reduce, all-gather,
reduce-scatter, all-to-all, collective-permute): `ops`, the instructions in the program;
`count`, how many run per call, each instruction weighted by the trip counts of the while
loops around it (XLA's `known_trip_count`, else the bound N of a condition `i < N` on a
constant, as jax's loops from 0 by 1 compile on TPU; a loop with neither counts once);
`bytes`, the
result bytes per device of those runs (a combined collective's tuple counted whole; for an
asynchronous `-start`, its outputs only). Bytes are what each device receives or holds after
the op, a measure of volume, not of the wire protocol.
"""

from __future__ import annotations

import collections
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) (" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"condition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"%?([\w.\-]+) = s(?:32|64)\[\]\S* constant\((\d+)\)")
_LESS = re.compile(r"compare\(%?[\w.\-]+, %?([\w.\-]+)\), direction=LT")


def _arrays(type_text: str) -> list[int]:
  """Bytes of each array in an HLO type (`f32[2,3]{1,0}` or a tuple of them)."""
  out = []
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype in _DTYPE_BYTES:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      out.append(n * _DTYPE_BYTES[dtype])
  return out


def _result_bytes(type_text: str, kind: str, is_start: bool) -> int:
  sizes = _arrays(type_text)
  if is_start and kind in ("all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
    sizes = [s for s in sizes if s > 4]               # drop the scalar contexts
    sizes = sizes[len(sizes) // 2:]                   # (operands..., outputs...)
  return sum(sizes)


def _computations(hlo: str) -> tuple[list[tuple[str, list[str]]], str | None]:
  """[(name, instruction lines)] in text order, and the ENTRY computation's name."""
  comps, name, body, entry = [], None, [], None
  for line in hlo.splitlines():
    m = _HEADER.match(line)
    if m:
      name, body = m[1], []
      entry = name if line.startswith("ENTRY") else entry
    elif line.startswith("}") and name is not None:
      comps.append((name, body))
      name = None
    elif name is not None:
      body.append(line)
  return comps, entry


def _trips(line: str, bodies: dict[str, list[str]]) -> int:
  """Trip count of the while instruction `line` (1 if unknown)."""
  known = _TRIPS.search(line)
  if known:
    return int(known[1])
  cond = _CONDITION.search(line)
  lines = bodies.get(cond[1], []) if cond else []
  constants = dict(m.groups() for m in map(_CONSTANT.search, lines) if m)
  for m in filter(None, map(_LESS.search, lines)):
    if m[1] in constants:
      return int(constants[m[1]])
  return 1


def collective_stats(hlo: str) -> dict[str, dict[str, int]]:
  """{kind: {"ops", "count", "bytes"}} for every kind of `KINDS` (zeros where absent)."""
  comps, entry = _computations(hlo)
  bodies = dict(comps)
  mult = collections.defaultdict(int)
  mult[entry] = 1
  for name, body in reversed(comps):                  # callers follow their callees
    for line in body:
      factor = _trips(line, bodies) if " while(" in line else 1
      callees = _CALLS.findall(line)
      for group in _BRANCHES.findall(line):
        callees += [c.strip().lstrip("%") for c in group.split(",")]
      for callee in callees:
        mult[callee] += mult[name] * factor
  out = {k: {"ops": 0, "count": 0, "bytes": 0} for k in KINDS}
  for name, body in comps:
    for line in body:
      m = _OP.match(line)
      if m:
        row = out[m[2]]
        row["ops"] += 1
        row["count"] += mult[name]
        row["bytes"] += mult[name] * _result_bytes(m[1], m[2], bool(m[3]))
  return out
