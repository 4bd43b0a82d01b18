"""Sandbox for untrusted Python: each protection against the program that defeats it.

CI runs these as root, as the trainer does. A protection the kernel refuses must be listed
in `missing` (cross-checked with util-linux `unshare`), and then its attack is not expected
to fail. After every run, no process of the sandbox's uid and no child of this process may
be left (read from /proc here, independently of the module), nor any of its cgroups.
"""

import errno
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import zlib

import numpy as np
import pytest

from glm5_jax.rl.envs import sandbox
from glm5_jax.rl.envs import sandbox_cgroups

_ROOT = os.geteuid() == 0
_PRINT_UID = "import os, sys\nprint(os.getuid(), flush=True)\n"   # so the test can look for it


def _rng(name):
  return np.random.default_rng(zlib.crc32(name.encode()))


def _secret(name):
  return "s3cret-" + "".join(_rng(name).choice(list("abcdef0123456789"), 24))


def _kernel_allows(*flags):
  """Whether util-linux unshare can enter these namespaces (with a user namespace if not root)."""
  user = [] if _ROOT else ["--user", "--map-root-user"]
  return subprocess.run(["unshare", *user, *flags, "true"], capture_output=True).returncode == 0


def _in_force(result, name, *flags):
  """Whether protection `name` was in force; `missing` must agree with the kernel."""
  in_force = name not in result.missing
  if shutil.which("unshare"):
    assert in_force == _kernel_allows(*flags), (name, result.missing)
  return in_force


def _processes(pred):
  """(pid, ppid, uids, state) of processes matching pred(ppid, uids), zombies included."""
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
      continue
    ppid, uids = int(fields["PPid"]), [int(u) for u in fields["Uid"].split()]
    if pred(ppid, uids):
      found.append((int(name), ppid, uids, fields["State"].strip()))
  return found


def _cgroups_left():
  """This process's per-call cgroups still present, under each parent the module uses."""
  prefix = f"glm5_sandbox_{os.getpid()}_"
  return [os.path.join(parent, name) for _, parent in sandbox_cgroups.own_cgroups().values()
          for name in os.listdir(parent) if name.startswith(prefix)]


def _assert_nothing_left(result):
  children = _processes(lambda ppid, _: ppid == os.getpid())
  assert not children, children
  assert not _cgroups_left()
  if _ROOT and "uid" not in result.missing:
    uid = int(result.stdout.split("\n", 1)[0])
    assert uid in sandbox.SANDBOX_UIDS
    left = _processes(lambda _, uids: uid in uids)
    assert not left, left


def test_stdin_to_stdout():
  text = "".join(_rng("test_stdin_to_stdout").choice(list("abc xyz\n"), 200))
  r = sandbox.run_python("import sys\nsys.stdout.write(sys.stdin.read()[::-1])\n", stdin=text,
                         timeout_s=5.0)
  assert (r.status, r.returncode, r.stdout, r.stderr) == ("ok", 0, text[::-1], "")
  assert 0 < r.wall_s < 5.0
  assert r.status in sandbox.STATUSES and set(r.missing) <= set(sandbox.PROTECTIONS)


def test_environment_is_empty(monkeypatch):
  monkeypatch.setenv("GLM5_SANDBOX_SECRET", _secret("test_environment_is_empty"))
  r = sandbox.run_python("import json, os\nprint(json.dumps(sorted(os.environ)))\n",
                         timeout_s=5.0)
  assert r.status == "ok"
  assert set(json.loads(r.stdout)) <= {"LC_CTYPE"}   # python3 sets it itself (PEP 538)


