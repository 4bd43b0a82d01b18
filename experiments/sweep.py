r"""Sweeps: one training run per point of a config file's sweep, then one table.

  python -m experiments.sweep --config=configs/pretrain.py:model=tiny,runlocal=True \
      --sweep=lr_x_optimizer --workdir=/tmp/sweep [--config.total_steps=50]
  ... --launch=tpu_vm --tpu='my-tpu us-central2-b'   # print launch/tpu_vm.sh commands instead

A config file defines its sweeps next to `get_config` (big_vision style): a module-level
`SWEEPS = {name: [overrides, ...]}`, each point a dict of config fields (dotted for nested
ones), built with `configs.common.product` / `zip_`. `--config.X=...` applies to every point,
over the point's own overrides (e.g. `--config.total_steps=20` for a trial), except on a field
the sweep varies (an error). Points run one after another in this process with
`glm5_jax.train.run`, each in WORKDIR/<point name> (the overrides that vary over the sweep,
e.g. `optimizer=adamw,seed=0`); the same command again resumes an unfinished point and skips a
finished one (its metrics.jsonl holds the held-out loss of step total_steps). Writes
WORKDIR/sweep.md (each point's final metrics, and mean ± std over seeds when the points differ
in `seed`), WORKDIR/sweep.json and WORKDIR/sweep.png (held-out and train loss curves).

The main is kept short on purpose; the functions below are what tests/test_sweep.py calls.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import time

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags
import numpy as np

from glm5_jax import train
from glm5_jax.train import loop
from glm5_jax.train import metrics as metrics_lib
from glm5_jax.train import step as step_lib

POINT_FILE = "sweep_point.json"          # in each point's workdir: its config and wall time

# ------------------------------------------------------------------------------ points


def load_sweep(config_file: str, name: str) -> list[dict]:
  """The points of sweep `name` in the config file's `SWEEPS` (`path.py[:arg]`)."""
  path = config_file.split(":", 1)[0]
  if not os.path.exists(path):
    raise FileNotFoundError(f"--config={config_file!r}: no file {path!r}")
  spec = importlib.util.spec_from_file_location("_sweep_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  sweeps = getattr(module, "SWEEPS", {})
  if name not in sweeps:
    raise ValueError(f"--sweep={name!r}: {path} defines the sweeps {sorted(sweeps)} "
                     "(its module-level SWEEPS dict)")
  return [dict(p) for p in sweeps[name]]


def _name_value(v) -> str:
  if isinstance(v, float):
    v = f"{v:g}"
  elif isinstance(v, (list, tuple)):
    v = "-".join(_name_value(x) for x in v)
  return re.sub(r"[^A-Za-z0-9._+-]", "_", str(v))


def _varying(points: list[dict]) -> list[str]:
  """The keys whose value differs between points (every key when none does)."""
  keys = list(dict.fromkeys(k for p in points for k in p))
  return [k for k in keys if len({repr(p.get(k)) for p in points}) > 1] or keys


def _label(overrides: dict, keys: list[str], default: str) -> str:
  return ",".join(f"{k}={_name_value(overrides[k])}" for k in keys if k in overrides) or default


def point_names(points: list[dict]) -> list[str]:
  """A readable, unique directory name per point: `key=value,...` over the keys whose
  value varies over the sweep (every key when there is one point), in the points' order."""
  varying = _varying(points)
  names = [_label(p, varying, "default") for p in points]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ValueError(f"sweep points {dup} appear more than once (two points with the same "
                     "overrides)")
  return names


def with_flags(points: list[dict], flag_overrides: dict) -> list[dict]:
  """The points with the command line's `--config.X` values on top (they set what the sweep
  holds constant, e.g. fewer steps for a trial); a flag on a field the sweep varies would
  make points equal, and is a ValueError."""
  varying = set(_varying(points)) if len(points) > 1 else set()
  clash = sorted(varying & set(flag_overrides))
  if clash:
    raise ValueError(f"--config.{clash[0]}: the sweep varies config.{clash[0]} over its "
                     f"points; drop the flag (or define another sweep)")
  return [{**p, **flag_overrides} for p in points]


def with_overrides(config, overrides: dict):
  """A copy of `config` with `overrides` ({"field" | "a.b.field": value}) set; a key the
  config does not have is a ValueError naming it and the fields next to it."""
  c = config.copy_and_resolve_references()
  for key, value in overrides.items():
    parts, node = key.split("."), c
    for i, p in enumerate(parts):
      where = ".".join(["config"] + parts[:i])
      if not isinstance(node, ml_collections.ConfigDict):
        raise ValueError(f"sweep override {key!r}: the config has no field config.{key} "
                         f"({where} is a value, not a section)")
      if p not in node:
        raise ValueError(f"sweep override {key!r}: the config has no field config.{key} "
                         f"({where} has {sorted(node.keys())})")
      if i < len(parts) - 1:
        node = node[p]
    try:
      node[parts[-1]] = value
    except (TypeError, ValueError) as e:
      raise ValueError(f"sweep override {key}={value!r}: {e}") from e
  return c


def point_configs(config, points: list[dict]) -> list:
  """Every point's config, each checked (fields, optimizer) before anything runs."""
  out = []
  for p in points:
    c = with_overrides(config, p)
    loop.validate_config(c)
    step_lib.check_optimizer(c.optimizer)
    out.append(c)
  return out


# ------------------------------------------------------------------------------ running


def is_finished(workdir: str, total_steps: int) -> bool:
  return metrics_lib.has_metric(workdir, total_steps, "eval_loss")


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def _check_same_config(workdir: str, c) -> None:
  """A point's workdir holds runs of its config only (else its results would be another's)."""
  path = os.path.join(workdir, POINT_FILE)
  if not os.path.exists(path):
    return
  with open(path) as f:
    old = _flat(json.load(f)["config"])
  new = _flat(json.loads(c.to_json()))
  diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
  if diff:
    raise ValueError(f"{workdir} holds a run of another config (config.{diff[0]}: "
                     f"{old.get(diff[0])!r} there, {new.get(diff[0])!r} now; differing: "
                     f"{diff}): use a new --workdir")


def _record(workdir: str, c, overrides: dict, wall_s: float) -> None:
  path = os.path.join(workdir, POINT_FILE)
  prev = 0.0
  if os.path.exists(path):
    with open(path) as f:
      prev = json.load(f).get("wall_s", 0.0)
  with open(path, "w") as f:
    json.dump({"overrides": overrides, "wall_s": prev + wall_s,
               "config": json.loads(c.to_json())}, f, indent=1)


def run_sweep(config, points: list[dict], workdir: str, *, run=train.run, title: str = "",
              names: list[str] | None = None) -> list[dict]:
  """Trains every point not yet finished (`run(config, workdir)`), then writes
  WORKDIR/sweep.{md,json,png} and returns each point's summary. `names`: the points'
  directory names (default `point_names(points)`)."""
  names, configs = names or point_names(points), point_configs(config, points)
  t_all = time.time()
  for i, (name, p, c) in enumerate(zip(names, points, configs)):
    wd = os.path.join(workdir, name)
    _check_same_config(wd, c)
    if is_finished(wd, c.total_steps):
      logging.info("sweep point %d/%d %s: finished, skipped", i + 1, len(points), name)
      continue
    os.makedirs(wd, exist_ok=True)
    logging.info("sweep point %d/%d %s", i + 1, len(points), name)
    t0 = time.time()
    try:
      run(c, wd)
    finally:
      _record(wd, c, p, time.time() - t0)
  results = [summarize(os.path.join(workdir, n), n, p) for n, p in zip(names, points)]
  write_report(results, workdir, title=title or f"sweep of {len(points)} points",
               wall_s=time.time() - t_all)
  return results


# ------------------------------------------------------------------------------ results


def summarize(workdir: str, name: str, overrides: dict) -> dict:
  """A point's final metrics and curves, read from its metrics.jsonl."""
  rows = {}
  for r in metrics_lib.read_rows(workdir):             # a resumed run rewrites its steps
    rows.setdefault(r["step"], {}).update(r)
  rows = [rows[s] for s in sorted(rows)]
  train_ce = [(r["step"], r["ce"]) for r in rows if "ce" in r]
  held = [(r["step"], r["eval_loss"], r.get("eval_bits_per_byte", math.nan))
          for r in rows if "eval_loss" in r]
  step_s = [1.0 / r["steps_per_s"] for r in rows if r.get("steps_per_s")]
  step_s = step_s[1:] if len(step_s) > 1 else step_s   # the first window holds compilation
  wall = math.nan
  if os.path.exists(os.path.join(workdir, POINT_FILE)):
    with open(os.path.join(workdir, POINT_FILE)) as f:
      wall = json.load(f).get("wall_s", math.nan)
  last = [ce for _, ce in train_ce[-10:]]
  best = min(held, key=lambda h: h[1]) if held else (0, math.nan, math.nan)
  return {
      "name": name, "overrides": overrides,
      "steps": rows[-1]["step"] if rows else 0,
      "train_ce_last10": float(np.mean(last)) if last else math.nan,
      "final_eval_loss": held[-1][1] if held else math.nan,
      "final_eval_bits_per_byte": held[-1][2] if held else math.nan,
      "best_eval_loss": best[1], "best_eval_bits_per_byte": best[2],
      "step_ms": 1e3 * float(np.median(step_s)) if step_s else math.nan,
      "wall_s": wall,
      "curves": {"eval": held, "train_ce": train_ce},
  }


def group_by_seed(results: list[dict]) -> list[dict]:
  """Points that differ only in `seed`, together: mean ± std (ddof 1) of their finals."""
  groups: dict[str, list[dict]] = {}
  for r in results:
    groups.setdefault(_group(r, results), []).append(r)
  out = []
  for key, rs in groups.items():
    final = np.array([r["final_eval_loss"] for r in rs])
    bpb = np.array([r["final_eval_bits_per_byte"] for r in rs])
    std = lambda x: float(np.std(x, ddof=1)) if len(x) > 1 else 0.0
    out.append({"group": key, "seeds": [r["overrides"].get("seed") for r in rs],
                "final_eval_loss_mean": float(final.mean()), "final_eval_loss_std": std(final),
                "final_eval_loss_per_seed": final.tolist(),
                "final_eval_bits_per_byte_mean": float(bpb.mean()),
                "final_eval_bits_per_byte_std": std(bpb),
                "best_eval_loss_mean": float(np.mean([r["best_eval_loss"] for r in rs])),
                "train_ce_last10_mean": float(np.mean([r["train_ce_last10"] for r in rs])),
                "step_ms_mean": float(np.mean([r["step_ms"] for r in rs]))})
  return out


def _group(r: dict, results: list[dict]) -> str:
  """A point's seed group: its varying overrides but the seed."""
  keys = [k for k in _varying([x["overrides"] for x in results]) if k != "seed"]
  return _label(r["overrides"], keys, "all")


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
  if "seed" not in _varying([r["overrides"] for r in results]):
    return "\n".join(lines)
  lines += ["", "| group | seeds | held-out loss final, mean ± std | per seed | "
            "bits/byte final, mean ± std | best held-out (mean) | train CE (mean) | "
            "step (ms) |", "|---|---|---|---|---|---|---|---|"]
  for g in group_by_seed(results):
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
  groups = [g["group"] for g in group_by_seed(results)]
  colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
  fig, (ax_e, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
  labelled = set()
  for r in results:
    key = _group(r, results)
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
    json.dump({"title": title, "points": results, "groups": group_by_seed(results)}, f,
              indent=1)
  plot(results, os.path.join(workdir, "sweep.png"))
  print(md)
  return md


# ------------------------------------------------------------------------------ launching


def _flag_value(v) -> str:
  return str(tuple(v)) if isinstance(v, (list, tuple)) else str(v)


def launch_commands(config_arg: str, points: list[dict], workdir: str,
                    tpu: str = "$TPU_NAME $ZONE", names: list[str] | None = None) -> list[str]:
  """One `launch/tpu_vm.sh TPU -- python -m experiments.pretrain ...` line per point: the
  config, the point's overrides (`with_flags` adds the command line's), its workdir."""
  out = []
  for name, p in zip(names or point_names(points), points):
    args = ["python", "-m", "experiments.pretrain", f"--config={config_arg}",
            f"--workdir={os.path.join(workdir, name)}"]
    args += [f"--config.{k}={_flag_value(v)}" for k, v in p.items()]
    inner = " ".join(shlex.quote(a) for a in args)
    # tpu_vm.sh runs "$*" in a remote shell: a quoted word survives both shells whole.
    out.append(f"launch/tpu_vm.sh {tpu} -- "
               + (inner if inner == " ".join(args) else shlex.quote(inner)))
  return out


# ------------------------------------------------------------------------------ main

_CONFIG = config_flags.DEFINE_config_file("config", "configs/pretrain.py", "config file[:arg]",
                                          lock_config=True)
_SWEEP = flags.DEFINE_string("sweep", None, "a name in the config file's SWEEPS", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "the sweep's directory (a workdir per point)",
                               required=True)
_LAUNCH = flags.DEFINE_enum("launch", "local", ["local", "tpu_vm"],
                            "local: run the points here; tpu_vm: print one launch/tpu_vm.sh "
                            "command per point")
_TPU = flags.DEFINE_string("tpu", "$TPU_NAME $ZONE", "--launch=tpu_vm: TPU_NAME ZONE [PROJECT]")


def main(argv):
  del argv
  flag = flags.FLAGS["config"]
  config_arg = config_flags.get_config_filename(flag)
  swept = load_sweep(config_arg, _SWEEP.value)
  names = point_names(swept)
  points = with_flags(swept, config_flags.get_override_values(flag))
  if _LAUNCH.value == "tpu_vm":
    point_configs(_CONFIG.value, points)                 # bad overrides fail here, not there
    print("\n".join(launch_commands(config_arg, points, _WORKDIR.value, _TPU.value, names)))
    return
  run_sweep(_CONFIG.value, points, _WORKDIR.value, names=names,
            title=f"sweep `{_SWEEP.value}` of `{config_arg}`")


if __name__ == "__main__":
  app.run(main)
