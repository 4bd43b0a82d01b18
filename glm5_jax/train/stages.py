"""The paper's stage sequence, small: pretrain -> DSA dense warm-up -> DSA sparse adaptation.

Each stage is a `loop.run` in its own sub-workdir that starts from the
previous stage's parameters (`init_from`). A dense continuation of the
pretrained model for as many steps as the sparse adaptation is the baseline of
our small-scale "DSA ~ MLA" comparison (GLM-5 paper §2, DSA table).
"""

from __future__ import annotations

import json
import math
import os
import time

from absl import logging

from glm5_jax.data import corpus
from glm5_jax.train import loop


def _stage_config(base, stage: str, steps: int, init_from: str, lr: float, warmup: int):
  c = base.copy_and_resolve_references()
  with c.unlocked():
    c.stage = stage
    c.total_steps = steps
    c.init_from = init_from
    c.learning_rate = lr
    c.warmup_steps = warmup
    c.eval_every = min(c.eval_every, steps)
    c.checkpoint_every = steps
  return c


def _read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def run_all(c, workdir: str) -> dict:
  """Runs the four runs in `workdir/{pretrain,dense_baseline,dsa_warmup,dsa_sparse}`."""
  s = c.stages
  plan = [
      ("pretrain", "pretrain", s.pretrain_steps, "", c.learning_rate, c.warmup_steps),
      ("dense_baseline", "pretrain", s.sparse_steps, "pretrain", s.adapt_learning_rate, 0),
      ("dsa_warmup", "dsa_warmup", s.warmup_steps, "pretrain", s.warmup_learning_rate, 5),
      ("dsa_sparse", "dsa_sparse", s.sparse_steps, "dsa_warmup", s.adapt_learning_rate, 0),
  ]
  results, timings = {}, {}
  for name, stage, steps, parent, lr, warm in plan:
    sub = os.path.join(workdir, name)
    init = os.path.join(workdir, parent) if parent else ""
    t0 = time.perf_counter()
    logging.info("=== %s: %s for %d steps%s", name, stage, steps, f" from {parent}" if parent else "")
    results[name] = loop.run(_stage_config(c, stage, steps, init, lr, warm), sub)
    timings[name] = time.perf_counter() - t0
  meta = corpus.load_meta(c.data.dir)
  summary = _summarize(results, timings, meta)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(_table(summary))
  _plot({name: _read_metrics(os.path.join(workdir, name)) for name, *_ in plan},
        os.path.join(workdir, "loss_curves.png"))
  return summary


def _summarize(results, timings, meta):
  rows = {}
  for name, r in results.items():
    rows[name] = {"eval_loss": r.get("eval_loss"), "eval_bits_per_byte": r.get("eval_bits_per_byte"),
                  "eval_indexer_kl": r.get("eval_indexer_kl"), "train_indexer_kl": r.get("indexer_kl"),
                  "tokens_per_s": r.get("tokens_per_s"), "wall_s": timings[name]}
  dense, sparse = rows["dense_baseline"]["eval_loss"], rows["dsa_sparse"]["eval_loss"]
  return {"stages": rows, "unigram_entropy_bits_per_byte":
          meta["train_unigram_entropy_bits_per_token"] * meta["splits"]["train"]["tokens"]
          / max(meta["splits"]["train"]["bytes"], 1),
          "dsa_vs_dense_relative_loss_gap": (sparse - dense) / dense}


def _table(s) -> str:
  lines = [f"{'stage':<16}{'eval loss':>11}{'bits/byte':>11}{'indexer KL':>12}{'tokens/s':>10}"
           f"{'wall s':>9}"]
  for name, r in s["stages"].items():
    kl = r["eval_indexer_kl"]
    lines.append(f"{name:<16}{r['eval_loss']:>11.4f}{r['eval_bits_per_byte']:>11.4f}"
                 f"{(kl if kl else float('nan')):>12.4g}{r['tokens_per_s'] or math.nan:>10.0f}"
                 f"{r['wall_s']:>9.0f}")
  lines.append(f"unigram entropy of the corpus: {s['unigram_entropy_bits_per_byte']:.3f} bits/byte")
  lines.append(f"DSA sparse vs dense continuation, held-out loss gap: "
               f"{100 * s['dsa_vs_dense_relative_loss_gap']:+.2f}%")
  return "\n".join(lines)


def _plot(curves: dict, path: str):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  offset = {"pretrain": 0}
  n_pre = max((m["step"] for m in curves["pretrain"]), default=0)
  offset.update(dense_baseline=n_pre, dsa_warmup=n_pre, dsa_sparse=n_pre)
  for name, rows in curves.items():
    tr = [(offset[name] + m["step"], m["ce"]) for m in rows if "ce" in m]
    ev = [(offset[name] + m["step"], m["eval_loss"]) for m in rows if "eval_loss" in m]
    if name != "dsa_warmup" and tr:
      ax1.plot(*zip(*tr), label=f"{name} train", alpha=0.6)
    if name != "dsa_warmup" and ev:
      ax1.plot(*zip(*ev), "o-", label=f"{name} held-out")
    kl = [(m["step"], m["indexer_kl"]) for m in rows if "indexer_kl" in m and m["indexer_kl"] > 0]
    if kl:
      ax2.plot(*zip(*kl), label=name)
  ax1.set_xlabel("step")
  ax1.set_ylabel("next-token loss (nats)")
  ax1.legend(fontsize=7)
  ax2.set_xlabel("step within stage")
  ax2.set_ylabel("indexer KL (mean over layers)")
  ax2.set_yscale("log")
  ax2.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