def test_runs_as_a_fresh_uid_in_its_own_namespaces():
  code = _PRINT_UID + ("import json\nprint(json.dumps([os.getgid(), os.getgroups(), "
                       "os.getpid(), os.listdir('/tmp'), os.getcwd()]))\n")
  r = sandbox.run_python(code, timeout_s=5.0)
  assert r.status == "ok", r.stderr
  uid, rest = r.stdout.split("\n", 1)
  gid, groups, pid, tmp, cwd = json.loads(rest)
  if _ROOT and "uid" not in r.missing:
    assert int(uid) in sandbox.SANDBOX_UIDS and (gid, groups) == (int(uid), [])
  else:
    assert "uid" in r.missing and int(uid) == os.getuid()
  if _in_force(r, "pid_ns", "--pid", "--fork"):
    assert pid == 2   # 1 is the sandbox's init
  if _in_force(r, "scratch", "--mount"):
    assert tmp == [os.path.basename(cwd)]   # a private /tmp: only its working directory
  assert not os.path.exists(cwd)            # removed afterwards
  _assert_nothing_left(r)


def test_syntax_error_is_an_error():
  r = sandbox.run_python("def f(:\n  pass\n", timeout_s=5.0)
  assert (r.status, r.returncode) == ("error", 1)
  assert "SyntaxError" in r.stderr


def test_infinite_loop_times_out_at_the_wall_deadline():
  r = sandbox.run_python(_PRINT_UID + "while True:\n  pass\n", timeout_s=1.0)
  assert (r.status, r.returncode) == ("timeout", -signal.SIGKILL)
  assert 1.0 <= r.wall_s < 1.0 + 1.5
  _assert_nothing_left(r)


@pytest.mark.parametrize("alloc", ["x = bytearray(10 * 2**30)",
                                   "x = []\nwhile True:\n  x.append(bytearray(2**20))"])
def test_10gb_allocation_is_stopped_by_the_memory_limit(alloc):
  r = sandbox.run_python(_PRINT_UID + alloc, timeout_s=10.0, memory_mb=128)
  assert r.status == "memory", r
  assert r.returncode == 1 and r.stderr.rstrip().endswith("MemoryError")
  assert r.wall_s < 3.0   # the limit stopped it, not the 10 s wall clock
  _assert_nothing_left(r)


def test_fork_bomb_ends_and_leaves_no_process():
  code = _PRINT_UID + "while True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
  r = sandbox.run_python(code, timeout_s=1.5)
  assert r.status != "ok"
  assert r.wall_s < 1.5 + 2.0
  _assert_nothing_left(r)


def test_background_process_dies_with_the_program():
  code = _PRINT_UID + ("import time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\n"
                       "print('parent exits')\n")
  r = sandbox.run_python(code, timeout_s=5.0)
  assert r.status == "ok" and r.stdout.endswith("parent exits\n")
  assert r.wall_s < 5.0
  _assert_nothing_left(r)


def test_cannot_connect_to_a_local_listening_socket():
  with socket.create_server(("127.0.0.1", 0)) as server:
    server.settimeout(0.0)
    port = server.getsockname()[1]
    code = _PRINT_UID + (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                         "timeout=2).close()\nprint('connected')\n")
    r = sandbox.run_python(code, timeout_s=5.0)
    if _in_force(r, "net_ns", "--net"):
      assert r.status == "error" and "connected" not in r.stdout
      with pytest.raises(BlockingIOError):
        server.accept()
  _assert_nothing_left(r)


def test_cannot_write_to_root_home():
  target = os.path.join(os.path.expanduser("~"), f"sandbox_test_{os.getpid()}")
  r = sandbox.run_python(_PRINT_UID + f"open({target!r}, 'w').write('x')\n", timeout_s=5.0)
  if _ROOT and "uid" not in r.missing:
    assert r.status == "error" and "PermissionError" in r.stderr
    assert not os.path.exists(target)
  else:
    assert "uid" in r.missing
  _assert_nothing_left(r)


