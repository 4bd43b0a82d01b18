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

Process tree (the launcher is sandbox_launcher.py run as a script, so no `preexec_fn` and no fork of
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
import os
import random
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

from glm5_jax.rl.envs import sandbox_cgroups as cgroups_lib
from glm5_jax.rl.envs import sandbox_launcher as launcher

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
_PIDS_MAX = 64                     # pids.max of the call's cgroup (processes + threads)
_GRACE_S = 2.0                     # trainer's backstop past the deadline, for the launcher
_DRAIN_S = 0.5                     # reading on after the launcher exited
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory")
_SIGNAL_STATUS = {signal.SIGXCPU: "timeout"}   # other signals: "killed"
_SKIP_LAYERS: tuple[str, ...] = ()  # layers not even tried (namespaces, mounts, "no_userns"):
                                    # tests of the fallbacks


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
    cgroups, no_cgroup = cgroups_lib.make_cgroups(memory_mb, _PIDS_MAX)
    workdir = tempfile.mkdtemp(prefix="glm5_sandbox_")
    if uid is not None:
      launcher.kill_uid(uid)             # leftovers of a trainer that crashed with this uid
      os.chown(workdir, uid, uid)
    with open(os.path.join(workdir, launcher.PROGRAM), "w", encoding="utf-8") as f:
      f.write(code)
    cfg = dict(uid=uid, workdir=workdir, python=python or sys.executable,
               deadline=start + timeout_s, timeout_s=timeout_s, memory_mb=memory_mb,
               skip=list(_SKIP_LAYERS), host_mount_ns=launcher.ns_id("mnt"),
               host_user_ns=launcher.ns_id("user"), cgroups=cgroups_lib.cgroup_joins(cgroups))
    out, err, err_tail, reports, late = _launch(cfg, stdin.encode("utf-8"), cgroups)
  finally:
    oom_kills, peak = cgroups_lib.remove_cgroups(cgroups)
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
  """Starts the launcher (sandbox_launcher.py as a script) and collects its output; see `_pump`."""
  report_r, report_w = os.pipe()
  cfg = dict(cfg, report_fd=report_w, parent=os.getpid())
  try:
    with tempfile.TemporaryFile() as stdin_file:
      stdin_file.write(stdin_bytes)
      stdin_file.seek(0)
      try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(launcher.__file__), json.dumps(cfg)],
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
    launcher.kill_uid(uid)
  for path in cgroups_lib.cgroup_dirs(cgroups):
    cgroups_lib.kill_cgroup(path)
  if reap:
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def _remove_tree(path: str):
  """rm -rf, also through directories the program made unreadable (non-root callers)."""
  if os.geteuid() != 0:
    for root, dirs, _ in os.walk(path):
      for p in (os.path.join(root, d) for d in dirs):
        with contextlib.suppress(OSError):
          if not os.path.islink(p):
            os.chmod(p, 0o700)
  shutil.rmtree(path, ignore_errors=True)
