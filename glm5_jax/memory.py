"""Resident memory of this process: the peak growth over a block of code.

A weight push must not hold the whole tree twice in one process; `Peak` is how the trainer
and the rollout workers measure it (rl/orchestration/async_loop.py,
rl/orchestration/rollout_worker.py) and how experiments/bench_weight_push.py reports it:

  with memory.Peak() as p:
    store.publish(params, version)
  p.growth        # bytes: peak RSS during the block minus the RSS at its start

On Linux the kernel's own high-water mark (VmHWM, reset through /proc/self/clear_refs) sees
every page the block touched, however briefly; elsewhere a sampling thread (every 2 ms)
gives a lower bound. The whole process counts, other threads too.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading

_STATUS = "/proc/self/status"


def rss() -> int:
  """This process's resident set size in bytes."""
  if os.path.exists(_STATUS):
    return _status_bytes("VmRSS:")
  import resource  # pylint: disable=g-import-not-at-top
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # peak only (macOS: B)


def _status_bytes(field: str) -> int:
  with open(_STATUS) as f:
    for line in f:
      if line.startswith(field):
        return int(line.split()[1]) * 1024
  raise KeyError(f"{field} not in {_STATUS}")


def _reset_high_water_mark() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")                                 # VmHWM := the current RSS
    return True
  except OSError:
    return False


class Peak:
  """Peak RSS growth over a `with` block (`growth`), relative to the RSS at its start after
  a garbage collection and malloc_trim; `end_growth`: the RSS left at its end."""

  def __enter__(self):
    gc.collect()
    try:
      ctypes.CDLL("libc.so.6").malloc_trim(0)      # freed heap pages back to the kernel
    except (OSError, AttributeError):
      pass
    self.base = self.peak = rss()
    self.exact = _reset_high_water_mark()
    self._stop = threading.Event()
    self._thread = None
    if not self.exact:
      self._thread = threading.Thread(target=self._sample, daemon=True, name="memory.Peak")
      self._thread.start()
    return self

  def _sample(self):
    while not self._stop.wait(0.002):
      self.peak = max(self.peak, rss())

  def __exit__(self, *exc):
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    end = rss()
    self.peak = max(self.peak, end, _status_bytes("VmHWM:") if self.exact else 0)
    self.growth, self.end_growth = self.peak - self.base, end - self.base
    return False
