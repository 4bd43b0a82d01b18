"""A workdir belongs to one run: a lock while it runs, and the fields that define the run.

  with workdir.lock(path):               # refused while another live process holds it
    workdir.check_run(path, config)      # refused if the run stored there is another one

`lock` takes `WORKDIR/run.lock` (`fcntl.flock`, released by the kernel when its holder
dies, however it dies) and writes the holder (host, pid, start time, command) into it. A
second run on the same workdir is refused before it writes anything, naming the holder. A
lock file left non-empty by a process that died without releasing it is taken over, and the
log says whose it was. Re-entrant within a process (the main job locks its workdir, then
each stage its own).

`check_run` stores `RUN_FIELDS` of the config in `WORKDIR/run.json` at the first start; a
later start that changes any of them is refused naming each field with both values (the
fields that only say how long or how often: total_steps, eval_every, log_every,
checkpoint_every, mesh, ... stay free). `config.allow_changed_run=True` accepts the change on
purpose: the run logs each change and appends it to run.json's "changes". The model's shape
is checked by `orbax_io.check_model_config` (WORKDIR/model_config.json).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time

from absl import logging

LOCK, RUN = "run.lock", "run.json"

# The config fields that define a run: a resume that changes one of them trains another run
# on this run's checkpoints. Fields a config does not have are skipped.
RUN_FIELDS = ("stage", "seed", "init_from", "optimizer", "data.tokenizer", "rl.task",
              "rl.task_options", "rl.reward", "qat")


class WorkdirInUse(RuntimeError):
  """Another live process holds the workdir's lock."""


class ChangedRun(ValueError):
  """The config names another run than the one the workdir holds."""


_held: dict[str, list] = {}          # realpath of a lock file -> [open file, depth]
_held_lock = threading.Lock()


def holder() -> dict:
  """This process as a lock holder."""
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:500]}


def _read_holder(f) -> dict | None:
  f.seek(0)
  text = f.read()
  if not text.strip():
    return None
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return {"unreadable": text[:200]}


def _describe(h: dict | None) -> str:
  if not h:
    return "an unknown process"
  if "unreadable" in h:
    return f"an unknown process (lock file holds {h['unreadable']!r})"
  return (f"pid {h.get('pid')} on host {h.get('host')} (since {h.get('started')}: "
          f"{h.get('command')})")


def acquire(workdir: str):
  """Takes WORKDIR/run.lock (module docstring); raises WorkdirInUse naming the holder."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.realpath(os.path.join(workdir, LOCK))
  with _held_lock:
    if path in _held:
      _held[path][1] += 1
      return path
    f = open(path, "a+", encoding="utf-8")    # pylint: disable=consider-using-with
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      h = _read_holder(f)
      f.close()
      raise WorkdirInUse(
          f"workdir {workdir!r} is in use by {_describe(h)}: one run per workdir. Wait for "
          "it to end, stop it (SIGTERM checkpoints it), or choose another --workdir") from None
    old = _read_holder(f)
    if old is not None:
      logging.warning("workdir %s: took over the lock of %s, which is gone (it ended "
                      "without releasing it)", workdir, _describe(old))
    f.seek(0)
    f.truncate()
    f.write(json.dumps(holder()) + "\n")
    f.flush()
    _held[path] = [f, 1]
    return path


def release(path: str) -> None:
  with _held_lock:
    f, depth = _held[path]
    if depth > 1:
      _held[path][1] -= 1
      return
    del _held[path]
    f.seek(0)
    f.truncate()                 # empty: released cleanly (non-empty and free: a dead holder)
    f.flush()
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()


@contextlib.contextmanager
def lock(workdir: str):
  path = acquire(workdir)
  try:
    yield path
  finally:
    release(path)


def _get(c, field: str):
  node = c
  for k in field.split("."):
    if not hasattr(node, "keys") or k not in node:
      return _MISSING
    node = node[k]
  return node.to_dict() if hasattr(node, "to_dict") else node


_MISSING = object()


def run_fields(c) -> dict:
  """{field: JSON value} of RUN_FIELDS present in config `c`."""
  out = {f: _get(c, f) for f in RUN_FIELDS}
  return json.loads(json.dumps({f: v for f, v in out.items() if v is not _MISSING}))


def changes(stored: dict, now: dict) -> dict:
  """{field: (stored, now)} of the fields that differ (a field one side lacks is left out:
  a config of another stage's shape, or a field added to RUN_FIELDS later)."""
  return {f: (stored[f], now[f]) for f in now if f in stored and stored[f] != now[f]}


def check_run(workdir: str, c, *, write: bool = True) -> None:
  """Stores the run's fields at the first start; refuses a start that changes them unless
  `config.allow_changed_run` (module docstring). `write`: this process writes run.json
  (process 0 of a multi-process run)."""
  path = os.path.join(workdir, RUN)
  now = run_fields(c)
  if not os.path.exists(path):
    if write:
      _write(path, {"fields": now, "changes": []})
    return
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  diff = changes(saved["fields"], now)
  if not diff:
    return
  listed = "; ".join(f"config.{k}: {a!r} in the workdir, {b!r} now" for k, a, b in
                     ((k, *v) for k, v in sorted(diff.items())))
  if not c.get("allow_changed_run", False):
    raise ChangedRun(
        f"workdir {workdir!r} holds another run ({listed}). Use a new --workdir (or "
        "--config.init_from to start from its weights), or --config.allow_changed_run=True "
        "to continue this run with the changed fields on purpose")
  logging.warning("workdir %s: continuing with changed run fields, as "
                  "config.allow_changed_run=True asks: %s", workdir, listed)
  if write:
    saved["changes"].append({"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                             "fields": {k: list(v) for k, v in diff.items()}})
    saved["fields"] = {**saved["fields"], **now}
    _write(path, saved)


def _write(path: str, d: dict) -> None:
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(d, f, indent=2)
  os.replace(path + ".tmp", path)
