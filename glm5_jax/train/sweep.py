"""Sweeps: one training run per point of a config file's sweep, and each point's results.

A config file defines its sweeps next to `get_config` (big_vision style): a module-level
`SWEEPS = {name: [overrides, ...]}`, each point a dict of config fields (dotted for nested
ones), built with `configs.common.product` / `zip_`. Flag overrides (`with_flags`) apply to
every point, over the point's own overrides (e.g. `--config.total_steps=20` for a trial),
except on a field the sweep varies (an error). `run_sweep` runs the points one after another
in this process with `glm5_jax.train.run`, each in WORKDIR/<point name> (the overrides that
vary over the sweep, e.g. `optimizer=adamw,seed=0`); run again, it resumes an unfinished point
and skips a finished one (its metrics.jsonl holds the held-out loss of step total_steps), and
returns every point's `summarize`d results (`group_by_seed`: mean ± std over seeds).
`experiments/sweep.py` is the command line; experiments/sweep_report.py writes the table and
the figure.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import time

from absl import logging
import ml_collections
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


def varying(points: list[dict]) -> list[str]:
  """The keys whose value differs between points (every key when none does)."""
  keys = list(dict.fromkeys(k for p in points for k in p))
  return [k for k in keys if len({repr(p.get(k)) for p in points}) > 1] or keys


def _label(overrides: dict, keys: list[str], default: str) -> str:
  return ",".join(f"{k}={_name_value(overrides[k])}" for k in keys if k in overrides) or default


def point_names(points: list[dict]) -> list[str]:
  """A readable, unique directory name per point: `key=value,...` over the keys whose
  value varies over the sweep (every key when there is one point), in the points' order."""
  keys = varying(points)
  names = [_label(p, keys, "default") for p in points]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ValueError(f"sweep points {dup} appear more than once (two points with the same "
                     "overrides)")
  return names


def with_flags(points: list[dict], flag_overrides: dict) -> list[dict]:
  """The points with the command line's `--config.X` values on top (they set what the sweep
  holds constant, e.g. fewer steps for a trial); a flag on a field the sweep varies would
  make points equal, and is a ValueError."""
  varied = set(varying(points)) if len(points) > 1 else set()
  clash = sorted(varied & set(flag_overrides))
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


def run_sweep(config, points: list[dict], workdir: str, *, run=train.run,
              names: list[str] | None = None) -> list[dict]:
  """Trains every point not yet finished (`run(config, workdir)`) and returns each point's
  summary (`summarize`). `names`: the points' directory names (default `point_names(points)`)."""
  names, configs = names or point_names(points), point_configs(config, points)
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
  return [summarize(os.path.join(workdir, n), n, p) for n, p in zip(names, points)]


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
    groups.setdefault(group_of(r, results), []).append(r)
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


def group_of(r: dict, results: list[dict]) -> str:
  """A point's seed group: its varying overrides but the seed."""
  keys = [k for k in varying([x["overrides"] for x in results]) if k != "seed"]
  return _label(r["overrides"], keys, "all")


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
