"""Coordinated preemption: SIGTERM on any process stops every process at the same step.

A scheduler may signal one process of a run (or all of them, at different moments). Each
process records the signal locally; `Preemption.should_stop(step)` then agrees on it with
the others (an all-gather of the local flags, a max) so that all of them stop after the
same step, save one checkpoint together and exit 0. One process alone needs no agreement.

Every loop uses it the same way (train/loop.py, rl/grpo.py; the main job's stages inherit
it through them):

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


class Preemption:
  """SIGTERM -> a local flag; `should_stop` agrees on it across processes.

  Install it in the main thread (elsewhere signals cannot be caught: then only a flag set
  by `request()` stops the run). `close()` puts the previous handler back.
  """

  def __init__(self, solo: bool = False):
    self.solo = solo                # this process trains alone: no other process to ask
    self._local = False
    try:
      self._old = signal.signal(signal.SIGTERM, self._handler)
    except ValueError:                                 # not in the main thread
      self._old = None

  def _handler(self, *_):
    logging.warning("SIGTERM on process %d: all processes stop and checkpoint at the next "
                    "agreed step", jax.process_index())
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
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)
      self._old = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
