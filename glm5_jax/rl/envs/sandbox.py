"""A sandbox for untrusted Python: run model-written code, get its output and a status.

  result = sandbox.run_python("print(input()[::-1])", stdin="abc\\n", timeout_s=2.0)
  result.status, result.stdout, result.missing      # "ok", "cba\\n", ()

RL on code (GLM-5, arXiv 2602.15763, post-training: rewards from executed tests) runs
thousands of programs the policy wrote; none of them may crash, hang or outlive the
trainer, read its secrets or reach the network. The layers, after OpenAI human-eval's
`execution.py` (rlimits) and bubblewrap / nsjail (namespaces, a private /tmp):

  1. a fresh unprivileged uid/gid per call, no supplementary groups, no_new_privs (when the
     caller is root; each concurrent call holds its own uid from `SANDBOX_UIDS`, so the
     process-count limit is per call and "every process of that uid" is exactly the sandbox);
  2. new PID, network, mount, IPC and UTS namespaces: the program sees only its own
     processes (a private /proc), has no network interface up (not even loopback), and all
     of it dies with the namespace's init;
  3. a user namespace of the program's own that allows no nested ones: it cannot create a
     user namespace (`unshare -U` fails with ENOSPC), so the kernel code that a user
     namespace's capabilities reach (mounts, netfilter, ...) stays out of its reach. As in
     bubblewrap's --disable-userns: `user.max_user_namespaces` = 0 written inside the new
     namespace, which limits it and its descendants only, never the host. As root the
     program's process unshares it and init maps the sandbox uid into it; otherwise the
     launcher's own user namespace (which grants the rights for layer 2) is limited;
  4. private size-capped tmpfs on /tmp, /var/tmp, /dev/shm, /run/lock and the working
     directory, so nothing it writes outlives it or fills the host's disk;
  5. a cgroup per call, a uniquely named child of the caller's own cgroup (v1 memory and
     pids hierarchies where the host mounts them, else v2 where the caller's cgroup has
     the controllers): the program joins it before exec, so it and all its descendants
     share `memory_mb` of memory in total (no swap: memsw / swap.max), pids.max processes
     and threads; the cgroup's OOM killer ends the largest of them, and any OOM kill makes
     the status "memory". Removed after the call, whatever is left in it killed first;
  6. rlimits: address space (`memory_mb` per process), CPU seconds, file size, open files,
     processes, no core files; an empty environment; stdout and stderr capped at 64 KiB each.

Where the kernel refuses a layer the program still runs and `SandboxResult.missing` names
what was not in force (vocabulary: `PROTECTIONS`); nothing is ever mounted unless init is
in a mount namespace other than the trainer's. Without the call's cgroup (`total_memory`
missing: not root and no delegated cgroup, a read-only cgroupfs, no memory controller) only
RLIMIT_AS bounds memory, per process: n processes may hold n x `memory_mb` together, with
n up to RLIMIT_NPROC as root and, without the pids cgroup (`total_processes`), unbounded
otherwise. Not covered: the program can read any world-readable file of the host (system
files, checkouts) and its own source, so hidden tests must reach it only as part of the
program, with expected results kept outside.

The program runs under /usr/bin/python3 when the caller is root (a virtualenv's python
usually lives under /root, which the sandbox uid cannot enter), so it sees the system
Python's standard library and packages, not the trainer's; otherwise under the trainer's
python. Needs Linux >= 5.3 (pidfd_open); the layers need a kernel that allows them.

Process tree (the launcher is this file run as a script, so no `preexec_fn` and no fork of
a threaded trainer: calls from several threads are safe):

  trainer (makes the call's cgroups) -> launcher (root, own session; unshare; child
  subreaper; enforces the deadline)
    -> init (PID 1 of the new namespace; mounts /proc and tmpfs; maps the program's uid;
       reaps orphans)
      -> program (joins the cgroups; rlimits; own user namespace; setuid, chdir, exec
         `python -I main.py`)

When the program exits, init reports its wait status and exits, which kills everything
left in the PID namespace. At the wall deadline the launcher kills init (the namespace
with it). Without a PID namespace, every process of the call's uid is killed instead; the
trainer also kills every process left in the call's cgroup. The trainer reads the
launcher's reports (JSON lines) on a pipe of its own.

Status (`_status`): "timeout" at the wall deadline or the CPU limit (SIGXCPU: the same
budget on the CPU clock); "memory" when the call's cgroup OOM-killed any of its processes
(even a child, and whatever the program's exit), or for a non-zero exit with "MemoryError"
(or ENOMEM's message) at the end of stderr, as Python reports hitting the address-space
limit; "ok" for exit 0; "killed" for any other signal; "error" for any other non-zero
exit. A sandbox that cannot be set up (an environment failure, which GLM-5's RL records
and filters instead of scoring) raises `SandboxError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import resource
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

PROTECTIONS = {
    "uid": "runs as a fresh unprivileged uid/gid without supplementary groups (needs root)",
    "nproc": "process-count limit RLIMIT_NPROC (only meaningful for a fresh uid)",
    "pid_ns": "own PID namespace: sees only its processes, all killed with its init",
    "net_ns": "own network namespace with no interface up: no network, no loopback",
    "mount_ns": "own mount namespace (needed for a private /proc and scratch)",
    "ipc_ns": "own System V IPC and POSIX message-queue namespace",
    "uts_ns": "own hostname",
    "proc": "a /proc showing only the sandbox's processes",
    "scratch": "private size-capped tmpfs on /tmp, /var/tmp, /dev/shm, /run/lock, workdir",
    "no_userns": "cannot create user namespaces (max_user_namespaces 0 in its own user ns)",
    "total_memory": "a per-call memory cgroup caps all its processes together at memory_mb "
                    "(without it only RLIMIT_AS, per process)",
    "total_processes": "a per-call pids cgroup caps its processes and threads together",
}
STATUSES = ("ok", "error", "timeout", "memory", "killed")
SANDBOX_UIDS = range(1_900_000_000, 1_900_000_000 + 4096)  # also used as gids

_MIN_MEMORY_MB = 32                # python3 itself needs ~16 MiB of address space
_MAX_TIMEOUT_S = 3600.0
_OUTPUT_CAP = 64 * 1024            # bytes kept of stdout and of stderr
_TAIL = 4096                       # bytes of stderr searched for a MemoryError
_FILE_CAP_MB = 16                  # RLIMIT_FSIZE
_NPROC = 64                        # RLIMIT_NPROC (processes + threads of the fresh uid)
_PIDS_MAX = 64                     # pids.max of the call's cgroup (processes + threads)
_NOFILE = 256
_SCRATCH = (("/tmp", 32), ("/var/tmp", 1), ("/dev/shm", 1), ("/run/lock", 1))  # (dir, MiB)
_WORKDIR_MB = 32                   # tmpfs on the workdir when it is outside the scratch dirs
_GRACE_S = 2.0                     # trainer's backstop past the deadline, for the launcher
_DRAIN_S = 0.5                     # reading on after the launcher exited
_KILL_WAIT_S = 2.0
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory")
_SIGNAL_STATUS = {signal.SIGXCPU: "timeout"}   # other signals: "killed"
_PROGRAM = "main.py"
_SKIP_LAYERS: tuple[str, ...] = ()  # layers not even tried (namespaces, mounts, "no_userns"):
                                    # tests of the fallbacks
# {controller: (cgroup version, directory)} used instead of the caller's own cgroups
# (`_own_cgroups`): tests point it at directories where no cgroup can be made.
_CGROUP_PARENTS: dict[str, tuple[int, str]] | None = None
_CGROUP_PROTECTION = {"memory": "total_memory", "pids": "total_processes"}
_MAX_USERNS = "/proc/sys/user/max_user_namespaces"   # per user namespace (Linux >= 4.9)

# Linux constants (sched.h, sys/mount.h, sys/prctl.h).
_CLONE_NEWUSER = 0x10000000
_NAMESPACES = (("mount_ns", 0x00020000), ("uts_ns", 0x04000000), ("ipc_ns", 0x08000000),
               ("pid_ns", 0x20000000), ("net_ns", 0x40000000))
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 36, 38


class SandboxError(RuntimeError):
  """The sandbox itself could not be set up; nothing of the program ran."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What a program did. returncode: exit code, or -signal (-9 at the deadline)."""
  status: str                      # one of STATUSES
  stdout: str                      # first 64 KiB, UTF-8 with replacement
  stderr: str
  returncode: int
  wall_s: float                    # the whole call, set-up included
  missing: tuple[str, ...]         # keys of PROTECTIONS that were not in force
  peak_memory_bytes: int | None = None   # the call's memory cgroup's peak; None without one


