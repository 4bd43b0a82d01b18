"""The report of a sweep (glm5_jax/train/sweep.py): WORKDIR/sweep.md, sweep.json, sweep.png.

`tables`: one Markdown row per point, then one per seed group (mean ± std of the finals);
`plot`: held-out loss and train CE curves, one colour per seed group.
"""

from __future__ import annotations

import json
import os

import numpy as np

from glm5_jax.train import sweep


def tables(results: list[dict]) -> str:
  """Markdown: one row per point, then (points differing in `seed`) one per seed group."""
  lines = ["| point | steps | train CE (last 10 steps) | held-out loss final | best | "
           "bits/byte final | best | step (ms) | wall (s) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    lines.append(f"| {r['name']} | {r['steps']} | {r['train_ce_last10']:.4f} | "
                 f"{r['final_eval_loss']:.4f} | {r['best_eval_loss']:.4f} | "
                 f"{r['final_eval_bits_per_byte']:.4f} | {r['best_eval_bits_per_byte']:.4f} | "
                 f"{r['step_ms']:.0f} | {r['wall_s']:.0f} |")
  if "seed" not in sweep.varying([r["overrides"] for r in results]):
    return "\n".join(lines)
  lines += ["", "| group | seeds | held-out loss final, mean ± std | per seed | "
            "bits/byte final, mean ± std | best held-out (mean) | train CE (mean) | "
            "step (ms) |", "|---|---|---|---|---|---|---|---|"]
  for g in sweep.group_by_seed(results):
    per = ", ".join(f"{x:.4f}" for x in g["final_eval_loss_per_seed"])
    lines.append(f"| {g['group']} | {len(g['seeds'])} | {g['final_eval_loss_mean']:.4f} ± "
                 f"{g['final_eval_loss_std']:.4f} | {per} | "
                 f"{g['final_eval_bits_per_byte_mean']:.4f} ± "
                 f"{g['final_eval_bits_per_byte_std']:.4f} | {g['best_eval_loss_mean']:.4f} | "
                 f"{g['train_ce_last10_mean']:.4f} | {g['step_ms_mean']:.0f} |")
  return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
  """Held-out loss (left) and train CE (right, 10-step mean) per point; one colour per seed
  group."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  groups = [g["group"] for g in sweep.group_by_seed(results)]
  colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
  fig, (ax_e, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
  labelled = set()
  for r in results:
    key = sweep.group_of(r, results)
    color = colors(groups.index(key) % colors.N)
    label = None if key in labelled else key
    labelled.add(key)
    ev = r["curves"]["eval"]
    if ev:
      ax_e.plot([s for s, *_ in ev], [l for _, l, _ in ev], "o-", ms=3, color=color,
                label=label)
    tr = r["curves"]["train_ce"]
    if tr:
      k = min(10, len(tr))
      smooth = np.convolve([l for _, l in tr], np.ones(k) / k, mode="valid")
      ax_t.plot([s for s, _ in tr][k - 1:], smooth, color=color, lw=1)
  ax_e.set(xlabel="step", ylabel="held-out loss (nats / token)", title="held-out loss")
  ax_t.set(xlabel="step", ylabel="train CE (nats / token)", title="train CE (10-step mean)")
  for ax in (ax_e, ax_t):                      # from the lowest value, leaving out step 0's
    ys = np.concatenate([l.get_ydata() for l in ax.get_lines()] or [np.zeros(0)])
    ys = ys[np.isfinite(ys)]
    if ys.size:
      ax.set_ylim(ys.min() - 0.05, min(ys.max(), ys.min() + 2.0) + 0.05)
    ax.grid(alpha=0.3)
  ax_e.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_report(results: list[dict], workdir: str, *, title: str, wall_s: float) -> str:
  md = f"## {title}\n\n{tables(results)}\n\nWall time of this invocation: {wall_s:.0f} s.\n"
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "sweep.md"), "w") as f:
    f.write(md)
  with open(os.path.join(workdir, "sweep.json"), "w") as f:
    json.dump({"title": title, "points": results, "groups": sweep.group_by_seed(results)}, f,
              indent=1)
  plot(results, os.path.join(workdir, "sweep.png"))
  print(md)
  return md
