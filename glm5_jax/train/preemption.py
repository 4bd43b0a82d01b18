"""Coordinated preemption: SIGTERM (or Ctrl-C) on any process stops every process at one step.

A scheduler may signal one process of a run (or all of them, at different moments). Each
process records the signal locally; `Preemption.should_stop(step)` then agrees on it with
the others (an all-gather of the local flags, a max) so that all of them stop after the
same step, save one checkpoint together and exit 0. One process alone needs no agreement.
SIGINT (Ctrl-C) is handled as SIGTERM; a second SIGINT raises KeyboardInterrupt at once
(no checkpoint: the rerun resumes from the last one).

Every loop uses it the same way (train/loop.py, rl/orchestration/grpo.py; the main job's stages
inherit it through them):

  preempt = preemption.Preemption()
  for step ...:
    ...one step...
    stop = preempt.should_stop(step)      # a collective: every process calls it every step
    if stop or step % checkpoint_every == 0: save(step)
    if stop: raise preemption.Preempted(step, workdir)

`Preempted` is a `SystemExit` with code 0: uncaught, the process exits 0 after the
checkpoint, and nothing later runs (a main job does not start its next stage; its rerun
continues where it stopped).
"""

from __future__ import annotations

import signal

from absl import logging
import jax
import numpy as np


class Preempted(SystemExit):
  """Raised after the checkpoint of a preempted run; exits 0 when uncaught."""

  def __init__(self, step: int, workdir: str):
    super().__init__(0)
    self.step, self.workdir = step, workdir

  def __str__(self):
    return f"preempted: checkpointed step {self.step} in {self.workdir}; rerun to continue"


SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
  """SIGTERM or SIGINT -> a local flag; `should_stop` agrees on it across processes.

  Install it in the main thread (elsewhere signals cannot be caught: then only a flag set
  by `request()` stops the run). `close()` puts the previous handlers back.
  """

  def __init__(self, solo: bool = False):
    self.solo = solo                # this process trains alone: no other process to ask
    self._local = False
    self._old = {}
    try:
      for s in SIGNALS:
        self._old[s] = signal.signal(s, self._handler)
    except ValueError:                                 # not in the main thread
      self._old = {}

  def _handler(self, signum, _):
    name = signal.Signals(signum).name
    if signum == signal.SIGINT and self._local:
      raise KeyboardInterrupt("second SIGINT: stopping now, without a checkpoint")
    again = " (SIGINT again: stop now, without a checkpoint)" if signum == signal.SIGINT else ""
    logging.warning("%s on process %d: all processes stop and checkpoint at the next "
                    "agreed step%s", name, jax.process_index(), again)
    self._local = True

  def request(self):
    """What SIGTERM does (tests, or a caller with its own notice of preemption)."""
    self._local = True

  def should_stop(self, step: int) -> bool:
    """Whether any process was signalled. With several processes, a collective: every
    process must call it after the same steps."""
    if jax.process_count() == 1 or self.solo:
      return self._local
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    flags = multihost_utils.process_allgather(np.asarray([self._local], np.int32))
    stop = bool(np.max(flags))
    if stop:
      logging.warning("preemption agreed at step %d (signalled processes: %s)", step,
                      np.flatnonzero(np.ravel(flags)).tolist())
    return stop

  def close(self):
    for s, old in self._old.items():
      signal.signal(s, old)
    self._old = {}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
