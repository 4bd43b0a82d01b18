r"""GRPO with low-precision rollouts: what FP8 opens, what IcePop and routing replay close.

  python -m experiments.low_precision_rl --init_from=workdir/main/sft --workdir=/tmp/lp \
      --seeds=0,1,2 --steps=60

Runs the main job's GRPO stage (`configs/main_job.py`, `post.rl`: the arith task with
thinking on) from an SFT checkpoint in four arms (`ARMS`), each over the given seeds (the RL
seed: prompts and sampling; the SFT checkpoint is shared), each in WORKDIR/<arm>/seed<s>
(rerunning resumes or skips a finished run). Then a table (mean +- std over seeds) of
held-out accuracy, train reward, train/rollout |dlogp|, the IcePop-masked fraction and the DSA
top-k and MoE routing mismatch rates, WORKDIR/low_precision.md, .json and .png (curves).
Held-out accuracy is the trained policy's at the trainer's precision (float32), so the arms
differ only in what their rollouts fed the updates.
"""

from __future__ import annotations

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # before JAX starts: engine and trainer agree bitwise on CPU
numerics.cpu_devices(2)          # as the main job, whose stages these runs repeat

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import os

from absl import app
from absl import flags
from absl import logging
import numpy as np

from configs import main_job as main_job_config
from experiments import main_job_stages
from glm5_jax.rl.orchestration import grpo
from glm5_jax.train import metrics as metrics_lib

_INIT = flags.DEFINE_string("init_from", None, "the SFT workdir GRPO starts from", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory", required=True)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "RL seeds")
_STEPS = flags.DEFINE_integer("steps", 60, "GRPO steps per run")
_ARMS = flags.DEFINE_list("arms", None, "arms to run (default: all of ARMS)")

# arm -> (label, config.rl overrides). FP8: float8_e4m3fn weights with 32 x 32 block scales
# on the tiny model (all linear layers), the trainer in float32.
ARMS = {
    "float32": ("float32 rollout, IcePop", {}),
    "fp8": ("FP8 rollout, no IcePop", {"rollout_weight_dtype": "float8_e4m3fn",
                                       "icepop": False}),
    "fp8_icepop": ("FP8 rollout, IcePop", {"rollout_weight_dtype": "float8_e4m3fn"}),
    "fp8_icepop_r3": ("FP8 rollout, IcePop, routing replay",
                      {"rollout_weight_dtype": "float8_e4m3fn", "routing_replay": True}),
    # The DSA top-k with the indexer's weights at the trainer's precision (its inputs still
    # carry the FP8 gap of the layers before it).
    "fp8_icepop_indexer32": ("FP8 rollout (indexer float32), IcePop",
                             {"rollout_weight_dtype": "float8_e4m3fn",
                              "rollout_indexer_dtype": "float32"}),
}
# Per-step metrics averaged over a run's steps (their names in metrics.jsonl).
STEP_METRICS = ("logp_abs_diff_mean", "logp_abs_diff_max", "icepop_masked_frac",
                "topk_mismatch_rate", "routing_mismatch_rate", "mismatch_kl_k3")


def arm_config(arm: str, seed: int, steps: int, init_from: str):
  c = main_job_config.get_config()
  with c.unlocked():
    c.seed = seed
  rc = main_job_stages.rl_config(c, c.post.rl, init_from)
  with rc.unlocked():
    rc.total_steps = steps
    rc.rl.eval_every = max(steps // 2, 1)
    rc.rl.checkpoint_every = steps
    rc.rl.update(ARMS[arm][1])
  return rc


def run_summary(workdir: str) -> dict:
  rows = metrics_lib.read_rows(workdir)
  steps = [m for m in rows if "reward_mean" in m]
  acc = [(m["step"], m["heldout_accuracy"]) for m in rows if "heldout_accuracy" in m]
  out = {"heldout_start": acc[0][1], "heldout_final": acc[-1][1],
         "reward_last10": float(np.mean([m["reward_mean"] for m in steps[-10:]])),
         "curves": {"step": [m["step"] for m in steps],
                    "reward": [m["reward_mean"] for m in steps],
                    "heldout": acc,
                    **{k: [m.get(k, 0.0) for m in steps] for k in STEP_METRICS}}}
  for k in STEP_METRICS:
    vals = [m.get(k, 0.0) for m in steps]
    out[k] = float(np.max(vals) if k.endswith("_max") else np.mean(vals))
  return out


def _mean_std(xs):
  return f"{np.mean(xs):.4g} +- {np.std(xs):.2g}" if len(xs) > 1 else f"{xs[0]:.4g}"


def table(results: dict) -> str:
  cols = ["heldout_start", "heldout_final", "reward_last10"] + list(STEP_METRICS)
  lines = ["| arm | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
  for arm, runs in results.items():
    lines.append(f"| {ARMS[arm][0]} | " + " | ".join(
        _mean_std([r[c] for r in runs.values()]) for c in cols) + " |")
  return "\n".join(lines)


def plot(results: dict, path: str):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  panels = [("reward", "train reward (batch mean)"), ("heldout", "held-out accuracy"),
            ("logp_abs_diff_mean", "train/rollout |dlogp| (mean)"),
            ("routing_mismatch_rate", "MoE routing mismatch rate")]
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
  for ax, (key, title) in zip(axes, panels):
    for i, (arm, runs) in enumerate(results.items()):
      for j, r in enumerate(runs.values()):
        c = r["curves"]
        xs, ys = (zip(*c["heldout"]) if key == "heldout" else (c["step"], c[key]))
        ax.plot(list(xs), list(ys), color=f"C{i}", alpha=0.7, lw=1,
                marker="o" if key == "heldout" else None,
                label=ARMS[arm][0] if j == 0 else None)
    ax.set_title(title)
    ax.set_xlabel("GRPO step")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  arms = _ARMS.value or list(ARMS)
  unknown = sorted(set(arms) - set(ARMS))
  if unknown:
    raise app.UsageError(f"--arms: {unknown} unknown; expected names from {list(ARMS)}")
  seeds = [int(s) for s in _SEEDS.value]
  results = {}
  for arm in arms:
    results[arm] = {}
    for seed in seeds:
      wd = os.path.join(_WORKDIR.value, arm, f"seed{seed}")
      logging.info("=== %s, seed %d -> %s", ARMS[arm][0], seed, wd)
      grpo.run(arm_config(arm, seed, _STEPS.value, _INIT.value), wd)
      results[arm][seed] = run_summary(wd)
  text = table(results)
  print(text)
  out = os.path.join(_WORKDIR.value, "low_precision")
  with open(out + ".md", "w") as f:
    f.write(text + "\n")
  with open(out + ".json", "w") as f:
    json.dump({"arms": {a: ARMS[a][0] for a in arms}, "seeds": seeds, "steps": _STEPS.value,
               "init_from": _INIT.value, "results": results}, f, indent=1)
  plot(results, out + ".png")


if __name__ == "__main__":
  app.run(main)