# --------------------------------------------------------------------------------------
# Trainer side
# --------------------------------------------------------------------------------------

def run_python(code: str, *, stdin: str = "", timeout_s: float = 5.0,
               memory_mb: int = 256) -> SandboxResult:
  """Runs `code` as `python3 -I main.py` in the sandbox; returns within ~timeout_s.

  Args:
    code: the program's source.
    stdin: its standard input.
    timeout_s: wall-clock budget of the whole call (also the CPU-time limit, rounded up).
    memory_mb: memory of all its processes together (the call's cgroup), and the
      address-space limit of each (>= 32).

  Raises:
    SandboxError: the sandbox could not be set up (the program did not run).
  """
  _check_args(code, stdin, timeout_s, memory_mb)
  start = time.monotonic()
  python = _program_interpreter() if os.geteuid() == 0 else None
  if os.geteuid() == 0 and python is None:
    raise SandboxError("running as root, but no python3 that an unprivileged uid can execute "
                       "was found (/usr/bin/python3, or this interpreter with every parent "
                       "directory world-executable): the program would run as root")
  uid, lock = _claim_uid() if python else (None, None)
  workdir, cgroups, oom_kills, peak = None, {}, 0, None
  try:
    cgroups, no_cgroup = _make_cgroups(memory_mb, _PIDS_MAX)
    workdir = tempfile.mkdtemp(prefix="glm5_sandbox_")
    if uid is not None:
      _kill_uid(uid)                      # leftovers of a trainer that crashed with this uid
      os.chown(workdir, uid, uid)
    with open(os.path.join(workdir, _PROGRAM), "w", encoding="utf-8") as f:
      f.write(code)
    cfg = dict(uid=uid, workdir=workdir, python=python or sys.executable,
               deadline=start + timeout_s, timeout_s=timeout_s, memory_mb=memory_mb,
               skip=list(_SKIP_LAYERS), host_mount_ns=_ns_id("mnt"),
               host_user_ns=_ns_id("user"), cgroups=_cgroup_joins(cgroups))
    out, err, err_tail, reports, late = _launch(cfg, stdin.encode("utf-8"), cgroups)
  finally:
    oom_kills, peak = _remove_cgroups(cgroups)
    if workdir is not None:
      _remove_tree(workdir)
    if lock:
      lock.close()
  if "setup_error" in reports:
    raise SandboxError(f"sandbox set-up failed: {reports['setup_error']}")
  if "missing" not in reports:
    raise SandboxError(f"sandbox launcher failed: {err_tail.decode('utf-8', 'replace')}")
  missing = (set(reports["missing"]) | no_cgroup
             | (set() if uid is not None else {"uid", "nproc"}))
  timed_out = late or reports.get("timeout", False)
  exit_status = None if timed_out else reports.get("exit")
  returncode = None if exit_status is None else os.waitstatus_to_exitcode(exit_status)
  return SandboxResult(
      status=_status(returncode, timed_out, err_tail.decode("utf-8", "replace"),
                     oom_killed=oom_kills > 0),
      stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
      returncode=-signal.SIGKILL if returncode is None else returncode,
      wall_s=time.monotonic() - start, missing=tuple(k for k in PROTECTIONS if k in missing),
      peak_memory_bytes=peak if "total_memory" not in missing else None)


