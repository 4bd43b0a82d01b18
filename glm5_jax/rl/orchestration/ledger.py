"""The rollout ledger: every group and trajectory id, from admission to consumption or drop.

GLM-5's asynchronous RL (paper §3) streams rollouts while the trainer updates, drops stale
work, refills groups and restarts dead workers; the ledger is how a run proves that none of
that lost or double-counted anything. `WORKDIR/rollouts.jsonl` holds one JSON object per
event, written and flushed as it happens:

  {"t": clock(), "id": ..., "kind": "group" | "trajectory",
   "event": "admitted" | "finished" | "consumed" | "dropped", "reason": str | None,
   "run": r, ...extra}

Runs and rollback. Every start of a run on the workdir (the first, and each resume) is a run
r = 0, 1, ..., and writes a marker {"kind": "run", "event": "start", "run": r, "update": u,
"keep": k}: it continues from the checkpoint of update u, which was saved when the ledger had
k lines. The lines after line k that an earlier run wrote (work of the killed run after its
last checkpoint: admitted, finished, even consumed by updates the checkpoint does not hold)
are rolled back: they no longer count, and the resumed run admits those prompts again. A run
that finds no finished checkpoint starts at u = 0 with k = 0. Nothing is ever truncated. The
*live* ledger is what stays after every rollback (`live`).

The lifecycle `audit` checks, on the live ledger:
  group       admitted once, then consumed or dropped exactly once (optionally finished once
              in between, when its rollouts are done).
  trajectory  finished once (refill copies too: record them finished with `copy_of` when refill
              makes them), then consumed or dropped exactly once; a trajectory may be dropped
              without having finished (work in flight when its worker died or the run ended).
  dropped     carries a reason from REASONS.
  copy        (`copy_of` set) has an id of its own, not its source's.
  prompts     no prompt index is consumed by two groups; no update consumes in two runs.
  runs        each marker starts a later run and keeps lines that exist; no event of an earlier
              run is written after a later run started (a second writer, or a killed run's
              process still alive).
"""

from __future__ import annotations

