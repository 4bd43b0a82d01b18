r"""Does a model learn in-context copying? Train it on synthetic copy rows, score both kinds.

  python -m experiments.train_copy --steps=600 --train=position --out=/tmp/copy_position
  python -m experiments.train_copy --steps=2000 --train=content --out=/tmp/copy_content
  python -m experiments.train_copy --override=hidden_size=128,kv_lora_rank=64 ...

Rows and the two scores: glm5_jax/data/copy_task.py. `--train=position` trains on blocks of a
fixed segment length and gap (a copy sits a fixed distance after its source), `content` on
lengths drawn per block. Every `--eval_every` steps the held-out copy accuracy of both kinds
is printed. The model, optimizer and update are the pretraining stage's (dense attention,
LM + MTP loss, `configs/pretrain.py`'s optimizer); --init_from starts from a workdir's
parameters. Writes copy_task.json and copy_task.png (accuracy against step) to --out.
"""

import functools
import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from configs import pretrain as pretrain_config
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.data import copy_task
from glm5_jax.train import checkpoint
from glm5_jax.train import step as step_lib

# Training and evaluation rows: name -> (seg_len, gap_len).
KINDS = {"position": (32, 0), "content": ((8, 48), (0, 16))}

_PRESET = flags.DEFINE_string("preset", "tiny", "model preset (config.get_preset)")
_OVERRIDE = flags.DEFINE_list("override", [], "ModelConfig fields, e.g. hidden_size=128")
_INIT_FROM = flags.DEFINE_string("init_from", "", "a workdir to start from ('' = random)")
_TRAIN = flags.DEFINE_enum("train", "content", list(KINDS), "kind of the training rows")
_STEPS = flags.DEFINE_integer("steps", 1000, "optimizer steps")
_BATCH = flags.DEFINE_integer("batch", 8, "rows per step")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "tokens per row")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "muon_split", list(step_lib.OPTIMIZERS),
                               "the pretraining optimizers")
_LR = flags.DEFINE_float("learning_rate", 1e-2, "peak learning rate (20 warm-up steps, cosine)")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "steps between evaluations")
_EVAL_ROWS = flags.DEFINE_integer("eval_rows", 32, "held-out rows per kind")
_SEED = flags.DEFINE_integer("seed", 0, "training rows and initialisation")
_OUT = flags.DEFINE_string("out", "/tmp/copy_task", "output directory")


def _model_config():
  if _INIT_FROM.value:
    cfg, params = checkpoint.load_model(_INIT_FROM.value)
    if _OVERRIDE.value:
      raise ValueError("--override changes the model: not with --init_from")
  else:
    fields = dict(kv.split("=", 1) for kv in _OVERRIDE.value)
    base = config_lib.get_preset(_PRESET.value)
    types = {k: type(getattr(base, k)) for k in fields if hasattr(base, k)}
    unknown = sorted(set(fields) - set(types))
    if unknown:
      raise ValueError(f"--override {unknown}: not ModelConfig fields")
    def parse(k, v):
      if types[k] is bool:
        if v.lower() not in ("true", "false"):
          raise ValueError(f"--override {k}={v}: expected true or false")
        return v.lower() == "true"
      try:
        return types[k](v)
      except ValueError:
        raise ValueError(f"--override {k}={v}: expected {types[k].__name__}") from None
    cfg = config_lib.get_preset(_PRESET.value, **{k: parse(k, v) for k, v in fields.items()})
    params = gnn.init_params(cfg, _SEED.value)
  return step_lib.stage_model_config(cfg, "pretrain"), params


def _batch(tokens_bt):
  b, t = tokens_bt.shape
  return {"tokens": jnp.asarray(tokens_bt), "segment_ids": jnp.ones((b, t), jnp.int32),
          "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))}


def _plot(result, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for kind in KINDS:
    ax.plot(result["steps"], result[f"{kind}_accuracy"], marker="o", label=f"{kind} copy")
  ax.set_xlabel("step")
  ax.set_ylabel("held-out copy accuracy")
  ax.set_ylim(0, 1)
  ax.set_title(f"{result['model']}, trained on {result['train']} rows")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv):
  del argv
  checkpoint.quiet_orbax()
  cfg, params = _model_config()
  c = pretrain_config.get_config("model=tiny,runlocal=True")
  c.optimizer, c.learning_rate = _OPTIMIZER.value, _LR.value
  c.total_steps, c.warmup_steps = _STEPS.value, 20
  tx = step_lib.make_optimizer(c)
  state = step_lib.TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                              jax.random.PRNGKey(_SEED.value))
  update = jax.jit(functools.partial(step_lib.train_step, cfg=cfg, stage="pretrain", tx=tx,
                                     loss_chunk=_SEQ_LEN.value, bias_rate=c.bias_update_rate))
  model = gnn.GLM5(cfg)
  argmax = jax.jit(lambda p, t: model.apply({"params": p}, t, mtp=False).logits.argmax(-1))
  vocab = (32, min(127, cfg.vocab_size))
  held_out = {k: copy_task.make_rows(np.random.default_rng((_SEED.value, 1, i)),
                                     _EVAL_ROWS.value, _SEQ_LEN.value, seg_len=s, gap_len=g,
                                     vocab=vocab)
              for i, (k, (s, g)) in enumerate(KINDS.items())}
  rng = np.random.default_rng((_SEED.value, 0))
  seg, gap = KINDS[_TRAIN.value]
  name = (_INIT_FROM.value or _PRESET.value) + (f" ({','.join(_OVERRIDE.value)})"
                                                if _OVERRIDE.value else "")
  result = {"model": name, "train": _TRAIN.value, "kinds": {k: list(map(str, v))
                                                           for k, v in KINDS.items()},
            "batch": _BATCH.value, "seq_len": _SEQ_LEN.value, "optimizer": _OPTIMIZER.value,
            "learning_rate": _LR.value, "steps": [], "loss": [],
            **{f"{k}_accuracy": [] for k in KINDS}}
  t0, loss = time.perf_counter(), None          # no loss before the first step
  for i in range(_STEPS.value + 1):
    if i % _EVAL_EVERY.value == 0 or i == _STEPS.value:
      acc = {k: copy_task.copy_accuracy(argmax(state.params, jnp.asarray(x)), x, m)
             for k, (x, m) in held_out.items()}
      result["steps"].append(i)
      result["loss"].append(loss)
      for k, a in acc.items():
        result[f"{k}_accuracy"].append(a)
      el = time.perf_counter() - t0
      eta = el / max(i, 1) * (_STEPS.value - i)
      shown = "  -  " if loss is None else f"{loss:.3f}"
      print(f"step {i:5d}  loss {shown}  copy accuracy: position {acc['position']:.3f}  "
            f"content {acc['content']:.3f}  ({el:.0f}s, ETA {eta:.0f}s)", flush=True)
    if i == _STEPS.value:
      break
    x, _ = copy_task.make_rows(rng, _BATCH.value, _SEQ_LEN.value, seg_len=seg, gap_len=gap,
                               vocab=vocab)
    state, metrics = update(state, _batch(x))
    loss = float(metrics["ce"])
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "copy_task.json"), "w") as f:
    json.dump(result, f, indent=2)
  _plot(result, os.path.join(_OUT.value, "copy_task.png"))
  print(f"wrote {_OUT.value}/copy_task.json and copy_task.png")


if __name__ == "__main__":
  app.run(main)