def _launch(cfg, stdin_bytes, cgroups):
  """Starts the launcher (this file as a script) and collects its output; see `_pump`."""
  report_r, report_w = os.pipe()
  cfg = dict(cfg, report_fd=report_w, parent=os.getpid())
  try:
    with tempfile.TemporaryFile() as stdin_file:
      stdin_file.write(stdin_bytes)
      stdin_file.seek(0)
      try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(cfg)],
            stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
            env={}, start_new_session=True, pass_fds=(report_w,))
      except OSError as e:
        raise SandboxError(f"cannot start the sandbox launcher: {e}") from e
      finally:
        os.close(report_w)
    try:
      return _pump(proc, report_r, cfg["deadline"], cfg["uid"], cgroups)
    finally:
      _kill_all(proc, cfg["uid"], cgroups)
  finally:
    os.close(report_r)


def _check_args(code, stdin, timeout_s, memory_mb):
  if not isinstance(code, str):
    raise TypeError(f"code: expected str, got {type(code).__name__}")
  if not isinstance(stdin, str):
    raise TypeError(f"stdin: expected str, got {type(stdin).__name__}")
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
    raise TypeError(f"timeout_s: expected a number of seconds, got {type(timeout_s).__name__}")
  if not 0 < timeout_s <= _MAX_TIMEOUT_S:   # also rejects nan
    raise ValueError(f"timeout_s={timeout_s}: expected 0 < timeout_s <= {_MAX_TIMEOUT_S}")
  if isinstance(memory_mb, bool) or not isinstance(memory_mb, int):
    raise TypeError(f"memory_mb: expected int, got {type(memory_mb).__name__}")
  if memory_mb < _MIN_MEMORY_MB:
    raise ValueError(f"memory_mb={memory_mb}: expected >= {_MIN_MEMORY_MB} (the interpreter "
                     f"alone needs ~16 MiB of address space)")


