"""Runs a Python script in a subprocess with N fake CPU devices (fixed at jax import)."""

import os
import subprocess
import sys
from tests import paths

ROOT = paths.ROOT


def run_script(script: str, devices: int = 8, timeout: int = 900):
  """Runs `script` (source text) from the repo root; asserts it exits 0 and prints OK last."""
  env = dict(os.environ, PYTHONPATH=ROOT,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=timeout)
  assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stderr[-3000:]
