"""The sandbox's per-call cgroups: memory and process count of all its processes together.

`sandbox.run_python` makes a memory and a pids cgroup per call, children of the caller's own
(`make_cgroups`), hands the program their `cgroup.procs` files to join (`cgroup_joins`: the
program joins them itself, sandbox_launcher.py) and afterwards kills what is left in them and
reads the OOM kills and the memory peak (`remove_cgroups`). cgroup v1 and v2 both; where a
controller cannot be used, its protection is reported missing and the program runs without it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import time

from glm5_jax.rl.envs import sandbox_launcher as launcher

# {controller: (cgroup version, directory)} used instead of the caller's own cgroups
# (`own_cgroups`): tests point it at directories where no cgroup can be made.
PARENTS: dict[str, tuple[int, str]] | None = None
_PROTECTION = {"memory": "total_memory", "pids": "total_processes"}


def own_cgroups() -> dict[str, tuple[int, str]]:
  """{"memory" / "pids": (cgroup version, directory of the caller's own cgroup)}.

  v1: a `cgroup` mount whose options name the controller; v2: the `cgroup2` mount, where
  the controller is in the caller's cgroup.controllers. A controller is in one hierarchy
  only. The paths in /proc/self/cgroup are relative to a hierarchy's root, which a mount
  may show from a subdirectory on (its root field in mountinfo).
  """
  if PARENTS is not None:
    return dict(PARENTS)
  try:
    with open("/proc/self/cgroup", encoding="utf-8") as f:
      own = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
      mounts = [line.split() for line in f]
  except OSError:
    return {}
  found = {}
  for fields in mounts:
    if "-" not in fields or len(fields) < 5:
      continue
    root, point = fields[3], re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
    fstype, *rest = fields[fields.index("-") + 1:]
    options = set(rest[1].split(",")) if len(rest) > 1 else set()
    for hierarchy, names, path in own:
      v1 = fstype == "cgroup" and bool(names) and set(names.split(",")) <= options
      v2 = fstype == "cgroup2" and hierarchy == "0"
      rel = os.path.relpath(path, root) if v1 or v2 else os.pardir
      if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        continue        # not this mount, or the caller's cgroup is outside what it shows
      where = os.path.normpath(os.path.join(point, rel))
      controllers = names.split(",") if v1 else _read(f"{where}/cgroup.controllers").split()
      for controller in _PROTECTION:
        if controller in controllers:
          found.setdefault(controller, (1 if v1 else 2, where))
  return found


def _cgroup_limits(version: int, controller: str, memory_mb: int, pids_max: int):
  """(file, value, required) written into a new cgroup; the optional ones: best effort."""
  if controller == "pids":
    return [("pids.max", str(pids_max), True)]
  limit = str(memory_mb << 20)
  if version == 1:   # memsw (memory + swap) >= limit: set after it; oom_control 0: the
    return [("memory.limit_in_bytes", limit, True),        # OOM killer on, not a hang
            ("memory.memsw.limit_in_bytes", limit, False),  # absent without swap accounting
            ("memory.swappiness", "0", False), ("memory.oom_control", "0", False)]
  return [("memory.max", limit, True), ("memory.swap.max", "0", False)]


def make_cgroups(memory_mb: int, pids_max: int):
  """The call's cgroups, children of the caller's: ({controller: (version, directory)},
  names of the PROTECTIONS that could not be made). Unique names: safe across threads."""
  parents = own_cgroups()
  name = f"glm5_sandbox_{os.getpid()}_{secrets.token_hex(8)}"
  made, created, missing = {}, [], set()
  for controller, protection in _PROTECTION.items():
    try:
      if controller not in parents:
        raise OSError(f"no {controller} cgroup controller for this process")
      version, parent = parents[controller]
      path = os.path.join(parent, name)
      if version == 2 and controller not in _read(f"{parent}/cgroup.subtree_control").split():
        # EBUSY when the parent has processes of its own
        launcher.write_file(f"{parent}/cgroup.subtree_control", f"+{controller}")
      if path not in created:
        os.mkdir(path, 0o755)
        created.append(path)
      for file, value, required in _cgroup_limits(version, controller, memory_mb, pids_max):
        try:
          launcher.write_file(os.path.join(path, file), value)
        except OSError:
          if required:
            raise
      made[controller] = (version, path)
    except OSError:
      missing.add(protection)
  for path in set(created) - set(cgroup_dirs(made)):
    _rmdir(path)
  return made, missing


def cgroup_dirs(cgroups) -> list[str]:
  return sorted({path for _, path in cgroups.values()})


def cgroup_joins(cgroups) -> list[list]:
  """[[cgroup.procs file, [protections]], ...] for the program to join, one per directory."""
  joins = {}
  for controller, (_, path) in sorted(cgroups.items()):
    joins.setdefault(os.path.join(path, "cgroup.procs"), []).append(
        _PROTECTION[controller])
  return [[procs, names] for procs, names in joins.items()]


def remove_cgroups(cgroups) -> tuple[int, int | None]:
  """Kills what is left in the call's cgroups, removes them: (OOM kills, peak bytes)."""
  for path in cgroup_dirs(cgroups):
    kill_cgroup(path)
  oom_kills, peak = 0, None
  if "memory" in cgroups:
    version, path = cgroups["memory"]
    events, peak_file = ((f"{path}/memory.oom_control", f"{path}/memory.max_usage_in_bytes")
                         if version == 1 else (f"{path}/memory.events", f"{path}/memory.peak"))
    for line in _read(events).splitlines():
      key, _, value = line.partition(" ")
      oom_kills = int(value) if key == "oom_kill" else oom_kills
    text = _read(peak_file).strip()       # memory.peak: Linux >= 5.19
    peak = int(text) if text.isdigit() else None
  for path in cgroup_dirs(cgroups):
    _rmdir(path)
  return oom_kills, peak


def kill_cgroup(path: str, timeout_s: float = launcher.KILL_WAIT_S) -> bool:
  """SIGKILL every process in cgroup `path` until none is left (pids.max bounds a bomb)."""
  with contextlib.suppress(OSError):
    launcher.write_file(f"{path}/cgroup.kill", "1")       # v2, Linux >= 5.14
  end = time.monotonic() + timeout_s
  while pids := [int(p) for p in _read(f"{path}/cgroup.procs").split()]:
    for pid in pids:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if time.monotonic() > end:
      return False
    time.sleep(0.002)
  return True


def _rmdir(path: str, timeout_s: float = launcher.KILL_WAIT_S):
  """Removes an empty cgroup, retrying while killed processes are still exiting (EBUSY)."""
  end = time.monotonic() + timeout_s
  while True:
    try:
      os.rmdir(path)
      return
    except FileNotFoundError:
      return
    except OSError:
      if time.monotonic() > end:
        return        # left behind, empty or nearly: harmless to the next calls
      time.sleep(0.005)


def _read(path: str) -> str:
  try:
    with open(path, encoding="ascii", errors="replace") as f:
      return f.read()
  except OSError:
    return ""