def _status(returncode: int | None, timed_out: bool, stderr_tail: str, *,
            oom_killed: bool = False) -> str:
  """Status from the program's returncode (None: never reported), see the module doc."""
  if timed_out:
    return "timeout"
  if oom_killed:      # by the call's cgroup, whichever of its processes it was
    return "memory"
  if returncode is None:
    return "killed"
  if returncode == 0:
    return "ok"
  if any(m in stderr_tail[-_TAIL:] for m in _MEMORY_MARKERS):
    return "memory"
  if returncode < 0:
    return _SIGNAL_STATUS.get(-returncode, "killed")
  return "error"


def _program_interpreter() -> str | None:
  """A python3 that the sandbox uid can run: /usr/bin/python3, else this one, else None.

  A virtualenv's python often lives under /root (mode 0700), out of reach of other uids.
  """
  for path in ("/usr/bin/python3", sys.executable):
    real = os.path.realpath(path)
    parents = [real]
    while parents[-1] != "/":
      parents.append(os.path.dirname(parents[-1]))
    try:
      if all(os.stat(p).st_mode & stat.S_IXOTH for p in parents):
        return real
    except OSError:
      continue
  return None


def _claim_uid() -> tuple[int, socket.socket]:
  """(uid, claim): one uid of SANDBOX_UIDS held for this call, across threads and processes.

  The claim is a bound abstract unix socket "\\0glm5_sandbox_uid_<uid>": binding is atomic,
  and the kernel releases it when the socket is closed or its process dies.
  """
  offset = random.randrange(len(SANDBOX_UIDS))   # a just-freed uid is rarely reused at once
  for i in range(len(SANDBOX_UIDS)):
    uid = SANDBOX_UIDS[(offset + i) % len(SANDBOX_UIDS)]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
      sock.bind(f"\0glm5_sandbox_uid_{uid}")
      return uid, sock
    except OSError:
      sock.close()
  raise SandboxError(f"all {len(SANDBOX_UIDS)} sandbox uids are in use")


