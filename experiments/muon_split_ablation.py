r"""Muon Split ablation (GLM-5, arXiv 2602.15763): AdamW vs whole-matrix Muon vs Muon Split.

  python -m experiments.muon_split_ablation --config=configs/muon_split_ablation.py

Every variant trains the tiny GLM-5 model from the same initialization (per seed) on the same
batches (per seed) of byte-level Python standard-library source (vocab 256: the config pins it),
and is evaluated on the same held-out windows from held-out files. Writes
`{out_prefix}.json` (all curves), `{out_prefix}.png` (held-out loss, mean and range over seeds)
and the results table into `{out_prefix}.md` (between the results markers; text outside them is
kept).

The training loop is deliberately minimal (no MTP loss, no routing-bias update, no clipping):
jit(forward -> next-token cross entropy on `out.logits` -> grad -> tx.update). Only the
optimizer differs between variants.
"""

import json
import math
import os
import sysconfig
import time
import zlib

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax

from glm5_jax import config as config_lib
from glm5_jax import losses
from glm5_jax import nn
from glm5_jax import optim

_CONFIG = config_flags.DEFINE_config_file("config", "configs/muon_split_ablation.py")
_MARK = ("<!-- results:start -->", "<!-- results:end -->")


# ------------------------------------------------------------------------------ data


def stdlib_bytes(heldout_every: int, max_files: int, eos: int):
  """(train uint8 [n], held-out uint8 [m]): the stdlib's .py files, `eos` between files.

  Files are sorted by relative path; every `heldout_every`-th file (by a CRC of its path) is
  held out, so no held-out byte comes from a file seen in training.
  """
  root = sysconfig.get_paths()["stdlib"]
  paths = sorted(os.path.relpath(os.path.join(d, f), root)
                 for d, _, files in os.walk(root) for f in files if f.endswith(".py")
                 and "site-packages" not in d)[:max_files]
  if not paths:
    raise ValueError(f"data.source='stdlib': no .py files found under {root}")
  train, held = [], []
  for rel in paths:
    with open(os.path.join(root, rel), "rb") as f:
      data = f.read()
    (held if zlib.crc32(rel.encode()) % heldout_every == 0 else train).append(data)
  join = lambda docs: np.frombuffer(bytes([eos]).join(docs), np.uint8)
  return join(train), join(held)


def windows(stream, starts, seq_len):
  """int32 [n, seq_len] windows of `stream` at `starts`."""
  return np.stack([stream[s:s + seq_len] for s in starts]).astype(np.int32)


# ------------------------------------------------------------------------------ optimizers


def make_tx(variant, schedule):
  v = dict(variant)
  kind = v.pop("kind")
  lr = v.pop("learning_rate")
  sched = lambda step: lr * schedule(step)
  if kind == "adamw":  # decay on matrices only, like the AdamW group of muon_split
    wd = v.pop("weight_decay")
    return optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=wd,
                       mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p), **v)
  if kind == "muon_split":
    return optim.muon_split(learning_rate=sched, **v)
  raise ValueError(f"variants.*.kind={kind!r}: expected 'adamw' or 'muon_split'")


# ------------------------------------------------------------------------------ training