def test_cannot_write_to_a_world_writable_host_tmp_dir():
  with tempfile.TemporaryDirectory() as host_dir:
    os.chmod(host_dir, 0o777)   # only the private /tmp protects it
    target = os.path.join(host_dir, "planted")
    r = sandbox.run_python(_PRINT_UID + f"open({target!r}, 'w').write('x')\n", timeout_s=5.0)
    if _in_force(r, "scratch", "--mount"):
      assert r.status == "error" and "FileNotFoundError" in r.stderr
      assert os.listdir(host_dir) == []
  _assert_nothing_left(r)


def test_cannot_read_the_environment_directly(monkeypatch):
  secret = _secret("test_cannot_read_the_environment_directly")
  monkeypatch.setenv("GLM5_SANDBOX_SECRET", secret)
  r = sandbox.run_python(_PRINT_UID + "print(os.environ['GLM5_SANDBOX_SECRET'])\n",
                         timeout_s=5.0)
  assert r.status == "error" and "KeyError" in r.stderr
  assert secret not in r.stdout + r.stderr
  _assert_nothing_left(r)


@pytest.mark.parametrize("whose", ["parent", "init"])
def test_cannot_read_the_environment_through_proc(monkeypatch, whose):
  secret = _secret(f"test_cannot_read_the_environment_through_proc_{whose}")
  monkeypatch.setenv("GLM5_SANDBOX_SECRET", secret)
  path = f"/proc/{os.getpid()}/environ" if whose == "parent" else "/proc/1/environ"
  r = sandbox.run_python(_PRINT_UID + f"print(open({path!r}, 'rb').read())\n", timeout_s=5.0)
  assert r.status == "error"
  assert secret not in r.stdout + r.stderr
  _assert_nothing_left(r)


def test_limits_are_in_force():
  timeout_s, memory_mb = 2.5, 96
  names = ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE",
           "RLIMIT_NPROC"]
  code = "import resource\n" + "".join(
      f"print(resource.getrlimit(resource.{n}))\n" for n in names)
  r = sandbox.run_python(code, timeout_s=timeout_s, memory_mb=memory_mb)
  assert r.status == "ok", r.stderr
  got = dict(zip(names, map(eval, r.stdout.splitlines())))
  assert got["RLIMIT_AS"] == (memory_mb * 2**20,) * 2
  assert got["RLIMIT_CPU"] == (math.ceil(timeout_s), math.ceil(timeout_s) + 1)
  assert got["RLIMIT_FSIZE"] == (16 * 2**20,) * 2
  assert got["RLIMIT_NOFILE"] == (256, 256)
  assert got["RLIMIT_CORE"] == (0, 0)
  if "nproc" not in r.missing:
    assert got["RLIMIT_NPROC"] == (64, 64)
  else:
    assert got["RLIMIT_NPROC"] == resource.getrlimit(resource.RLIMIT_NPROC)


def test_output_is_capped():
  r = sandbox.run_python("while True:\n  print('x' * 999)\n", timeout_s=1.0)
  assert r.status == "timeout"
  assert r.stdout == ("x" * 999 + "\n") * 65 + "x" * (64 * 1024 - 65 * 1000)


@pytest.mark.parametrize("sig, status", [(signal.SIGXCPU, "timeout"), (signal.SIGKILL, "killed"),
                                         (signal.SIGSEGV, "killed")])
def test_death_by_signal(sig, status):
  r = sandbox.run_python(f"import os\nos.kill(os.getpid(), {int(sig)})\n", timeout_s=5.0)
  assert (r.status, r.returncode) == (status, -sig)


@pytest.mark.parametrize("code, status", [("raise SystemExit(3)", "error"),
                                          ("raise MemoryError", "memory"),
                                          ("import sys\nsys.exit(0)", "ok")])
def test_exit_statuses(code, status):
  assert sandbox.run_python(code, timeout_s=5.0).status == status


