"""The batch source of the language-model stages: pretraining, mid-training, DSA and SFT.

Rows of packed documents (`data/corpus.py`, grain) or of packed chat conversations with their
loss masks (`data/sft.py`); each process reads its slice of the global batch. The grain
iterator is saved with every checkpoint (item "data"), so a resumed run reads exactly the
rows the uninterrupted one would. Evaluation: held-out loss over `eval_batches` fixed
validation batches, and bits per byte where the corpus counts bytes.
"""

from __future__ import annotations

import functools
import math
import os

from absl import logging
import grain
import jax
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import sharding as shd
from glm5_jax.data import corpus
from glm5_jax.data import pipeline
from glm5_jax.data import sft
from glm5_jax.train import metrics as metrics_lib
from glm5_jax.train import step as step_lib

_DATA = {"corpus": corpus, "conversations": sft}     # a stage's data -> its module


def _data_module(c):
  return _DATA[step_lib.get_stage(c.stage).data]


def ensure_data(c) -> dict:
  """Prepares the stage's data on first use (process 0), then reads its metadata.

  Pretraining stages read the tokenized corpus (`corpus.prepare` of `data.source_dir`);
  `sft` reads conversations (`sft.prepare` of `data.sources`, JSONL).
  """
  d, mod = c.data, _data_module(c)
  if not os.path.exists(os.path.join(d.dir, corpus.META)):
    if not d.prepare_if_missing:
      mod.load_meta(d.dir)                             # raises the "prepare" error
    if not 0 < d.val_fraction < 1:
      raise ValueError(f"config.data.val_fraction={d.val_fraction}: expected in (0, 1) to "
                       f"prepare {d.dir} (the held-out evaluation needs a validation split)")
    if mod is corpus:
      corpus.check_split_fields(val_fraction=d.val_fraction, num_shards=d.num_shards,
                                max_files=d.max_files, prefix="config.data.")
    if jax.process_index() == 0:
      logging.info("preparing %s -> %s", d.get("sources") or d.source_dir or "<stdlib>", d.dir)
      if mod is sft:
        sft.prepare(d.sources, d.dir, tokenizer=d.tokenizer, val_fraction=d.val_fraction)
      else:
        corpus.prepare(d.source_dir or corpus.default_source_dir(), d.dir,
                       tokenizer=d.tokenizer, pattern=d.pattern, val_fraction=d.val_fraction,
                       num_shards=d.num_shards, max_files=d.max_files)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("glm5_prepare_data")
  if mod is sft:
    meta = sft.ensure(d.dir, d.sources, tokenizer=d.tokenizer, val_fraction=d.val_fraction)
  else:
    meta = corpus.ensure(d.dir, source_dir=d.source_dir, tokenizer=d.tokenizer,
                         pattern=d.pattern, val_fraction=d.val_fraction,
                         num_shards=d.num_shards, max_files=d.max_files)
  val = meta.get("splits", {}).get("validation", {})
  if "tokens" in val and val["tokens"] < c.seq_len + 1:
    raise ValueError(f"config.data.dir={d.dir!r}: its validation split holds {val['tokens']} "
                     f"tokens, fewer than one row of config.seq_len={c.seq_len}; prepare it "
                     "again with a larger config.data.val_fraction")
  return meta


def make_dataset(c, split: str, *, seed: int, shuffle: bool = True):
  """The stage's grain rows for this process: packed documents, or packed conversations."""
  n_proc, p_idx = jax.process_count(), jax.process_index()
  kw = dict(seq_len=c.seq_len, batch_per_process=c.batch_size // n_proc, seed=seed,
            process_index=p_idx, process_count=n_proc, shuffle=shuffle, repeat=True)
  if _data_module(c) is sft:
    return sft.packed_dataset(c.data.dir, split, **kw)
  return pipeline.packed_dataset(c.data.dir, split, shard=c.data.shard, **kw)


