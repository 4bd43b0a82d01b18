"""Metrics: one JSON object per step in WORKDIR/metrics.jsonl, TensorBoard scalars, log lines."""

from __future__ import annotations

import json
import os
import time

from absl import logging
import jax
import numpy as np


class MetricWriter:
  """Writes on process 0 only; every value is a Python float."""

  def __init__(self, workdir: str, tensorboard: bool = True, resume_step: int | None = None):
    """resume_step: the step the run continues from (-1 = from scratch): rows of later steps,
    written by a run killed after its last checkpoint, are dropped from metrics.jsonl so that
    the resumed run's rows replace them instead of repeating them. None keeps every row."""
    self._on = jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    if not self._on:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    if resume_step is not None and os.path.exists(path):
      with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
      with open(path + ".tmp", "w") as f:
        f.writelines(rows)
      os.replace(path + ".tmp", path)
    self._jsonl = open(path, "a")
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, scalars: dict, prefix: str = ""):
    if not self._on:
      return
    row = {"step": int(step), **{prefix + k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in row.items():
        if k != "step":
          self._tb.add_scalar(k, v, step)

  def flush(self):
    if self._on:
      self._jsonl.flush()
      if self._tb is not None:
        self._tb.flush()

  def close(self):
    if self._on:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()


def read_rows(workdir: str) -> list[dict]:
  """The rows of WORKDIR/metrics.jsonl ([] without one)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def final_metrics(workdir: str) -> dict:
  """The last value of every metric in WORKDIR/metrics.jsonl (a finished run read back)."""
  merged = {}
  for row in read_rows(workdir):
    merged.update(row)
  return merged


def has_metric(workdir: str, step: int, key: str) -> bool:
  return any(r["step"] == step and key in r for r in read_rows(workdir))


class Progress:
  """steps/s, tokens/s and ETA over the last logging window, training time only: what
  `exclude` is given (evaluation, checkpoints, profiling) is left out."""

  def __init__(self, start_step: int, total_steps: int, tokens_per_step: int):
    self.total, self.tokens_per_step = total_steps, tokens_per_step
    self._t, self._step = time.perf_counter(), start_step
    self._excluded = 0.0

  def exclude(self, seconds: float):
    self._excluded += seconds

  def update(self, step: int, tokens: float | None = None) -> dict:
    """Rates since the last update; `tokens`: those trained on in that window (default:
    `tokens_per_step` per step)."""
    now = time.perf_counter()
    dt, ds = now - self._t - self._excluded, max(step - self._step, 1)
    self._t, self._step, self._excluded = now, step, 0.0
    sps = ds / max(dt, 1e-9)
    tps = sps * self.tokens_per_step if tokens is None else tokens / max(dt, 1e-9)
    return {"steps_per_s": sps, "tokens_per_s": tps,
            "eta_s": (self.total - step) / max(sps, 1e-9)}


# (label, metric, format) of a stage's log line; the runner appends throughput and ETA.
LM_LOG = (("loss", "loss", ".4f"), ("ce", "ce", ".4f"), ("kl", "indexer_kl", ".3g"),
          ("gnorm", "grad_norm", ".3f"), ("lr", "learning_rate", ".2e"))


def log_line(stage: str, step: int, total: int, m: dict, p: dict, fields=LM_LOG):
  parts = [f"{label} {format(m.get(key, np.nan), fmt)}" for label, key, fmt in fields]
  logging.info("[%s] step %d/%d  %s  %.2f steps/s  %.0f tok/s  mfu %.2g  ETA %.0fs", stage,
               step, total, "  ".join(parts), p["steps_per_s"], p["tokens_per_s"],
               m.get("est_mfu", np.nan), p["eta_s"])
