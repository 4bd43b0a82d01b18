"""The batch source of the synthetic copy task: does a model learn in-context copying?

The pretraining stage's model, loss and optimizer (`train.loop.run` with this source) on copy
rows (glm5_jax/data/copy_task.py): `copy.train="position"` trains on blocks of a fixed
segment length and gap (a copy sits a fixed distance after its source), `"content"` on
lengths drawn per block. Every `copy.eval_every` steps (and at step 0) the held-out copy
accuracy of both kinds (`copy.eval_rows` fixed rows each) is measured: metrics
`position_accuracy` and `content_accuracy`. The row generator's state is saved with every
checkpoint (item "copy"), so a resumed run trains on the rows the uninterrupted one would.

Notation: b rows, t positions.
"""

from __future__ import annotations

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from glm5_jax import config as config_lib
from glm5_jax import convert
from glm5_jax import nn as gnn
from glm5_jax import sharding as shd
from glm5_jax.data import copy_task
from glm5_jax.train import lm_data
from glm5_jax.train import metrics as metrics_lib
from glm5_jax.train import step as step_lib

# Training and evaluation rows: kind -> (seg_len, gap_len).
KINDS = {"position": (32, 0), "content": ((8, 48), (0, 16))}


def model_config(c):
  """The ModelConfig the copy run trains (the pretraining stage's attention) and a name for
  tables: `config.init_from`'s model, or `config.model` (its changes from the preset named)."""
  preset = config_lib.get_preset(c.model.preset)
  cfg = config_lib.from_config_dict(c.model)
  changed = [f"{k}={getattr(cfg, k)}" for k in sorted(c.model) if k != "preset"
             and getattr(cfg, k) != getattr(preset, k)]
  if c.init_from:
    if changed:
      raise ValueError(f"config.model changes {changed}: not with config.init_from, whose "
                       f"model is the checkpoint's")
    cfg, name = convert.model_config_of(c.init_from, "config.init_from"), c.init_from
  else:
    name = c.model.preset + (f" ({','.join(changed)})" if changed else "")
  return step_lib.stage_model_config(cfg, "pretrain"), name


def batch_of(tokens_bt) -> dict:
  """A training batch of whole rows: one document per row, positions 0 .. t-1."""
  b, t = tokens_bt.shape
  return {"tokens": tokens_bt, "segment_ids": np.ones((b, t), np.int32),
          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))}


class CopySource:
  """Copy rows for `train.loop.run` (module docstring; `train.loop.Source`)."""

  name = "copy"
  eval_prefix, eval_key, eval_at_start = "", "position_accuracy", True
  blocking = False
  solo = False
  log_fields = metrics_lib.LM_LOG

  def __init__(self, c):
    if c.copy.train not in KINDS:
      raise ValueError(f"config.copy.train={c.copy.train!r}: expected one of {list(KINDS)}")
    if c.stage != "pretrain":
      raise ValueError(f"config.stage={c.stage!r}: the copy task trains stage 'pretrain'")
    self.c = c
    self.checkpoint_every, self.eval_every = c.checkpoint_every, c.copy.eval_every
    self.items = {"copy": ocp.JsonCheckpointHandler()}
    self.tokens_per_step, self.seq_len = c.batch_size * c.seq_len, c.seq_len
    self.rng = np.random.default_rng((c.seed, 0))
    self.cfg, self.model_name = model_config(c)

  def model_config(self):
    return self.cfg

  def setup(self, cfg, mesh, param_sh) -> None:
    """The held-out rows of both kinds and the greedy next-token predictions."""
    del param_sh
    c = self.c
    lm_data.check_batch(c, jax.process_count(), mesh)
    self.vocab = (32, min(127, cfg.vocab_size))
    self.held_out = {k: copy_task.make_rows(np.random.default_rng((c.seed, 1, i)),
                                            c.copy.eval_rows, c.seq_len, seg_len=s,
                                            gap_len=g, vocab=self.vocab)
                     for i, (k, (s, g)) in enumerate(KINDS.items())}
    self.batch_sh = shd.or_one_device(mesh, shd.batch_sharding(mesh))
    model = gnn.GLM5(cfg)
    self._argmax = jax.jit(
        lambda p, t: model.apply({"params": p}, t, mtp=False).logits.argmax(-1))

  def save_items(self) -> dict:
    return {"copy": ocp.args.JsonSave({"rng": self.rng.bit_generator.state})}

  def restore_items(self) -> dict:
    return {"copy": ocp.args.JsonRestore()}

  def load(self, restored: dict) -> None:
    self.rng.bit_generator.state = restored["copy"]["rng"]

  def start(self, state, resumed: bool) -> None:
    del state, resumed

  def prepare(self, state) -> list:
    del state
    return []

  def batches(self, state, step: int):
    del state, step
    seg, gap = KINDS[self.c.copy.train]
    x, _ = copy_task.make_rows(self.rng, self.c.batch_size, self.c.seq_len, seg_len=seg,
                               gap_len=gap, vocab=self.vocab)
    return [lm_data.to_global(batch_of(x), self.batch_sh)], {}

  def after(self, state, step: int, reset_optimizer):
    del step, reset_optimizer
    return state, {}

  def evaluate(self, state, step: int) -> dict:
    acc = {f"{k}_accuracy": copy_task.copy_accuracy(
        self._argmax(state.params, jnp.asarray(x)), x, m) for k, (x, m) in self.held_out.items()}
    logging.info("[copy] step %d  copy accuracy: position %.3f  content %.3f", step,
                 acc["position_accuracy"], acc["content_accuracy"])
    return acc

  def close(self) -> None:
    pass


def curves(workdir: str, c, model_name: str) -> dict:
  """The run's copy-accuracy curves from its metrics.jsonl: per evaluated step the held-out
  accuracy of both kinds and the training CE of that step (None at step 0)."""
  rows: dict = {}
  for r in metrics_lib.read_rows(workdir):             # a resumed run rewrites its steps
    rows.setdefault(r["step"], {}).update(r)
  steps = sorted(s for s, r in rows.items() if "position_accuracy" in r)
  return {"model": model_name, "train": c.copy.train,
          "kinds": {k: list(map(str, v)) for k, v in KINDS.items()},
          "batch": c.batch_size, "seq_len": c.seq_len, "optimizer": c.optimizer,
          "learning_rate": c.learning_rate, "steps": steps,
          "loss": [rows[s].get("ce") for s in steps],
          **{f"{k}_accuracy": [rows[s][f"{k}_accuracy"] for s in steps] for k in KINDS}}
