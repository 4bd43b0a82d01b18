"""This project's C++ XLA:CPU custom calls: compiled on first use, loaded, registered.

The inference engine's CPU kernels (`stream_matmul.cc`, `cpu_dsa.cc`) are XLA FFI handlers
in one C++ file each. `load` compiles a file with the system's C++ compiler (`CXX`, default
g++) into `GLM5_JAX_CACHE` (default ~/.cache/glm5_jax), once per source, flags, compiler,
jax and CPU, and registers its handlers with XLA:CPU. Without a compiler, or off CPU, it
returns False (logged once) and the caller keeps XLA's own ops: the same numbers, slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess

import jax

FLAGS = ("-O3", "-march=native", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC")


def _cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("GLM5_JAX_CACHE",
                                     pathlib.Path.home() / ".cache" / "glm5_jax"))


def _cpu_flags() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next((line for line in f if line.startswith(("flags", "Features"))), "")
  except OSError:
    return ""


def build(source: pathlib.Path) -> pathlib.Path:
  """The compiled library of `source` (built once per source, compiler, jax and CPU; an
  atomic rename makes concurrent builds safe). Raises OSError / CalledProcessError."""
  cxx = shutil.which(os.environ.get("CXX", "g++"))
  if cxx is None:
    raise OSError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
  include = jax.ffi.include_dir()
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  key = hashlib.sha256("\0".join(
      [source.read_text(), *FLAGS, include, version, jax.__version__, _cpu_flags()]).encode())
  out = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
  if not out.exists():
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    subprocess.run([cxx, *FLAGS, "-isystem", include, str(source), "-o", str(tmp)],
                   check=True, capture_output=True, text=True)
    os.replace(tmp, out)
  return out


@functools.lru_cache(maxsize=None)
def load(source: pathlib.Path, targets: tuple[tuple[str, str], ...]) -> bool:
  """Whether `source`'s handlers are registered with XLA:CPU, each (target name, C symbol)
  of `targets` (built and registered on the first call; False off CPU or on failure)."""
  if jax.default_backend() != "cpu":
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(str(build(source)))
  except subprocess.CalledProcessError as e:
    logging.warning("%s: the C++ build failed, XLA's ops are used:\n%s", source.name, e.stderr)
    return False
  except OSError as e:
    logging.warning("%s: %s; XLA's ops are used", source.name, e)
    return False
  for target, symbol in targets:
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                platform="cpu")
  return True