def check_batch(c, n_proc: int, mesh) -> None:
  """The global batch of `c.batch_size` rows of `c.seq_len` against the processes and the
  mesh (errors name the field)."""
  if c.batch_size % n_proc:
    raise ValueError(f"config.batch_size={c.batch_size} is not divisible by the "
                     f"{n_proc} processes")
  if c.batch_size % shd.batch_axis_size(mesh):
    raise ValueError(f"config.batch_size={c.batch_size} is not divisible by the mesh's batch "
                     f"axes data*fsdp*expert={shd.batch_axis_size(mesh)}")
  n_ctx = mesh.shape["context"]
  if n_ctx > 1 and c.seq_len % (2 * n_ctx):
    raise ValueError(f"config.seq_len={c.seq_len} is not divisible by 2 * config.mesh.context="
                     f"{2 * n_ctx} (context parallelism cuts each row into 2 * context chunks)")
  m = c.microbatches
  if (not isinstance(m, int) or m < 1 or (c.batch_size // n_proc) % m
      or (c.batch_size // m) % shd.batch_axis_size(mesh)):
    raise ValueError(f"config.microbatches={m!r}: expected an integer >= 1 dividing the batch "
                     f"per process ({c.batch_size // n_proc}), with batch_size / microbatches "
                     f"divisible by the mesh's batch axes ({shd.batch_axis_size(mesh)})")


def to_global(batch, sharding):
  """This process's rows of a batch -> global arrays in `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


class LMSource:
  """Rows of a corpus or of conversations (module docstring): the runner's batch source for
  every stage whose row has `loss="lm"`."""

  eval_prefix, eval_key, eval_at_start = "eval_", "loss", False
  blocking = False                       # the loop need not wait for each step's result
  solo = False                           # every process of the run trains
  log_fields = metrics_lib.LM_LOG

  def __init__(self, c):
    self.c = c
    self.name = c.stage
    self.checkpoint_every, self.eval_every = c.checkpoint_every, c.eval_every
    self.items = {"data": grain.checkpoint.CheckpointHandler()}

  def model_config(self):
    return config_lib.from_config_dict(self.c.model)

  def setup(self, cfg, mesh, param_sh) -> None:
    """Checks the batch against the mesh, prepares the data, opens the training rows."""
    del param_sh
    c = self.c
    if c.seq_len > cfg.max_position_embeddings:
      raise ValueError(f"config.seq_len={c.seq_len} > model max_position_embeddings="
                       f"{cfg.max_position_embeddings}")
    check_batch(c, jax.process_count(), mesh)
    self.meta = ensure_data(c)
    if self.meta["vocab_size"] > cfg.vocab_size:
      raise ValueError(f"data tokenizer vocab {self.meta['vocab_size']} > model vocab_size "
                       f"{cfg.vocab_size}")
    self.cfg, self.mesh = cfg, mesh
    self.batch_sh = shd.or_one_device(mesh, shd.batch_sharding(mesh))
    self.data_iter = iter(make_dataset(c, "train", seed=c.seed))
    self.tokens_per_step, self.seq_len = c.batch_size * c.seq_len, c.seq_len
    self.stats = {}
    if _data_module(c) is sft:        # conversations longer than seq_len never enter a row
      n = sft.dropped(c.data.dir, "train", c.seq_len)
      self.stats = {"sft_dropped_conversations": n}
      if n:
        logging.warning("sft: %d training conversations are longer than seq_len=%d and are "
                        "dropped", n, c.seq_len)
    self._eval_fn = None

  def save_items(self) -> dict:
    return {"data": grain.checkpoint.CheckpointSave(self.data_iter)}

  def restore_items(self) -> dict:
    return {"data": grain.checkpoint.CheckpointRestore(self.data_iter)}

  def load(self, restored: dict) -> None:
    del restored                      # the grain iterator is restored in place

  def start(self, state, resumed: bool) -> None:
    del state, resumed

  def prepare(self, state) -> list:
    del state
    return []

  def batches(self, state, step: int):
    del state, step
    return [to_global(next(self.data_iter), self.batch_sh)], {}

  def after(self, state, step: int, reset_optimizer):
    del step, reset_optimizer
    return state, dict(self.stats)

  def evaluate(self, state, step: int) -> dict:
    """Held-out loss (nats per target token) over `eval_batches` fixed batches, and bits per
    byte where the corpus counts bytes (not for conversations)."""
    c = self.c
    if c.eval_batches < 1:
      raise ValueError(f"config.eval_batches={c.eval_batches}: expected >= 1")
    if self._eval_fn is None:
      self._eval_fn = jax.jit(functools.partial(step_lib.eval_step, cfg=self.cfg,
                                                stage=c.stage, loss_chunk=c.loss_chunk,
                                                qat=step_lib.qat_scheme(c)),
                              in_shardings=(jax.tree.map(lambda x: x.sharding, state.params),
                                            self.batch_sh))
    try:
      it = iter(make_dataset(c, "validation", seed=0, shuffle=False))
      nll, tok, kl = 0.0, 0.0, 0.0
      for _ in range(c.eval_batches):
        with jax.set_mesh(self.mesh):
          out = self._eval_fn(state.params, to_global(next(it), self.batch_sh))
        out = jax.device_get(out)
        nll, tok = nll + float(out["nll_sum"]), tok + float(out["tokens"])
        kl += float(out["indexer_kl"])
    except Exception as e:  # pylint: disable=broad-except
      raise RuntimeError(
          f"held-out evaluation at step {step} failed (config.data.dir={c.data.dir!r}, "
          f"validation split): {type(e).__name__}: {e}; the checkpoint of step {step} is "
          "saved") from e
    loss = nll / max(tok, 1.0)
    res = {"loss": loss, "indexer_kl": kl / c.eval_batches}
    v = self.meta["splits"]["validation"]
    if "bytes" in v:
      res["bits_per_byte"] = loss / math.log(2) / (v["bytes"] / max(v["tokens"], 1))
    logging.info("[%s] step %d eval loss %.4f  bits/byte %.4f  indexer_kl %.4g", c.stage,
                 step, res["loss"], res.get("bits_per_byte", math.nan), res["indexer_kl"])
    return res

  def close(self) -> None:
    pass