import collections
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
  appends to an existing one as the next run, which `begin` marks. `lines`: the lines in
  the file so far (what a checkpoint stores, `begin`'s `keep` on resume).
  """

  def __init__(self, path: str, *, clock: Callable[[], float] = time.time, run: int = 0,
               _mode: str = "w"):
    self.path, self.clock, self.run = path, clock, run
    self._lock = threading.Lock()
    d = os.path.dirname(path)
    if d:
      os.makedirs(d, exist_ok=True)
    self.lines = _count_lines(path) if _mode == "a" and os.path.exists(path) else 0
    self._f = open(path, _mode, encoding="utf-8")    # pylint: disable=consider-using-with

  @classmethod
  def open(cls, path: str, *, clock: Callable[[], float] = time.time) -> "Ledger":
    """Appends to the ledger at `path` (created if missing) as run 1 + the last run in it."""
    if os.path.exists(path) and os.path.getsize(path):
      with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        torn = f.read(1) != b"\n"
      if torn:                        # a write cut by a crash: end it (rolled back, or named)
        with open(path, "a", encoding="utf-8") as f:
          f.write("\n")
    runs = [e.get("run", 0) for _, e, err in _lines(path) if not err] if os.path.exists(
        path) else []
    return cls(path, clock=clock, run=max(runs) + 1 if runs else 0, _mode="a")

  def begin(self, update: int, keep: int, **extra) -> None:
    """The run's start marker: it continues from the checkpoint of `update`, saved when the
    ledger had `keep` lines; later lines of earlier runs are rolled back."""
    if not 0 <= keep <= self.lines:
      raise ValueError(f"Ledger.begin: keep={keep}, expected in [0, {self.lines}] (the "
                       f"lines of {self.path})")
    self._write({"t": self.clock(), "id": f"run{self.run}", "kind": "run", "event": "start",
                 "reason": None, "run": self.run, "update": int(update), "keep": int(keep),
                 **extra})

  def _write(self, d: dict) -> None:
    line = json.dumps(d)
    with self._lock:
      self._f.write(line + "\n")
      self._f.flush()
      self.lines += 1

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
    self._write({"t": self.clock(), "id": id, "kind": kind, "event": event, "reason": reason,
                 "run": self.run, **extra})

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


def _count_lines(path: str) -> int:
  with open(path, "rb") as f:
    return sum(1 for _ in f)


def _lines(path: str):
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      try:
        yield n, json.loads(line), None
      except json.JSONDecodeError as e:
        yield n, None, f"{path}:{n}: not a JSON line ({e})"


def read(path: str) -> list[dict]:
  """Every line's event in order (markers and rolled-back events too); a line that does not
  parse raises naming its number."""
  out = []
  for _, e, err in _lines(path):
    if err:
      raise ValueError(err)
    out.append(e)
  return out


def events(path: str) -> list[dict]:
  """Every line's event in order, torn lines skipped."""
  return [e for _, e, err in _lines(path) if not err]


def _replay(path: str):
  """(live [(line, event or None, parse error or None)] without markers, markers, rolled
  back line count, problems of the runs' order): the module docstring's rollback."""
  entries, markers, problems, rolled, run = [], [], [], 0, None
  for n, e, err in _lines(path):
    if e is not None and e.get("kind") == "run":
      r, keep = e.get("run"), e.get("keep")
      if not isinstance(r, int) or not isinstance(keep, int) or not 0 <= keep < n:
        problems.append(f"{path}:{n}: malformed run marker {e} (run an int, keep in "
                        f"[0, {n}))")
        continue
      if run is not None and r <= run:
        problems.append(f"{path}:{n}: run {r} starts after run {run}: runs must increase")
      kept = [x for x in entries if x[0] <= keep]
      rolled += len(entries) - len(kept)
      entries, run = kept, r
      markers.append((n, e))
      continue
    if e is not None and run is not None and e.get("run", 0) != run:
      what = f"{e.get('kind')} {e.get('id')} {e.get('event')}"
      problems.append(f"{path}:{n}: {what} of run {e.get('run', 0)}, written while run {run} "
                      f"runs (started at line {markers[-1][0]}): a second writer, or a "
                      "process of a rolled-back run still alive")
      continue
    entries.append((n, e, err))
  return entries, markers, rolled, problems


def live(path: str) -> list[dict]:
  """The events that count: every line after the rollbacks (module docstring), markers and
  torn lines left out."""
  return [e for _, e, err in _replay(path)[0] if not err]


def audit(path: str) -> list[str]:
  """Problems in the ledger at `path` (module docstring's rules); [] for a clean run.

  A group may also be recorded `finished` (its rollouts done) once, between its admission
  and its end."""
  entries, _, _, problems = _replay(path)
  seen: dict[tuple[str, str], list[str]] = {}       # (kind, id) -> its events in order
  prompt_of: dict[str, object] = {}                  # group id -> its prompt index
  consumers = collections.defaultdict(list)          # prompt index -> [(group, line)]
  update_runs = collections.defaultdict(dict)        # update -> {run: first line}
  for n, e, err in entries:
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
    if kind == "group" and ev == "admitted":
      prompt_of[i] = e.get("prompt_index")
    if kind == "group" and ev == "consumed":
      if prompt_of.get(i) is not None:
        consumers[prompt_of[i]].append((i, n))
      if e.get("update") is not None:
        update_runs[e["update"]].setdefault(e.get("run", 0), n)
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
  for p, groups in consumers.items():
    if len(groups) > 1:
      problems.append(f"{path}: prompt {p} consumed {len(groups)} times: " + ", ".join(
          f"group {g} (line {n})" for g, n in groups))
  for u, runs in sorted(update_runs.items()):
    if len(runs) > 1:
      problems.append(f"{path}: update {u} consumed groups in runs {sorted(runs)} (lines "
                      f"{sorted(runs.values())}): a resume that did not roll back")
  return problems


def pending(path: str) -> dict[str, list[str]]:
  """{kind: ids begun (admitted / finished) but not yet consumed or dropped} in the live
  ledger: the work a resumed run must ledger as dropped (reason "shutdown") or take up
  again. Torn lines are skipped."""
  state: dict[tuple[str, str], bool] = {}
  for e in live(path):
    if e.get("kind") not in KINDS:
      continue
    key = (e["kind"], e.get("id"))
    if e.get("event") in ("consumed", "dropped"):
      state[key] = True
    elif e.get("event") == _FIRST[e["kind"]]:
      state.setdefault(key, False)
  return {k: sorted(i for (kk, i), done in state.items() if kk == k and not done)
          for k in KINDS}


def summary(path: str) -> dict[str, int]:
  """Event counts of the live ledger: {"group/admitted": n, ..., "trajectory/dropped/stale":
  n, ...}, with "runs" and "rolled_back" (lines) when the ledger has run markers."""
  entries, markers, rolled, _ = _replay(path)
  out: dict[str, int] = {}
  for _, e, err in entries:
    if err:
      continue
    key = f"{e.get('kind')}/{e.get('event')}"
    if e.get("event") == "dropped":
      key += f"/{e.get('reason')}"
    out[key] = out.get(key, 0) + 1
  if markers:
    out.update(runs=len(markers), rolled_back=rolled)
  return dict(sorted(out.items()))
