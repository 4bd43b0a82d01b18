r"""Does a model learn in-context copying? Train it on synthetic copy rows, score both kinds.

  python -m experiments.train_copy --config.copy.train=position --config.total_steps=600 \
      --out=/tmp/copy_position
  python -m experiments.train_copy --config.total_steps=2000 --out=/tmp/copy_content
  python -m experiments.train_copy --config.model.hidden_size=128 --config.model.kv_lora_rank=64 ...

Rows and the two scores: glm5_jax/data/copy_task.py. `copy.train=position` trains on blocks of
a fixed segment length and gap (a copy sits a fixed distance after its source), `content` on
lengths drawn per block. Every `copy.eval_every` steps the held-out copy accuracy of both kinds
is printed. The model, loss, optimizer and update are the pretraining stage's (dense
attention, LM + MTP loss; `configs/copy_task.py` is `configs/pretrain.py` with the task's
batch, length and schedule, every field overridable); `--config.init_from` starts from a
workdir's parameters. Writes copy_task.json and copy_task.png (accuracy against step) to --out.
"""

import functools
import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import convert
from glm5_jax import nn as gnn
from glm5_jax.data import copy_task
from glm5_jax.train import checkpoint
from glm5_jax.train import step as step_lib

# Training and evaluation rows: name -> (seg_len, gap_len).
KINDS = {"position": (32, 0), "content": ((8, 48), (0, 16))}

_CONFIG = config_flags.DEFINE_config_file("config", "configs/copy_task.py", lock_config=True)
_OUT = flags.DEFINE_string("out", "/tmp/copy_task", "output directory")


def _model(c):
  """(ModelConfig of the pretraining stage, params, a name for tables)."""
  preset = config_lib.get_preset(c.model.preset)
  cfg = config_lib.from_config_dict(c.model)
  changed = [f"{k}={getattr(cfg, k)}" for k in sorted(c.model) if k != "preset"
             and getattr(cfg, k) != getattr(preset, k)]
  if c.init_from:
    if changed:
      raise ValueError(f"config.model changes {changed}: not with config.init_from, whose "
                       f"model is the checkpoint's")
    cfg, params = convert.load_model(c.init_from)
    name = c.init_from
  else:
    params = gnn.init_params(cfg, c.seed)
    name = c.model.preset + (f" ({','.join(changed)})" if changed else "")
  return step_lib.stage_model_config(cfg, "pretrain"), params, name


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
  c = _CONFIG.value
  if c.copy.train not in KINDS:
    raise ValueError(f"config.copy.train={c.copy.train!r}: expected one of {list(KINDS)}")
  cfg, params, name = _model(c)
  steps, every = c.total_steps, c.copy.eval_every
  tx = step_lib.make_optimizer(c)
  state = step_lib.TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                              jax.random.PRNGKey(c.seed))
  update = jax.jit(functools.partial(step_lib.train_step, cfg=cfg, stage="pretrain", tx=tx,
                                     loss_chunk=c.loss_chunk, bias_rate=c.bias_update_rate))
  model = gnn.GLM5(cfg)
  argmax = jax.jit(lambda p, t: model.apply({"params": p}, t, mtp=False).logits.argmax(-1))
  vocab = (32, min(127, cfg.vocab_size))
  held_out = {k: copy_task.make_rows(np.random.default_rng((c.seed, 1, i)), c.copy.eval_rows,
                                     c.seq_len, seg_len=s, gap_len=g, vocab=vocab)
              for i, (k, (s, g)) in enumerate(KINDS.items())}
  rng = np.random.default_rng((c.seed, 0))
  seg, gap = KINDS[c.copy.train]
  result = {"model": name, "train": c.copy.train, "kinds": {k: list(map(str, v))
                                                           for k, v in KINDS.items()},
            "batch": c.batch_size, "seq_len": c.seq_len, "optimizer": c.optimizer,
            "learning_rate": c.learning_rate, "steps": [], "loss": [],
            **{f"{k}_accuracy": [] for k in KINDS}}
  t0, loss = time.perf_counter(), None          # no loss before the first step
  for i in range(steps + 1):
    if i % every == 0 or i == steps:
      acc = {k: copy_task.copy_accuracy(argmax(state.params, jnp.asarray(x)), x, m)
             for k, (x, m) in held_out.items()}
      result["steps"].append(i)
      result["loss"].append(loss)
      for k, a in acc.items():
        result[f"{k}_accuracy"].append(a)
      el = time.perf_counter() - t0
      eta = el / max(i, 1) * (steps - i)
      shown = "  -  " if loss is None else f"{loss:.3f}"
      print(f"step {i:5d}  loss {shown}  copy accuracy: position {acc['position']:.3f}  "
            f"content {acc['content']:.3f}  ({el:.0f}s, ETA {eta:.0f}s)", flush=True)
    if i == steps:
      break
    x, _ = copy_task.make_rows(rng, c.batch_size, c.seq_len, seg_len=seg, gap_len=gap,
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
