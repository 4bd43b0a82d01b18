"""The rollout ledger: every group and trajectory id, from admission to consumption or drop.

GLM-5's asynchronous RL (paper §3) streams rollouts while the trainer updates, drops stale
work, refills groups and restarts dead workers; the ledger is how a run proves that none of
that lost or double-counted anything. `WORKDIR/rollouts.jsonl` holds one JSON object per
event, written and flushed as it happens:

  {"t": clock(), "id": ..., "kind": "group" | "trajectory",
   "event": "admitted" | "finished" | "consumed" | "dropped", "reason": str | None, ...extra}

The lifecycle `audit` checks:
  group       admitted once, then consumed or dropped exactly once (optionally finished once
              in between, when its rollouts are done).
  trajectory  finished once (refill copies too: record them finished with `copy_of` when refill
              makes them), then consumed or dropped exactly once; a trajectory may be dropped
              without having finished (work in flight when its worker died or the run ended).
  dropped     carries a reason from REASONS.
  copy        (`copy_of` set) has an id of its own, not its source's.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

KINDS = ("group", "trajectory")
EVENTS = ("admitted", "finished", "consumed", "dropped")
REASONS = ("stale", "future_version", "refill_failed", "env_error", "timeout", "truncated",
           "aborted", "worker_dead", "shutdown", "fenced")
_FIRST = {"group": "admitted", "trajectory": "finished"}


class Ledger:
  """Appends ledger events to `path` (module docstring); thread-safe, flushed per event.

  Ledger(path) starts a new ledger (an existing file is replaced); `Ledger.open(path)`
  appends to an existing one (resume).
  """

  def __init__(self, path: str, *, clock: Callable[[], float] = time.time, _mode: str = "w"):
    self.path, self.clock = path, clock
    self._lock = threading.Lock()
    d = os.path.dirname(path)
    if d:
      os.makedirs(d, exist_ok=True)
    self._f = open(path, _mode, encoding="utf-8")    # pylint: disable=consider-using-with

  @classmethod
  def open(cls, path: str, *, clock: Callable[[], float] = time.time) -> "Ledger":
    """Appends to the ledger at `path` (created if missing): a resumed run."""
    if os.path.exists(path) and os.path.getsize(path):
      with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        torn = f.read(1) != b"\n"
      if torn:                        # a write cut by a crash: end it, `audit` reports it
        with open(path, "a", encoding="utf-8") as f:
          f.write("\n")
    return cls(path, clock=clock, _mode="a")

  def record(self, event: str, id: str, kind: str, reason: str | None = None,  # noqa: A002
             **extra) -> None:
    """Writes one event. extra: more JSON-serializable fields (e.g. copy_of, version)."""
    if event not in EVENTS:
      raise ValueError(f"Ledger.record: event={event!r}, expected one of {EVENTS}")
    if kind not in KINDS:
      raise ValueError(f"Ledger.record: kind={kind!r}, expected one of {KINDS}")
    if (event == "dropped") != (reason is not None):
      raise ValueError(f"Ledger.record: reason={reason!r} with event={event!r}; a reason is "
                       "given exactly for drops")
    if reason is not None and reason not in REASONS:
      raise ValueError(f"Ledger.record: reason={reason!r}, expected one of {REASONS}")
    line = json.dumps({"t": self.clock(), "id": id, "kind": kind, "event": event,
                       "reason": reason, **extra})
    with self._lock:
      self._f.write(line + "\n")
      self._f.flush()

  def write(self, id: str, kind: str, event: str, reason: str | None = None,  # noqa: A002
            **extra) -> None:
    """`record` with the id first: write(id, kind, event, reason=..., **extra)."""
    self.record(event, id, kind, reason, **extra)

  def admitted(self, id: str, kind: str = "group", **extra) -> None:  # noqa: A002
    self.record("admitted", id, kind, **extra)

  def finished(self, id: str, kind: str = "trajectory", **extra) -> None:  # noqa: A002
    self.record("finished", id, kind, **extra)

  def consumed(self, id: str, kind: str, **extra) -> None:  # noqa: A002
    self.record("consumed", id, kind, **extra)

  def dropped(self, id: str, kind: str, reason: str, **extra) -> None:  # noqa: A002
    self.record("dropped", id, kind, reason, **extra)

  def close(self) -> None:
    with self._lock:
      if not self._f.closed:
        self._f.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _lines(path: str):
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      try:
        yield n, json.loads(line), None
      except json.JSONDecodeError as e:
        yield n, None, f"{path}:{n}: not a JSON line ({e})"


def read(path: str) -> list[dict]:
  """The ledger's events in order; a line that does not parse raises naming its number."""
  out = []
  for _, e, err in _lines(path):
    if err:
      raise ValueError(err)
    out.append(e)
  return out


