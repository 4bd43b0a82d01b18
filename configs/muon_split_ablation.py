"""Muon Split ablation: `--config=configs/muon_split_ablation.py` (`:quick=True` for a smoke run).

The tiny GLM-5 model (dense MLA attention, as in pretraining before DSA) on byte-level Python
standard-library source, trained with AdamW, whole-matrix Muon and Muon Split from the same
initializations on the same batches, several seeds each. Any field is overridable, e.g.
`--config.steps=600 --config.variants.muon_split.learning_rate=3e-3`.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  a = common.parse_arg(arg, quick=False)
  c = ml_collections.ConfigDict()
  # The tiny preset as it was when docs/muon_split_ablation.md was measured: bytes only (vocab
  # 256, byte 1 between files), without the GLM special-token ids the preset has since gained.
  c.model = ml_collections.ConfigDict(dict(preset="tiny", attention_type="dense", vocab_size=256,
                                           bos_token_id=0, eos_token_id=1))
  c.seeds = (0, 1, 2)
  c.steps = 240
  c.batch_size = 8
  c.seq_len = 128
  c.warmup_steps = 20
  c.final_lr_fraction = 0.1         # cosine decay to this fraction of the peak
  c.eval_every = 20
  c.eval_batches = 8                # held-out windows = eval_batches * batch_size
  c.data = ml_collections.ConfigDict(dict(
      source="stdlib",              # byte-level .py files of this Python's standard library
      heldout_every=20,             # every 20th file (sorted by path) is held out
      max_files=2000))
  # One entry per optimizer: `kind` is "adamw" or "muon_split" (glm5_jax.optim options).
  # Peak learning rates: the best of {1e-3, 3e-3, 1e-2, 3e-2, 1e-1} for each optimizer in a
  # one-seed 120-step sweep (docs/muon_split_ablation.md); both Muon variants peak at 3e-2.
  c.variants = ml_collections.ConfigDict({
      "adamw": dict(kind="adamw", learning_rate=1e-2, weight_decay=0.1),
      "muon": dict(kind="muon_split", split_heads=False, rms_shape="full",
                   learning_rate=3e-2, weight_decay=0.1),
      "muon_split": dict(kind="muon_split", split_heads=True, rms_shape="per_head",
                         learning_rate=3e-2, weight_decay=0.1),
  })
  c.out_prefix = "docs/muon_split_ablation"   # writes .json, .png and the table into .md
  if a.quick:
    c.seeds, c.steps, c.warmup_steps, c.eval_every, c.eval_batches = (0,), 20, 5, 10, 2
    c.out_prefix = "/tmp/muon_split_ablation_quick"
  return c
