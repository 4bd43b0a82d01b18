"""The main job's summary: a table of held-out metrics per stage, summary.json and a PNG."""

from __future__ import annotations

import math
import os

import numpy as np

from glm5_jax.train import metrics as metrics_lib


# What a new machine can expect from `bash launch/local.sh main` (docs/main_job.md, "What a
# run gives"): (path in summary.json, low, high). The summary names every number of a run
# outside its range. Measured: config.seed 0, 1, 2, each through the whole job, on the
# development machine (AMD EPYC family 25 model 17, 2 vCPUs, KVM); a range is the lowest and
# highest of the three widened by a margin (0.01 on a loss, 3 points on an accuracy or a
# gain): three seeds do not bound a fourth, and floats move on another CPU.
EXPECTED = (
    ("stages.pretrain.eval_loss", 2.34, 2.63),           # measured 2.3513-2.6223
    ("stages.dsa_sparse.eval_loss", 2.33, 2.56),         # 2.3416-2.5523
    ("post_training.sft_eval_loss", 0.28, 0.34),         # 0.2909-0.3261
    ("post_training.heldout_accuracy_after_sft", 0.126, 0.386),    # 15.6%-35.6%
    ("post_training.heldout_accuracy_after_grpo", 0.374, 0.614),   # 40.4%-58.4%
    ("post_training.grpo_gain", 0.122, 0.298),           # +15.2 to +26.8 points
)


def _at(summary: dict, path: str):
  node = summary
  for k in path.split("."):
    if not isinstance(node, dict) or node.get(k) is None:
      return None
    node = node[k]
  return node


def outside_expected(summary: dict, expected=EXPECTED) -> list[str]:
  """The summary's numbers outside the ranges a new machine can expect (EXPECTED)."""
  out = []
  for path, lo, hi in expected:
    v = _at(summary, path)
    if v is None or lo is None or (lo <= v <= hi):
      continue
    out.append(f"{path} = {v:.4g}, outside the range [{lo:.4g}, {hi:.4g}] measured in "
               "docs/main_job.md")
  return out


def _final_metrics(result: dict, workdir: str) -> dict:
  """The stage's last value of every metric: what `run` returned, over its metrics.jsonl
  (a stage finished by an earlier run, or resumed after a preemption, is read back)."""
  return {**metrics_lib.final_metrics(workdir), **(result or {})}


def _heldout_accuracies(workdir: str) -> list[tuple[int, float]]:
  return [(m["step"], m["heldout_accuracy"]) for m in metrics_lib.read_rows(workdir)
          if "heldout_accuracy" in m]


def _consistency(rows) -> dict:
  """Train/rollout agreement over an RL stage's metrics rows: max and mean |dlogp|, DSA top-k
  and MoE routing mismatches (rows from before the routing metrics count none)."""
  total = lambda k: sum(m.get(k, 0.0) for m in rows)
  pairs = total("routing_pairs")
  return {"train_rollout_logp_abs_diff_max": max((m["logp_abs_diff_max"] for m in rows),
                                                 default=None),
          "train_rollout_logp_abs_diff_mean": (
              float(np.mean(means)) if (means := [m["logp_abs_diff_mean"] for m in rows
                                                  if "logp_abs_diff_mean" in m]) else None),
          "topk_mismatches": total("topk_mismatches"),
          "topk_positions_compared": total("topk_positions"),
          "routing_mismatches": total("routing_mismatches"),
          "routing_pairs_compared": pairs,
          "routing_mismatch_rate": total("routing_mismatches") / pairs if pairs else 0.0}


def _consistency_text(r) -> str:
  return (f"|dlogp| max {r['train_rollout_logp_abs_diff_max']:.2g}, top-k mismatches "
          f"{r['topk_mismatches']:.0f} of {r['topk_positions_compared']:.0f}, routing "
          f"mismatches {r['routing_mismatches']:.0f} of {r['routing_pairs_compared']:.0f}")


def summarize(results, timings, meta, workdir):
  rows = {}
  for name, r in results.items():
    r = _final_metrics(r, os.path.join(workdir, name))
    rows[name] = {"eval_loss": r.get("eval_loss"), "eval_bits_per_byte": r.get("eval_bits_per_byte"),
                  "eval_indexer_kl": r.get("eval_indexer_kl"), "train_indexer_kl": r.get("indexer_kl"),
                  "tokens_per_s": r.get("tokens_per_s"), "wall_s": timings[name]}
  dense, sparse = rows["dense_baseline"]["eval_loss"], rows["dsa_sparse"]["eval_loss"]
  out = {"stages": rows, "unigram_entropy_bits_per_byte":
         meta["train_unigram_entropy_bits_per_token"] * meta["splits"]["train"]["tokens"]
         / max(meta["splits"]["train"]["bytes"], 1),
         "dsa_vs_dense_relative_loss_gap":
             None if dense is None or sparse is None else (sparse - dense) / dense}
  if "grpo" in results:
    rl_dir = os.path.join(workdir, "grpo")
    acc = _heldout_accuracies(rl_dir) or [(0, None)]
    steps = [m for m in metrics_lib.read_rows(rl_dir) if "reward_mean" in m]
    out["post_training"] = {
        "heldout_accuracy_after_sft": acc[0][1], "heldout_accuracy_after_grpo": acc[-1][1],
        "heldout_problems": _final_metrics({}, rl_dir).get("heldout_problems"),
        "grpo_steps": len(steps), **_consistency(steps),
        "sft_eval_loss": rows["sft"]["eval_loss"],
        "grpo_gain": None if None in (acc[0][1], acc[-1][1]) else acc[-1][1] - acc[0][1]}
  if "rl_async" in results:
    a_dir = os.path.join(workdir, "rl_async")
    acc = [(m["step"], m["heldout_success_rate"]) for m in metrics_lib.read_rows(a_dir)
           if "heldout_success_rate" in m] or [(0, None)]
    ups = [m for m in metrics_lib.read_rows(a_dir) if "reward_mean" in m]
    out["async_rl"] = {
        "heldout_accuracy_before": acc[0][1], "heldout_accuracy_after": acc[-1][1],
        "updates": len(ups), **_consistency(ups),
        "staleness_max": max((m["staleness_max"] for m in ups), default=None),
        "trainer_idle_ratio": ups[-1]["trainer_idle_ratio"] if ups else None}
  out["outside_expected"] = outside_expected(out)
  return out