def audit(path: str) -> list[str]:
  """Problems in the ledger at `path` (module docstring's lifecycle); [] for a clean run.

  A group may also be recorded `finished` (its rollouts done) once, between its admission
  and its end."""
  problems = []
  seen: dict[tuple[str, str], list[str]] = {}       # (kind, id) -> its events in order
  for n, e, err in _lines(path):
    where = f"{path}:{n}"
    if err:
      problems.append(err)
      continue
    kind, ev, i = e.get("kind"), e.get("event"), e.get("id")
    if kind not in KINDS or ev not in EVENTS or not isinstance(i, str) or not i:
      problems.append(f"{where}: malformed event {e} (kind in {KINDS}, event in {EVENTS}, "
                      "id a non-empty string)")
      continue
    if e.get("copy_of") is not None and e["copy_of"] in (i, i.split("#")[0]):
      problems.append(f"{where}: {kind} {i} is a copy with its source's id {e['copy_of']!r}")
    if ev == "dropped" and e.get("reason") not in REASONS:
      problems.append(f"{where}: {kind} {i} dropped with reason {e.get('reason')!r}, expected "
                      f"one of {REASONS}")
    past = seen.setdefault((kind, i), [])
    ended = [x for x in past if x in ("consumed", "dropped")]
    what = f"{where}: {kind} {i} {ev}"
    if ev in past and ev not in ("consumed", "dropped"):
      problems.append(f"{what} twice")
    elif ended:
      problems.append(f"{what} after it was already {ended[0]} "
                      f"({' then '.join(past + [ev])})")
    elif kind == "group" and ev != "admitted" and "admitted" not in past:
      problems.append(f"{what} but never admitted")
    elif kind == "trajectory" and ev == "admitted":
      problems.append(f"{what}: trajectories are finished, then consumed or dropped")
    elif kind == "trajectory" and ev == "consumed" and "finished" not in past:
      problems.append(f"{what} but never finished")
    past.append(ev)
  for (kind, i), past in seen.items():
    if _FIRST[kind] in past and not {"consumed", "dropped"} & set(past):
      problems.append(f"{path}: {kind} {i} {_FIRST[kind]} but never consumed or dropped "
                      "(lost)")
  return problems


def pending(path: str) -> dict[str, list[str]]:
  """{kind: ids begun (admitted / finished) but not yet consumed or dropped}: the work a
  resumed run must ledger as dropped (reason "shutdown") or take up again. Torn lines are
  skipped."""
  state: dict[tuple[str, str], bool] = {}
  for _, e, err in _lines(path):
    if err or e.get("kind") not in KINDS:
      continue
    key = (e["kind"], e.get("id"))
    if e.get("event") in ("consumed", "dropped"):
      state[key] = True
    elif e.get("event") == _FIRST[e["kind"]]:
      state.setdefault(key, False)
  return {k: sorted(i for (kk, i), done in state.items() if kk == k and not done)
          for k in KINDS}


def summary(path: str) -> dict[str, int]:
  """Event counts: {"group/admitted": n, ..., "trajectory/dropped/stale": n, ...}."""
  out: dict[str, int] = {}
  for e in read(path):
    key = f"{e.get('kind')}/{e.get('event')}"
    if e.get("event") == "dropped":
      key += f"/{e.get('reason')}"
    out[key] = out.get(key, 0) + 1
  return dict(sorted(out.items()))