def test_calls_from_several_threads_are_isolated():
  rng = _rng("test_calls_from_several_threads_are_isolated")
  texts = ["".join(rng.choice(list("abcdef"), 50)) for _ in range(4)]
  code = _PRINT_UID + "import time\ntime.sleep(0.3)\nprint(sys.stdin.read()[::-1])\n"
  results = [None] * len(texts)

  def work(i):
    results[i] = sandbox.run_python(code, stdin=texts[i], timeout_s=10.0)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for text, r in zip(texts, results):
    assert r.status == "ok" and r.stdout.split("\n")[1] == text[::-1], r
    _assert_nothing_left(r)
  uids = {r.stdout.split("\n")[0] for r in results}
  assert len(uids) == (len(texts) if _ROOT else 1)


@pytest.mark.skipif(not _ROOT, reason="killing by uid needs root (as in CI)")
def test_without_namespaces_nothing_is_left_either(monkeypatch):
  layers = ("pid_ns", "net_ns", "mount_ns", "ipc_ns", "uts_ns")
  monkeypatch.setattr(sandbox, "_SKIP_LAYERS", layers)
  escape = ("import time\nif os.fork() == 0:\n  os.setsid()\n  while True:\n    try:\n"
            "      os.fork()\n    except OSError:\n      time.sleep(0.01)\n")
  for tail, status in [(escape + "print('parent exits')\n", "ok"),
                       (escape + "while True:\n  pass\n", "timeout")]:
    r = sandbox.run_python(_PRINT_UID + tail, timeout_s=1.0)
    assert r.status == status
    host_dependent = {"no_userns", "total_memory", "total_processes"}   # own tests below
    assert set(layers) | {"proc", "scratch"} == set(r.missing) - host_dependent
    _assert_nothing_left(r)


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(code=b"print(1)"), TypeError, "code"),
    (dict(code="", stdin=None), TypeError, "stdin"),
    (dict(code="", timeout_s=0), ValueError, "timeout_s"),
    (dict(code="", timeout_s=float("nan")), ValueError, "timeout_s"),
    (dict(code="", timeout_s="1"), TypeError, "timeout_s"),
    (dict(code="", memory_mb=16), ValueError, "memory_mb"),
    (dict(code="", memory_mb=256.0), TypeError, "memory_mb"),
])
def test_bad_arguments_name_the_field(kwargs, error, field):
  code = kwargs.pop("code")
  with pytest.raises(error, match=field):
    sandbox.run_python(code, **kwargs)


@pytest.mark.skipif(not _ROOT, reason="the interpreter is chosen for the sandbox uid only as root")
def test_set_up_failure_raises_instead_of_scoring(monkeypatch):
  monkeypatch.setattr(sandbox, "_program_interpreter", lambda: "/nonexistent/python3")
  with pytest.raises(sandbox.SandboxError, match="/nonexistent/python3"):
    sandbox.run_python("print(1)", timeout_s=5.0)
  assert not _processes(lambda ppid, _: ppid == os.getpid())


def test_children_together_over_memory_mb_are_killed_and_the_status_is_memory():
  # Each child is far under its own RLIMIT_AS (256 MiB); the six hold 600 MiB together.
  memory_mb = 256
  code = _PRINT_UID + (
      "import time\nkids = []\nfor _ in range(6):\n  pid = os.fork()\n  if pid == 0:\n"
      "    x = b'x' * (100 << 20)\n    time.sleep(0.5)\n    os._exit(0)\n  kids.append(pid)\n"
      "print(sorted(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids))\n")
  r = sandbox.run_python(code, timeout_s=10.0, memory_mb=memory_mb)
  if "total_memory" in r.missing:     # the hole it names: all six resident at once
    assert (r.status, r.peak_memory_bytes) == ("ok", None)
  else:
    assert (r.status, r.returncode) == ("memory", 0), r   # the parent itself exits 0
    assert -signal.SIGKILL in json.loads(r.stdout.split("\n")[1])   # the OOM killer's victims
    print(f"peak {r.peak_memory_bytes / 2**20:.1f} MiB of a {memory_mb} MiB limit")
    assert 200 * 2**20 < r.peak_memory_bytes <= 1.02 * memory_mb * 2**20
  assert r.wall_s < 5.0
  _assert_nothing_left(r)