def _nan(v):
  """A metric a stage did not produce (None) prints as nan."""
  return math.nan if v is None else v


def table(s) -> str:
  lines = [f"{'stage':<16}{'eval loss':>11}{'bits/byte':>11}{'indexer KL':>12}{'tokens/s':>10}"
           f"{'wall s':>9}"]
  nan = _nan
  for name, r in s["stages"].items():
    kl = r["eval_indexer_kl"]
    lines.append(f"{name:<16}{nan(r['eval_loss']):>11.4f}{nan(r['eval_bits_per_byte']):>11.4f}"
                 f"{(kl if kl else math.nan):>12.4g}{nan(r['tokens_per_s']):>10.0f}"
                 f"{r['wall_s']:>9.0f}")
  lines.append(f"unigram entropy of the corpus: {s['unigram_entropy_bits_per_byte']:.3f} bits/byte")
  lines.append(f"DSA sparse vs dense continuation, held-out loss gap: "
               f"{100 * nan(s['dsa_vs_dense_relative_loss_gap']):+.2f}%")
  p = s.get("post_training")
  if p:
    p = {k: nan(v) for k, v in p.items()}
    lines.append(
        f"held-out accuracy ({p['heldout_problems']:.0f} problems, greedy): after SFT "
        f"{p['heldout_accuracy_after_sft']:.3f}, after GRPO {p['heldout_accuracy_after_grpo']:.3f}"
        f" ({100 * (p['heldout_accuracy_after_grpo'] - p['heldout_accuracy_after_sft']):+.1f} "
        f"points); train/rollout {_consistency_text(p)}")
  a = s.get("async_rl")
  if a:
    a = {k: nan(v) for k, v in a.items()}
    lines.append(
        f"async RL ({a['updates']:.0f} updates, staleness <= {a['staleness_max']:.0f}): held-out "
        f"accuracy {a['heldout_accuracy_before']:.3f} -> {a['heldout_accuracy_after']:.3f}; "
        f"{_consistency_text(a)}")
  for line in s.get("outside_expected", []):
    lines.append(f"NOTE: {line}")
  if "outside_expected" in s and not s["outside_expected"]:
    lines.append("each number docs/main_job.md gives a range for is inside it")
  return "\n".join(lines)


def plot(curves: dict, path: str):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  with_rl = "grpo" in curves
  fig, axes = plt.subplots(1, 3 if with_rl else 2, figsize=(16 if with_rl else 11, 4))
  ax1, ax2 = axes[0], axes[1]
  n_pre = max((m["step"] for m in curves["pretrain"]), default=0)
  offset = {"pretrain": 0, "dense_baseline": n_pre, "dsa_warmup": n_pre, "dsa_sparse": n_pre}
  for name in offset:
    rows = curves.get(name, [])
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
  if with_rl:
    ax3 = axes[2]
    rw = [(m["step"], m["reward_mean"]) for m in curves["grpo"] if "reward_mean" in m]
    acc = [(m["step"], m["heldout_accuracy"]) for m in curves["grpo"] if "heldout_accuracy" in m]
    if rw:
      ax3.plot(*zip(*rw), alpha=0.5, label="GRPO train reward (mean of the batch)")
    if acc:
      ax3.plot(*zip(*acc), "o-", label="held-out accuracy (greedy)")
    if "rl_async" in curves:            # its updates continue from GRPO's last step
      n_rl = max((m["step"] for m in curves["grpo"]), default=0)
      rows = curves["rl_async"]
      rw = [(n_rl + m["step"], m["reward_mean"]) for m in rows if "reward_mean" in m]
      acc = [(n_rl + m["step"], m["heldout_success_rate"]) for m in rows
             if "heldout_success_rate" in m]
      if rw:
        ax3.plot(*zip(*rw), alpha=0.5, label="async RL train reward")
      if acc:
        ax3.plot(*zip(*acc), "s-", label="held-out accuracy, async RL")
      ax3.axvline(n_rl, color="gray", lw=0.8, ls=":")
    ax3.set_xlabel("GRPO step (0 = after SFT), then async RL updates")
    ax3.set_ylabel("reward / accuracy")
    ax3.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