def _pump(proc, report_fd, deadline, uid, cgroups):
  """Reads stdout, stderr and reports until the launcher is done and the pipes close.

  Returns (stdout head, stderr head, stderr tail, reports dict, launcher late).
  """
  caps = {proc.stdout.fileno(): [bytearray(), b""], proc.stderr.fileno(): [bytearray(), b""],
          report_fd: [bytearray(), b""]}
  pidfd = os.pidfd_open(proc.pid)
  poller = select.poll()
  for fd in (*caps, pidfd):
    poller.register(fd, select.POLLIN)
  open_fds, end, late = set(caps), deadline + _GRACE_S, False
  try:
    while open_fds or pidfd is not None:
      remaining = end - time.monotonic()
      if remaining <= 0:
        late = pidfd is not None
        break
      for fd, _ in poller.poll(remaining * 1000):
        if fd == pidfd:                   # launcher exited (not yet reaped)
          poller.unregister(pidfd)
          os.close(pidfd)
          pidfd = None
          _kill_all(proc, uid, cgroups, reap=False)   # whatever escaped, then drain
          end = min(end, time.monotonic() + _DRAIN_S)
          continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
          poller.unregister(fd)
          open_fds.discard(fd)
          continue
        head, tail = caps[fd]
        cap = _OUTPUT_CAP if fd != report_fd else 1 << 20
        head += chunk[:max(0, cap - len(head))]
        caps[fd][1] = (tail + chunk)[-_TAIL:]
  finally:
    if pidfd is not None:
      os.close(pidfd)
  reports = {}
  for line in bytes(caps[report_fd][0]).splitlines():
    for key, value in json.loads(line).items():
      reports[key] = reports.get(key, []) + value if key == "missing" else value
  out, err = caps[proc.stdout.fileno()], caps[proc.stderr.fileno()]
  return bytes(out[0]), bytes(err[0]), err[1], reports, late


