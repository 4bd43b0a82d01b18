r"""Held-out success vs update of asynchronous RL runs, and their summary table.

  python -m experiments.plot_rl_runs --workdirs=/tmp/rl/s0,/tmp/rl/s1,/tmp/rl/s2 \
      --labels="seed 0,seed 1,seed 2" --out=docs/agentic_rl_success.png

Reads each workdir's `metrics.jsonl` (written by `glm5_jax.rl.orchestration.async_loop.run`) and
`rollouts.jsonl` (`glm5_jax.rl.orchestration.ledger.audit`), prints a Markdown table (post-SFT and
final held-out success, updates, wall time, train/rollout consistency, staleness, trainer idle
ratio, drops, ledger problems) and draws held-out success per update (docs/agentic_rl_results.md).
"""

import os

from absl import app
from absl import flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

from glm5_jax.rl.orchestration import ledger as ledger_lib  # pylint: disable=wrong-import-position
from glm5_jax.train import metrics as metrics_lib  # pylint: disable=wrong-import-position

_WORKDIRS = flags.DEFINE_list("workdirs", None, "async RL workdirs", required=True)
_LABELS = flags.DEFINE_list("labels", None, "one label per workdir (default: its basename)")
_OUT = flags.DEFINE_string("out", None, "PNG path (none: table only)")
_TITLE = flags.DEFINE_string("title", "tool_calc: held-out success under async RL", "plot title")

HELDOUT = "heldout_success_rate"


def summarize(workdir: str) -> dict:
  """One run's table row from its metrics.jsonl and rollouts.jsonl."""
  rows = metrics_lib.read_rows(workdir)
  if not rows:
    raise ValueError(f"--workdirs: {workdir} has no metrics.jsonl rows")
  evals = [(r["step"], r[HELDOUT]) for r in rows if HELDOUT in r]
  train = [r for r in rows if "logp_abs_diff_max" in r]
  if not evals or not train:
    raise ValueError(f"--workdirs: {workdir}/metrics.jsonl has no {HELDOUT} or no update rows")
  last = metrics_lib.final_metrics(workdir)
  ledger = os.path.join(workdir, "rollouts.jsonl")
  return {
      "evals": evals,
      "post_sft": evals[0][1] if evals[0][0] == 0 else float("nan"),
      "final": evals[-1][1],
      "updates": train[-1]["step"],
      "wall_s": train[-1]["wall_s"],
      "logp_max": max(r["logp_abs_diff_max"] for r in train),
      "topk_mism": sum(r["topk_mismatches"] for r in train),
      "topk_pos": sum(r["topk_positions"] for r in train),
      "stale_mean": sum(r["staleness_mean"] for r in train) / len(train),
      "stale_max": max(r["staleness_max"] for r in train),
      "idle": last["trainer_idle_ratio"],
      "dropped": {k[len("dropped_"):]: int(v) for k, v in last.items()
                  if k.startswith("dropped_")},
      "truncated": int(last.get("status_truncated", 0)),
      "episodes": int(sum(v for k, v in last.items() if k.startswith("status_"))),
      "ledger_problems": len(ledger_lib.audit(ledger)) if os.path.exists(ledger) else -1,
  }


def table(labels, runs) -> str:
  head = ("| run | post-SFT | final | delta | updates | wall s | max train/rollout abs dlogp "
          "| top-k mismatches / positions | staleness mean / max | trainer idle | dropped "
          "| truncated / episodes | ledger problems |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for name, s in zip(labels, runs):
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped"].items())) or "0"
    lines.append(
        f"| {name} | {s['post_sft']:.3f} | {s['final']:.3f} | {s['final'] - s['post_sft']:+.3f} "
        f"| {s['updates']} | {s['wall_s']:.0f} | {s['logp_max']:.1e} "
        f"| {s['topk_mism']:.0f} / {s['topk_pos']:.0f} | {s['stale_mean']:.2f} / "
        f"{s['stale_max']:.0f} | {s['idle']:.2f} | {dropped} | {s['truncated']} / "
        f"{s['episodes']} | {s['ledger_problems']} |")
  return "\n".join(lines)


def plot(labels, runs, out: str, title: str):
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, s in zip(labels, runs):
    steps, vals = zip(*s["evals"])
    ax.plot(steps, vals, marker="o", label=name)
  ax.set_xlabel("optimizer update")
  ax.set_ylabel("held-out success (greedy)")
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(out, dpi=120)


def main(argv):
  del argv
  labels = _LABELS.value or [os.path.basename(w.rstrip("/")) for w in _WORKDIRS.value]
  if len(labels) != len(_WORKDIRS.value):
    raise ValueError(f"--labels has {len(labels)} entries, --workdirs {len(_WORKDIRS.value)}")
  runs = [summarize(w) for w in _WORKDIRS.value]
  print(table(labels, runs))
  for name, s in zip(labels, runs):
    print(name, "held-out success per update:",
          ", ".join(f"{u}: {v:.3f}" for u, v in s["evals"]))
  if _OUT.value:
    plot(labels, runs, _OUT.value, _TITLE.value)
    print("wrote", _OUT.value)


if __name__ == "__main__":
  app.run(main)
