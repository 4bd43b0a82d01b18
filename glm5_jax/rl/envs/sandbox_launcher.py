"""The sandbox's launcher: the program that sets up the namespaces, init and the program.

`sandbox.run_python` runs this file as a script (`python -I -S sandbox_launcher.py CFG`), in
a session of its own, so the trainer never forks (no `preexec_fn`, no fork of a threaded
process). It imports nothing but the standard library. It unshares the namespaces, forks
init (PID 1 of the new PID namespace: private mounts, the program's uid map, reaping), which
forks the program (cgroups, rlimits, uid, exec); the tree and the layers are described in
glm5_jax/rl/envs/sandbox.py's docstring.

Everything it learns goes to the trainer as JSON lines on the report pipe (`cfg["report_fd"]`):
{"missing": [...]} for each layer refused, {"exit": wait status}, {"timeout": true} and
{"setup_error": text}.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import select
import signal
import sys
import time

PROGRAM = "main.py"                # the program's file in its working directory
KILL_WAIT_S = 2.0                  # how long a kill waits for the processes to be gone
_FILE_CAP_MB = 16                  # RLIMIT_FSIZE
_NPROC = 64                        # RLIMIT_NPROC (processes + threads of the fresh uid)
_NOFILE = 256
_SCRATCH = (("/tmp", 32), ("/var/tmp", 1), ("/dev/shm", 1), ("/run/lock", 1))  # (dir, MiB)
_WORKDIR_MB = 32                   # tmpfs on the workdir when it is outside the scratch dirs
_MAX_USERNS = "/proc/sys/user/max_user_namespaces"   # per user namespace (Linux >= 4.9)

# Linux constants (sched.h, sys/mount.h, sys/prctl.h).
_CLONE_NEWUSER = 0x10000000
_NAMESPACES = (("mount_ns", 0x00020000), ("uts_ns", 0x04000000), ("ipc_ns", 0x08000000),
               ("pid_ns", 0x20000000), ("net_ns", 0x40000000))
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 36, 38


def _report(fd, **items):
  os.write(fd, json.dumps(items).encode() + b"\n")


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


def ns_id(kind: str):
  """Identity of this process's namespace of `kind` ("mnt", "user"), or None."""
  try:
    st = os.stat(f"/proc/self/ns/{kind}")
    return [st.st_dev, st.st_ino]
  except OSError:
    return None


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


def _refuse_nested_userns(cfg) -> bool:
  """user.max_user_namespaces = 0 in this process's own new user namespace (which it has
  CAP_SYS_RESOURCE in): no user namespace can be made in it or below it. Never written in
  the trainer's user namespace (False there): the host's limit stays as it is."""
  if "no_userns" in cfg["skip"] or ns_id("user") in (None, cfg["host_user_ns"]):
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
  ns = ns_id("mnt")
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
  with open(os.path.join(workdir, PROGRAM), "wb") as f:
    f.write(code)
  if cfg["uid"] is not None:
    os.chown(workdir, cfg["uid"], cfg["uid"])
  os.chmod(workdir, 0o700)
  return refused


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


def _exec_program(libc, cfg, sync):
  """In the program's process: cgroups, limits, user namespace, uid, exec (never returns)."""
  uid = cfg["uid"]
  missing = []
  for procs, protections in cfg["cgroups"]:   # first: all it and its children use counts
    try:
      write_file(procs, "0")                      # "0": this process
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
  os.execve(cfg["python"], [cfg["python"], "-I", PROGRAM], {})


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
  with open(os.path.join(cfg["workdir"], PROGRAM), "rb") as f:
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
    kill_uid(uid)                     # without one: every process of the sandbox uid
  try:
    while os.waitpid(-1, os.WNOHANG)[0] > 0:
      pass
  except ChildProcessError:
    pass
  os._exit(0)


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


def kill_uid(uid: int, timeout_s: float = KILL_WAIT_S) -> bool:
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


def write_file(path: str, text: str):
  """Writes a control file; never creates one (a directory that is no cgroup fails)."""
  fd = os.open(path, os.O_WRONLY)
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


if __name__ == "__main__":
  _cfg = json.loads(sys.argv[1])
  try:
    _launcher_main(_cfg)
  except BaseException as _e:   # pylint: disable=broad-except
    _report(_cfg["report_fd"], setup_error=f"launcher: {type(_e).__name__}: {_e}")
    os._exit(1)                  # init, if started, dies with us (PR_SET_PDEATHSIG)