def _kill_all(proc, uid, cgroups, *, reap=True):
  """SIGKILL the launcher's process group, every process of `uid` and of the call's
  cgroups; reap the launcher."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  if uid is not None:
    _kill_uid(uid)
  for path in _cgroup_dirs(cgroups):
    _kill_cgroup(path)
  if reap:
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def _processes_of(uid: int) -> list[int]:
  """Pids of live (non-zombie) processes whose real, effective or saved uid is `uid`."""
  pids = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status", encoding="ascii", errors="replace") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
      continue
    alive = fields.get("State", "Z").split()[0] != "Z"
    if alive and str(uid) in fields.get("Uid", "").split()[:3]:
      pids.append(int(name))
  return pids


def _kill_uid(uid: int, timeout_s: float = _KILL_WAIT_S) -> bool:
  """SIGKILL every process of `uid` until none is left (a fork bomb is bounded by NPROC)."""
  end = time.monotonic() + timeout_s
  while pids := _processes_of(uid):
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if time.monotonic() > end:
      return False
    time.sleep(0.002)
  return True


def _remove_tree(path: str):
  """rm -rf, also through directories the program made unreadable (non-root callers)."""
  if os.geteuid() != 0:
    for root, dirs, _ in os.walk(path):
      for p in (os.path.join(root, d) for d in dirs):
        with contextlib.suppress(OSError):
          if not os.path.islink(p):
            os.chmod(p, 0o700)
  shutil.rmtree(path, ignore_errors=True)


def _rlimits(timeout_s: float, memory_mb: int, *, fresh_uid: bool):
  """(resource, soft, hard) applied to the program before it drops privileges."""
  cpu_s = math.ceil(timeout_s)
  limits = [(resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20),
            (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),      # SIGXCPU, then SIGKILL
            (resource.RLIMIT_FSIZE, _FILE_CAP_MB << 20, _FILE_CAP_MB << 20),
            (resource.RLIMIT_NOFILE, _NOFILE, _NOFILE),
            (resource.RLIMIT_CORE, 0, 0)]
  if fresh_uid:   # counts every process of the uid: the caller's own when it is shared
    limits.append((resource.RLIMIT_NPROC, _NPROC, _NPROC))
  return limits


# --------------------------------------------------------------------------------------
# The call's cgroups (trainer side; the program joins them itself)
# --------------------------------------------------------------------------------------

def _own_cgroups() -> dict[str, tuple[int, str]]:
  """{"memory" / "pids": (cgroup version, directory of the caller's own cgroup)}.

  v1: a `cgroup` mount whose options name the controller; v2: the `cgroup2` mount, where
  the controller is in the caller's cgroup.controllers. A controller is in one hierarchy
  only. The paths in /proc/self/cgroup are relative to a hierarchy's root, which a mount
  may show from a subdirectory on (its root field in mountinfo).
  """
  if _CGROUP_PARENTS is not None:
    return dict(_CGROUP_PARENTS)
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
      for controller in _CGROUP_PROTECTION:
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


def _make_cgroups(memory_mb: int, pids_max: int):
  """The call's cgroups, children of the caller's: ({controller: (version, directory)},
  names of the PROTECTIONS that could not be made). Unique names: safe across threads."""
  parents = _own_cgroups()
  name = f"glm5_sandbox_{os.getpid()}_{secrets.token_hex(8)}"
  made, created, missing = {}, [], set()
  for controller, protection in _CGROUP_PROTECTION.items():
    try:
      if controller not in parents:
        raise OSError(f"no {controller} cgroup controller for this process")
      version, parent = parents[controller]
      path = os.path.join(parent, name)
      if version == 2 and controller not in _read(f"{parent}/cgroup.subtree_control").split():
        _write(f"{parent}/cgroup.subtree_control", f"+{controller}")  # EBUSY: has processes
      if path not in created:
        os.mkdir(path, 0o755)
        created.append(path)
      for file, value, required in _cgroup_limits(version, controller, memory_mb, pids_max):
        try:
          _write(os.path.join(path, file), value)
        except OSError:
          if required:
            raise
      made[controller] = (version, path)
    except OSError:
      missing.add(protection)
  for path in set(created) - set(_cgroup_dirs(made)):
    _rmdir(path)
  return made, missing


def _cgroup_dirs(cgroups) -> list[str]:
  return sorted({path for _, path in cgroups.values()})


def _cgroup_joins(cgroups) -> list[list]:
  """[[cgroup.procs file, [protections]], ...] for the program to join, one per directory."""
  joins = {}
  for controller, (_, path) in sorted(cgroups.items()):
    joins.setdefault(os.path.join(path, "cgroup.procs"), []).append(
        _CGROUP_PROTECTION[controller])
  return [[procs, names] for procs, names in joins.items()]


def _remove_cgroups(cgroups) -> tuple[int, int | None]:
  """Kills what is left in the call's cgroups, removes them: (OOM kills, peak bytes)."""
  for path in _cgroup_dirs(cgroups):
    _kill_cgroup(path)
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
  for path in _cgroup_dirs(cgroups):
    _rmdir(path)
  return oom_kills, peak


def _kill_cgroup(path: str, timeout_s: float = _KILL_WAIT_S) -> bool:
  """SIGKILL every process in cgroup `path` until none is left (pids.max bounds a bomb)."""
  with contextlib.suppress(OSError):
    _write(f"{path}/cgroup.kill", "1")       # v2, Linux >= 5.14
  end = time.monotonic() + timeout_s
  while pids := [int(p) for p in _read(f"{path}/cgroup.procs").split()]:
    for pid in pids:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if time.monotonic() > end:
      return False
    time.sleep(0.002)
  return True


def _rmdir(path: str, timeout_s: float = _KILL_WAIT_S):
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


def _write(path: str, text: str):
  """Writes a control file; never creates one (a directory that is no cgroup fails)."""
  fd = os.open(path, os.O_WRONLY)
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


# --------------------------------------------------------------------------------------
# Launcher side (this file run as a script, as root or as the caller)
# --------------------------------------------------------------------------------------

class _Libc:
  """unshare / mount / prctl through ctypes (os.unshare is Python >= 3.12)."""

  def __init__(self):
    import ctypes   # pylint: disable=g-import-not-at-top
    self._ctypes = ctypes
    self._libc = ctypes.CDLL(None, use_errno=True)
    self._libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    self._libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4

  def _call(self, name, *args):
    if getattr(self._libc, name)(*args) != 0:
      errno = self._ctypes.get_errno()
      raise OSError(errno, f"{name}{args}: {os.strerror(errno)}")

  def unshare(self, flags):
    self._call("unshare", flags)

  def mount(self, source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    self._call("mount", enc(source), enc(target), enc(fstype), flags, enc(data))

  def prctl(self, option, arg):
    self._call("prctl", option, arg, 0, 0, 0)


def _report(fd, **items):
  os.write(fd, json.dumps(items).encode() + b"\n")


def _unshare(libc, as_root, cfg):
  """Enters new namespaces one at a time; returns the names of those refused or skipped."""
  missing = []
  if not as_root:   # an unprivileged user namespace grants the rights for the others
    try:
      uid, gid = os.getuid(), os.getgid()
      libc.unshare(_CLONE_NEWUSER)
      for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                         ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
          f.write(text)
    except OSError:
      return [name for name, _ in _NAMESPACES] + ["no_userns"]
    if not _refuse_nested_userns(cfg):
      missing.append("no_userns")
  for name, flag in _NAMESPACES:
    try:
      if name in cfg["skip"]:
        raise OSError(f"{name} skipped")
      libc.unshare(flag)
    except OSError:
      missing.append(name)
  return missing


def _ns_id(kind: str):
  """Identity of this process's namespace of `kind` ("mnt", "user"), or None."""
  try:
    st = os.stat(f"/proc/self/ns/{kind}")
    return [st.st_dev, st.st_ino]
  except OSError:
    return None


def _refuse_nested_userns(cfg) -> bool:
  """user.max_user_namespaces = 0 in this process's own new user namespace (which it has
  CAP_SYS_RESOURCE in): no user namespace can be made in it or below it. Never written in
  the trainer's user namespace (False there): the host's limit stays as it is."""
  if "no_userns" in cfg["skip"] or _ns_id("user") in (None, cfg["host_user_ns"]):
    return False
  try:
    with open(_MAX_USERNS, "w", encoding="ascii") as f:
      f.write("0")
    return True
  except OSError:
    return False


def _private_mounts(libc, cfg, code, missing):
  """In init: a /proc of the new PID namespace and tmpfs scratch; returns names refused."""
  refused = ["proc", "scratch"]
  ns = _ns_id("mnt")
  if "mount_ns" in missing or ns is None or ns == cfg["host_mount_ns"]:
    return refused   # never mount anything in the trainer's mount namespace
  try:      # first, so that nothing below propagates to the host
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)
  except OSError:
    return refused
  if "pid_ns" not in missing and "proc" not in cfg["skip"]:
    try:
      libc.mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
      refused.remove("proc")
    except OSError:
      pass
  workdir = cfg["workdir"]
  try:
    if "scratch" in cfg["skip"]:
      raise OSError("scratch skipped")
    covered = False
    for path, mb in _SCRATCH:
      if os.path.isdir(path) and not os.path.islink(path):
        libc.mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={mb}m,mode=1777")
        covered = covered or workdir.startswith(path + "/")
    os.makedirs(workdir, exist_ok=True)
    if not covered:
      libc.mount("tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV,
                 f"size={_WORKDIR_MB}m,mode=0700")
    refused.remove("scratch")
  except OSError:
    pass
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, _PROGRAM), "wb") as f:
    f.write(code)
  if cfg["uid"] is not None:
    os.chown(workdir, cfg["uid"], cfg["uid"])
  os.chmod(workdir, 0o700)
  return refused