def test_forks_beyond_the_process_limit_fail(monkeypatch):
  monkeypatch.setattr(sandbox, "_PIDS_MAX", 12)   # below RLIMIT_NPROC (64): the cgroup's
  code = _PRINT_UID + (
      "import time\nn = 0\ntry:\n  for _ in range(100):\n    if os.fork() == 0:\n"
      "      time.sleep(30)\n      os._exit(0)\n    n += 1\nexcept OSError as e:\n"
      "  print(n, e.errno)\nelse:\n  print(n, 0)\n")
  r = sandbox.run_python(code, timeout_s=5.0)
  assert r.status == "ok", r
  forked, error = map(int, r.stdout.split("\n")[1].split())
  if "total_processes" not in r.missing:
    assert (forked, error) == (12 - 1, errno.EAGAIN)   # the program itself is the 12th
  elif "nproc" not in r.missing:
    assert error == errno.EAGAIN and forked < 64
  _assert_nothing_left(r)


def _unprivileged_userns_allowed():
  """Whether an unprivileged uid may create a user namespace on this host (needs root)."""
  return subprocess.run(["unshare", "--user", "true"], user=65534, group=65534,
                        extra_groups=[], capture_output=True).returncode == 0


def test_cannot_create_a_nested_user_namespace(monkeypatch):
  with open("/proc/sys/user/max_user_namespaces") as f:
    host_limit = f.read()
  code = _PRINT_UID + (   # util-linux first: after a successful unshare we are inside
      "import ctypes, shutil, subprocess\n"
      "print(subprocess.run([shutil.which('unshare'), '-U', 'true']).returncode)\n"
      "try:\n  if hasattr(os, 'unshare'):\n    os.unshare(os.CLONE_NEWUSER)\n"
      "  else:   # Python < 3.12\n    libc = ctypes.CDLL(None, use_errno=True)\n"
      "    if libc.unshare(0x10000000):\n      raise OSError(ctypes.get_errno(), 'unshare')\n"
      "  print('created')\nexcept OSError as e:\n  print('refused', e.errno)\n")
  r = sandbox.run_python(code, timeout_s=5.0)
  assert r.status == "ok", r
  util_linux, syscall = r.stdout.split("\n")[1:3]
  if "no_userns" not in r.missing:
    assert syscall.split()[0] == "refused" and util_linux != "0"
  monkeypatch.setattr(sandbox, "_SKIP_LAYERS", ("no_userns",))   # the attack, unprotected
  unprotected = sandbox.run_python(code, timeout_s=5.0)
  assert "no_userns" in unprotected.missing
  if _ROOT and shutil.which("unshare") and _unprivileged_userns_allowed():
    assert unprotected.stdout.split("\n")[1:3] == ["0", "created"], unprotected
  with open("/proc/sys/user/max_user_namespaces") as f:
    assert f.read() == host_limit        # the host's limit is untouched
  _assert_nothing_left(r)
  _assert_nothing_left(unprotected)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("parent", ["not_writable", "not_a_cgroup"])
def test_without_a_cgroup_the_program_runs_and_total_memory_is_missing(monkeypatch, tmp_path,
                                                                       version, parent):
  where = "/sys/kernel" if parent == "not_writable" else str(tmp_path)   # mkdir: EPERM
  monkeypatch.setattr(sandbox_cgroups, "PARENTS", {"memory": (version, where),
                                                  "pids": (version, where)})
  r = sandbox.run_python(_PRINT_UID + "print('ran')\n", timeout_s=5.0)
  assert r.status == "ok" and r.stdout.endswith("\nran\n"), r
  assert {"total_memory", "total_processes"} <= set(r.missing)
  assert r.peak_memory_bytes is None
  if parent == "not_a_cgroup":
    assert os.listdir(tmp_path) == []    # the directory it made is removed again
  _assert_nothing_left(r)
