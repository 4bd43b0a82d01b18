"""Worker heartbeats and fencing (GLM-5 paper §3: rollout workers fail and are restarted
while the trainer runs on).

Each rollout worker beats with its epoch. A worker silent for more than `timeout_s` is dead:
the orchestrator fences it (`fence` bumps its epoch), restarts it under the new epoch, brings
it to the current weights and re-queues its in-flight groups. Fencing is the classic lease
rule (Gray & Cheriton, "Leases", SOSP 1989; the fencing token of distributed locks): a
result or a beat carrying an older epoch comes from the fenced incarnation, still running
somewhere, and is refused (`accepts`), so the re-queued work is never counted twice.

The clock is injected (`time.monotonic` by default) so tests advance it by hand, never sleep.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Monitor:
  """Last beat and epoch of every worker (module docstring). Thread-safe."""

  def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
    if not timeout_s > 0:
      raise ValueError(f"Monitor: timeout_s={timeout_s}, expected > 0")
    self.timeout_s, self.clock = timeout_s, clock
    self._lock = threading.Lock()
    self._last: dict = {}
    self._epoch: dict = {}

  def register(self, worker_id) -> int:
    """Starts watching `worker_id` now; returns its epoch (0 for a new worker)."""
    with self._lock:
      self._last[worker_id] = self.clock()
      return self._epoch.setdefault(worker_id, 0)

  def beat(self, worker_id, epoch: int) -> bool:
    """Records a beat; False (ignored) when `epoch` is not the worker's current one."""
    with self._lock:
      if epoch != self._epoch.setdefault(worker_id, 0):
        return False
      self._last[worker_id] = self.clock()
      return True

  def dead(self) -> list:
    """Workers whose last beat (or registration, or fence) is more than timeout_s ago."""
    with self._lock:
      now = self.clock()
      return sorted(w for w, t in self._last.items() if now - t > self.timeout_s)

  def fence(self, worker_id) -> int:
    """Refuses the worker's current epoch from now on; returns the new epoch, under which
    its restart runs. The timeout restarts now, so a restart that never beats is found dead."""
    with self._lock:
      self._epoch[worker_id] = self._epoch.get(worker_id, 0) + 1
      self._last[worker_id] = self.clock()
      return self._epoch[worker_id]

  def accepts(self, worker_id, epoch: int) -> bool:
    """Whether a result stamped (worker_id, epoch) comes from the worker's live incarnation."""
    with self._lock:
      return epoch == self._epoch.get(worker_id, 0)

  def epoch(self, worker_id) -> int:
    with self._lock:
      return self._epoch.get(worker_id, 0)

  def forget(self, worker_id) -> None:
    """Stops watching `worker_id` (shut down on purpose); its epoch is kept, so its late
    results stay refused after a fence."""
    with self._lock:
      self._last.pop(worker_id, None)