def _exec_program(libc, cfg, sync):
  """In the program's process: cgroups, limits, user namespace, uid, exec (never returns)."""
  uid = cfg["uid"]
  missing = []
  for procs, protections in cfg["cgroups"]:   # first: all it and its children use counts
    try:
      _write(procs, "0")                      # "0": this process
    except OSError:
      missing += protections
  libc.prctl(_PR_SET_NO_NEW_PRIVS, 1)
  for res, soft, hard in _rlimits(cfg["timeout_s"], cfg["memory_mb"], fresh_uid=uid is not None):
    resource.setrlimit(res, (soft, hard))
  if uid is not None:
    os.setgroups([])
    if sync is not None and not _own_user_ns(libc, cfg, sync):
      missing.append("no_userns")
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
  if missing:
    _report(cfg["report_fd"], missing=missing)
  os.chdir(cfg["workdir"])
  os.execve(cfg["python"], [cfg["python"], "-I", _PROGRAM], {})


def _own_user_ns(libc, cfg, sync) -> bool:
  """As root, in the program's process: a new user namespace that init maps the sandbox uid
  into (`_map_ids`) and that allows no nested ones. False where the kernel refused it."""
  (ready_r, ready_w), (mapped_r, mapped_w) = sync
  os.close(ready_r)
  os.close(mapped_w)
  try:
    libc.unshare(_CLONE_NEWUSER)
  except OSError:
    os.write(ready_w, b"0")
    return False
  os.write(ready_w, b"1")
  if os.read(mapped_r, 1) != b"1":
    raise OSError("init could not map the sandbox uid into the program's user namespace")
  return _refuse_nested_userns(cfg)