def train_variant(cfg, model_cfg, tx, train, held_tokens):
  """Trains one optimizer over all seeds; returns per-seed curves and step time."""
  model = nn.GLM5(model_cfg)

  def loss_fn(params, tokens):
    out = model.apply({"params": params}, tokens, mtp=False)
    targets, mask = losses.next_token_targets(tokens)
    return losses.cross_entropy(out.logits, targets, mask)[0]

  @jax.jit
  def step(params, state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, state = tx.update(grads, state, params)
    metrics = optim.update_metrics(updates, params)
    return optax.apply_updates(params, updates), state, loss, metrics

  eval_loss = jax.jit(lambda p, tok: jax.lax.map(lambda t: loss_fn(p, t), tok).mean())
  runs = []
  for seed in cfg.seeds:
    params = nn.init_params(model_cfg, jax.random.key(seed))
    state = tx.init(params)
    rng = np.random.default_rng(seed)  # the same batches for every variant
    starts = rng.integers(0, len(train) - cfg.seq_len, (cfg.steps, cfg.batch_size))
    curve, train_curve, t_steps = [], [], []
    for i in range(cfg.steps + 1):
      if i % cfg.eval_every == 0 or i == cfg.steps:
        curve.append((i, float(eval_loss(params, held_tokens))))
      if i == cfg.steps:
        break
      t0 = time.perf_counter()
      params, state, loss, metrics = step(params, state, windows(train, starts[i], cfg.seq_len))
      loss = float(loss)
      if i > 0:
        t_steps.append(time.perf_counter() - t0)
      train_curve.append((i, loss))
      if not math.isfinite(loss):
        logging.warning("seed %d: non-finite loss at step %d", seed, i)
        break
    logging.info("seed %d: held-out %.4f", seed, curve[-1][1])
    runs.append(dict(seed=seed, heldout=curve, train=train_curve,
                     final_metrics={k: float(v) for k, v in metrics.items()},
                     step_s=float(np.median(t_steps)) if t_steps else None))
  return runs


# ------------------------------------------------------------------------------ report


def summarize(results):
  rows = []
  for name, runs in results.items():
    final = np.array([r["heldout"][-1][1] for r in runs])
    best = np.array([min(l for _, l in r["heldout"]) for r in runs])
    m = runs[0]["final_metrics"]
    rms = {g: np.mean([r["final_metrics"].get(f"update_rms/{g}", np.nan) for r in runs])
           for g in optim.GROUPS}
    rows.append(dict(variant=name, final_mean=final.mean(), final_std=final.std(ddof=1)
                     if len(final) > 1 else 0.0, final_per_seed=final.tolist(),
                     best_mean=best.mean(), bpb=final.mean() / math.log(2),
                     step_ms=1e3 * np.mean([r["step_s"] for r in runs if r["step_s"]]),
                     update_rms=rms, n_seeds=len(runs), keys=sorted(m)))
  return rows


def table(rows):
  lines = ["| optimizer | held-out loss (nats/byte), mean ± std | per seed | bits/byte | "
           "best held-out | step (ms) | final update RMS muon_split / muon / adamw |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    per = ", ".join(f"{x:.4f}" for x in r["final_per_seed"])
    rms = " / ".join(f"{r['update_rms'][g]:.2e}" for g in optim.GROUPS)
    lines.append(f"| {r['variant']} | {r['final_mean']:.4f} ± {r['final_std']:.4f} | {per} | "
                 f"{r['bpb']:.3f} | {r['best_mean']:.4f} | {r['step_ms']:.0f} | {rms} |")
  return "\n".join(lines)


def plot(results, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for name, runs in results.items():
    steps = [s for s, _ in runs[0]["heldout"]]
    n = min(len(r["heldout"]) for r in runs)
    ys = np.array([[l for _, l in r["heldout"][:n]] for r in runs])
    line, = ax.plot(steps[:n], ys.mean(0), label=f"{name} ({len(runs)} seeds)")
    ax.fill_between(steps[:n], ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
  ax.set_xlabel("step")
  ax.set_ylabel("held-out loss (nats / byte)")
  ax.set_title("tiny GLM-5 on stdlib bytes: held-out loss (mean, min-max over seeds)",
               fontsize=10)
  lo = min(min(l for _, l in r["heldout"]) for runs in results.values() for r in runs)
  ax.set_ylim(lo - 0.05, lo + 1.5)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def write_markdown(path, text):
  block = f"{_MARK[0]}\n{text}\n{_MARK[1]}"
  old = (open(path).read() if os.path.exists(path)
         else f"# Muon Split ablation\n\n{_MARK[0]}\n{_MARK[1]}\n")
  if _MARK[0] not in old:
    old += f"\n{_MARK[0]}\n{_MARK[1]}\n"
  head, rest = old.split(_MARK[0], 1)
  tail = rest.split(_MARK[1], 1)[1]
  with open(path, "w") as f:
    f.write(head + block + tail)


def main(argv):
  del argv
  cfg = _CONFIG.value
  model_cfg = config_lib.from_config_dict(cfg.model)
  if cfg.data.source != "stdlib":
    raise ValueError(f"data.source={cfg.data.source!r}: expected 'stdlib'")
  if model_cfg.vocab_size < 256:
    raise ValueError(f"model.vocab_size={model_cfg.vocab_size}: byte tokens need >= 256")
  train, held = stdlib_bytes(cfg.data.heldout_every, cfg.data.max_files,
                             eos=model_cfg.eos_token_id)
  n_held = cfg.eval_batches * cfg.batch_size
  held_starts = np.linspace(0, len(held) - cfg.seq_len - 1, n_held).astype(np.int64)
  held_tokens = windows(held, held_starts, cfg.seq_len).reshape(
      cfg.eval_batches, cfg.batch_size, cfg.seq_len)
  logging.info("train %d bytes, held-out %d bytes", len(train), len(held))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, 1.0, cfg.warmup_steps, cfg.steps, end_value=cfg.final_lr_fraction)
  results, t0 = {}, time.time()
  for name, variant in cfg.variants.items():
    results[name] = train_variant(cfg, model_cfg, make_tx(variant.to_dict(), schedule), train,
                                  jnp.asarray(held_tokens))
    logging.info("%s done at %.0f s", name, time.time() - t0)
  rows = summarize(results)
  settings = (f"model preset `{cfg.model.preset}` ({cfg.model.to_dict()}), {cfg.steps} steps x "
              f"{cfg.batch_size} x {cfg.seq_len} bytes, warm-up {cfg.warmup_steps} then cosine "
              f"to {cfg.final_lr_fraction} of peak, seeds {tuple(cfg.seeds)}, held-out "
              f"{n_held} windows; {len(train)} train / {len(held)} held-out bytes; wall time "
              f"{time.time() - t0:.0f} s on {jax.device_count()} {jax.default_backend()} "
              f"device(s).")
  md = "\n\n".join([table(rows), settings, "Variants: " + json.dumps(cfg.variants.to_dict()),
                    f"![held-out loss]({os.path.basename(cfg.out_prefix)}.png)"])
  print(md)
  os.makedirs(os.path.dirname(cfg.out_prefix) or ".", exist_ok=True)
  with open(cfg.out_prefix + ".json", "w") as f:
    json.dump(dict(config=cfg.to_dict(), summary=rows, runs=results), f, indent=1,
              default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
  plot(results, cfg.out_prefix + ".png")
  write_markdown(cfg.out_prefix + ".md", md)


if __name__ == "__main__":
  app.run(main)
