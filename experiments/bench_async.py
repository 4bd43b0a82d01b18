r"""Synchronous vs asynchronous agentic RL: wall-clock to reach the same reward, one run.

  python -m experiments.bench_async --init_from=/tmp/toolrl/sft --updates=12 \
      --out=docs/bench_async_cpu.json

Both modes are the same loop (glm5_jax/rl/orchestration/async_loop.py) on the same model, task and
simulated environment, every tool call sleeping a log-normal latency (median 0.2 s,
sigma 1.5: a heavy tail, as real agent environments have):
  sync   tau = 0 and at most N groups in flight: the trainer's update waits for all N groups
         sampled by the current weights, and rollouts wait for the update (GRPO's loop);
  async  tau > 0 and (tau + 1) N groups in flight (admission control): rollouts never wait,
         the trainer takes the first N finished groups.
The target is the synchronous run's final training reward (mean of its last `--smooth`
updates); the async time is when its own running mean first reaches it. Each mode runs in its
own process and is timed from the end of its first update. New shapes (prefill chunk, lane
and block-table buckets) keep compiling for many updates (about 190 s of compilation in a
175 s synchronous run of 6 updates with 2 workers: worker threads compile in parallel), so
first an untimed warm-up run of each mode fills a persistent compilation cache
(`JAX_COMPILATION_CACHE_DIR`) that the timed runs load from; what still compiles inside the
timed window is reported (`compile_s_timed`). The workers' engines run one decode shape
(`rl.engine_shape_buckets=False`) and the trainer compiles every padded length first
(`rl.warmup_lengths`). Prints a table, writes JSON
(per-update wall time, reward, idle ratios, staleness histogram) and a PNG of reward vs time.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

from glm5_jax import numerics

numerics.batch_invariant_cpu()


# --devices=N (default 3) as fake XLA:CPU devices, before JAX starts.
numerics.cpu_devices(int(next((a.split("=", 1)[1] for a in sys.argv
                               if a.startswith("--devices=")), "3")))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

from configs import rl_async
from glm5_jax.rl.orchestration import async_loop
from glm5_jax.train import metrics as metrics_lib

_INIT = flags.DEFINE_string("init_from", None, "SFT workdir of the tool task", required=True)
_TASK = flags.DEFINE_string("task", "tool_calc", "tool task")
_OPTIONS = flags.DEFINE_string("task_options", "", "k=v,... task options")
_UPDATES = flags.DEFINE_integer("updates", 12, "updates of the synchronous run")
_TAU = flags.DEFINE_integer("tau", 2, "staleness bound of the async run")
_GROUPS = flags.DEFINE_integer("groups_per_update", 4, "N")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 4, "G")
_LR = flags.DEFINE_float("learning_rate", 2e-5, "learning rate")
_MEDIAN = flags.DEFINE_float("latency_median_s", 0.2, "environment latency median")
_SIGMA = flags.DEFINE_float("latency_sigma", 1.5, "environment latency log-normal sigma")
_SMOOTH = flags.DEFINE_integer("smooth", 3, "updates in the running mean of the reward")
_SEED = flags.DEFINE_integer("seed", 0, "seed")
_OUT = flags.DEFINE_string("out", "docs/bench_async_cpu.json", "JSON path (PNG beside it)")
_MODE = flags.DEFINE_enum("mode", None, ["sync", "async"], "internal: run one mode")
_N = flags.DEFINE_integer("n", 0, "internal: updates of --mode")
_WARMUP = flags.DEFINE_integer("warmup_updates", 6, "updates of each mode's untimed warm-up "
                               "run (fills the compilation cache); 0: none")
flags.DEFINE_integer("devices", 3, "XLA:CPU devices (trainer + 2 workers), set before JAX")


def config(mode: str, updates: int):
  c = rl_async.get_config(f"task={_TASK.value},runlocal=True")
  c.init_from = _INIT.value
  c.seed = _SEED.value
  c.total_steps = updates
  c.learning_rate = _LR.value
  c.tensorboard = False
  r = c.rl
  if _OPTIONS.value:
    for item in _OPTIONS.value.split(","):
      k, v = item.split("=", 1)
      r.task_options[k] = type(r.task_options[k])(v)
  n = _GROUPS.value
  r.group_size, r.groups_per_update, r.updates_per_publish = _GROUP_SIZE.value, n, 1
  r.tau = 0 if mode == "sync" else _TAU.value
  r.max_groups_in_flight = n * (r.tau + 1)
  r.episodes_per_worker = r.max_groups_in_flight * r.group_size
  r.engine_batch = min(r.episodes_per_worker, 32)
  r.tool_threads = r.episodes_per_worker
  r.env.latency_median_s, r.env.latency_sigma = _MEDIAN.value, _SIGMA.value
  # Every trainer length compiles before the timing starts (64 .. max_len's bucket).
  r.warmup_lengths = tuple(1 << k for k in range(6, (r.max_len - 1).bit_length() + 1))
  r.eval_every = r.checkpoint_every = 10 ** 6
  r.eval_problems = 1
  return c


def running_mean(x, k):
  x = np.asarray(x, np.float64)
  return np.asarray([x[max(0, i - k + 1):i + 1].mean() for i in range(len(x))])


def run_mode(mode, updates, workdir):
  """One mode's run; per-update rows timed from the end of its first update (compilation)."""
  async_loop.run(config(mode, updates), workdir)
  rows = [r for r in metrics_lib.read_rows(workdir) if "loss" in r]
  first, rows = rows[0], rows[1:]
  t0 = first["wall_s"]
  return {"wall_s": [r["wall_s"] - t0 for r in rows], "reward": [r["reward_mean"] for r in rows],
          "trainer_idle_ratio": rows[-1]["trainer_idle_ratio"],
          "rollout_idle_ratio": rows[-1]["rollout_idle_ratio"],
          "staleness_hist": {k.rsplit("_", 1)[1]: v for k, v in rows[-1].items()
                             if k.startswith("staleness_hist_")},
          "dropped": {k: v for k, v in rows[-1].items() if k.startswith("dropped_")},
          "compile_s_timed": rows[-1]["compile_s"] - first["compile_s"],
          "logp_abs_diff_max": max(r["logp_abs_diff_max"] for r in rows),
          "topk_mismatches": sum(r["topk_mismatches"] for r in rows),
          "topk_positions": sum(r["topk_positions"] for r in rows)}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  root = tempfile.mkdtemp(prefix="bench_async_")
  if _MODE.value:                 # one mode in this process (a child of the run below)
    res = run_mode(_MODE.value, _N.value, os.path.join(root, _MODE.value))
    shutil.rmtree(root, ignore_errors=True)
    with open(_OUT.value, "w") as f:
      json.dump(res, f)
    return
  # Each mode in a process of its own: compiled code does not pile up in one address space.
  # The processes share a persistent compilation cache, filled by the untimed warm-up runs.
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.path.join(root, "jax_cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
  argv = [a for a in sys.argv[1:] if not a.startswith(("--out=", "--mode=", "--n="))]
  runs = [("sync", _WARMUP.value, "warmup"), ("async", _WARMUP.value, "warmup"),
          ("sync", _UPDATES.value + 1, "timed"), ("async", 3 * _UPDATES.value + 1, "timed")]
  res = {}
  try:
    for mode, n, kind in runs:
      if n < 1:
        continue
      path = os.path.join(root, f"{mode}_{kind}.json")
      logging.warning("bench_async: %s run of %s, %d updates", kind, mode, n)
      subprocess.run([sys.executable, "-m", "experiments.bench_async", *argv, f"--mode={mode}",
                      f"--n={n}", f"--out={path}"], check=True, env=env)
      if kind == "timed":
        with open(path) as f:
          res[mode] = json.load(f)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  k = _SMOOTH.value
  target = float(np.mean(res["sync"]["reward"][-k:]))
  for m in res.values():
    m["reward_running_mean"] = running_mean(m["reward"], k).tolist()
    first = min(k, len(res["sync"]["reward"])) - 1        # a full window first
    hit = [i for i, v in enumerate(m["reward_running_mean"]) if v >= target and i >= first]
    m["time_to_target_s"] = m["wall_s"][hit[0]] if hit else float("nan")
    m["updates_to_target"] = hit[0] + 1 if hit else None
  speedup = res["sync"]["time_to_target_s"] / res["async"]["time_to_target_s"]
  out = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                    f"{os.cpu_count()} CPUs, jax {jax.__version__} {jax.default_backend()}",
         "latency": {"median_s": _MEDIAN.value, "sigma": _SIGMA.value},
         "tau": _TAU.value, "groups_per_update": _GROUPS.value, "group_size": _GROUP_SIZE.value,
         "target_reward": target, "speedup": speedup, **res}
  print(f"{'mode':6} {'to target s':>12} {'updates':>8} {'s/update':>9} {'idle trainer':>13} "
        f"{'idle rollout':>13} {'compile s':>10}  staleness hist")
  for name, m in res.items():
    per = m["wall_s"][-1] / len(m["wall_s"])
    print(f"{name:6} {m['time_to_target_s']:12.1f} {str(m['updates_to_target']):>8} "
          f"{per:9.2f} {m['trainer_idle_ratio']:13.2f} {m['rollout_idle_ratio']:13.2f} "
          f"{m['compile_s_timed']:10.1f}  {m['staleness_hist']}")
  print(f"target reward {target:.3f}; async reaches it {speedup:.2f}x sooner")
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1)
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, m in res.items():
    ax.plot(m["wall_s"], m["reward_running_mean"], marker=".", label=name)
  ax.axhline(target, color="gray", ls="--", lw=1, label="target")
  ax.set_xlabel("wall-clock s")
  ax.set_ylabel(f"training reward (mean of {k} updates)")
  ax.set_title(f"sync vs async agentic RL (latency lognormal {_MEDIAN.value}s, "
               f"sigma {_SIGMA.value})", fontsize=9)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.splitext(_OUT.value)[0] + ".png", dpi=120)
  print(f"wrote {_OUT.value} and its PNG")


if __name__ == "__main__":
  app.run(main)