def _map_ids(pid, uid, sync):
  """In init: writes uid_map and gid_map ("uid uid 1") of child `pid`'s new user namespace.

  Only init can: it has CAP_SETUID in the parent user namespace, which a mapping of any id
  other than the writer's own needs.
  """
  (ready_r, ready_w), (mapped_r, mapped_w) = sync
  os.close(ready_w)
  os.close(mapped_r)
  try:
    if os.read(ready_r, 1) != b"1":   # refused, or the child died
      return
    ok = b"1"
    try:
      for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w", encoding="ascii") as f:
          f.write(f"{uid} {uid} 1\n")
    except OSError:
      ok = b"0"
    with contextlib.suppress(OSError):
      os.write(mapped_w, ok)
  finally:
    os.close(ready_r)
    os.close(mapped_w)


def _init_main(libc, cfg, code, missing):
  """PID 1 of the sandbox: set up mounts, run the program, report its wait status."""
  fd, uid = cfg["report_fd"], cfg["uid"]
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  refused = _private_mounts(libc, cfg, code, missing)
  # init maps the program's ids through /proc/<pid>: only where /proc shows init's own PID
  # namespace. Without a fresh uid, the launcher's user namespace is the limited one.
  nest = (uid is not None and "no_userns" not in cfg["skip"]
          and ("pid_ns" in missing or "proc" not in refused))
  _report(fd, missing=refused + (["no_userns"] if uid is not None and not nest else []))
  sync = (os.pipe(), os.pipe()) if nest else None
  child = os.fork()
  if child == 0:
    try:
      _exec_program(libc, cfg, sync)
    except BaseException as e:   # pylint: disable=broad-except
      _report(fd, setup_error=f"{type(e).__name__}: {e}")
    os._exit(127)
  if sync is not None:
    _map_ids(child, uid, sync)
  while True:               # as PID 1, also reap the orphans of the namespace
    pid, status = os.waitpid(-1, 0)
    if pid == child:
      _report(fd, exit=status)
      return


def _wait_until(pid, deadline) -> bool:
  """True when child `pid` exited before `deadline` (it is not reaped)."""
  pidfd = os.pidfd_open(pid)
  try:
    return bool(select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0])
  finally:
    os.close(pidfd)


def _launcher_main(cfg):
  fd, uid = cfg["report_fd"], cfg["uid"]
  os.set_inheritable(fd, False)        # closed by the program's exec
  libc = _Libc()
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != cfg["parent"]:    # the trainer died before prctl
    os._exit(1)
  with open(os.path.join(cfg["workdir"], _PROGRAM), "rb") as f:
    code = f.read()
  missing = _unshare(libc, os.geteuid() == 0, cfg)
  libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)   # orphans come here when there is no PID namespace
  _report(fd, missing=missing)
  init = os.fork()
  if init == 0:
    try:
      _init_main(libc, cfg, code, missing)
    except BaseException as e:   # pylint: disable=broad-except
      _report(fd, setup_error=f"{type(e).__name__}: {e}")
    os._exit(0)
  if not _wait_until(init, cfg["deadline"]):
    _report(fd, timeout=True)
    os.kill(init, signal.SIGKILL)      # with a PID namespace, everything inside dies
  os.waitpid(init, 0)
  if uid is not None:
    _kill_uid(uid)                     # without one: every process of the sandbox uid
  try:
    while os.waitpid(-1, os.WNOHANG)[0] > 0:
      pass
  except ChildProcessError:
    pass
  os._exit(0)


if __name__ == "__main__":
  _cfg = json.loads(sys.argv[1])
  try:
    _launcher_main(_cfg)
  except BaseException as _e:   # pylint: disable=broad-except
    _report(_cfg["report_fd"], setup_error=f"launcher: {type(_e).__name__}: {_e}")
    os._exit(1)                  # init, if started, dies with us (PR_SET_PDEATHSIG)
