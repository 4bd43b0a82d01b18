"""Helpers shared by config files (big_vision style `get_config(arg)`)."""

from __future__ import annotations

import ml_collections


def add_runtime(c: ml_collections.ConfigDict, *, num_devices: int = 0,
                peak_tflops: float = 989.0) -> ml_collections.ConfigDict:
  """The fields every training stage's runner reads (glm5_jax/train/loop.py): the mesh over
  the first `num_devices` devices (0 = all), its logical-axis rules, jax.distributed,
  gradient accumulation, profiling and the peak FLOP/s for MFU."""
  c.peak_tflops = peak_tflops             # per chip, for MFU (H100/H200 bf16 dense)
  c.microbatches = 1                      # gradient accumulation: the batch split in this many
  c.profile_steps = ()                    # '(10, 13)': a jax.profiler trace of steps 10..12
                                          # in WORKDIR/profile; () = none
  # Mesh sizes (one -1 = the rest of the devices) and the logical-axis rules, over the first
  # num_devices devices (0 = all; the main job keeps its other CPU device for RL rollouts).
  c.num_devices = num_devices
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "context": 1, "expert": 1,
                                      "tensor": 1})
  c.mesh_rules = ml_collections.FieldReference(None, field_type=list)
  # Where Muon's Newton–Schulz runs under the mesh (glm5_jax/optim/muon_owner.py): "owner",
  # each matrix whole on one device, reached by one all-to-all per shape bucket; or
  # "replicated", on the sharded matrices as they are (all-reduces per NS step). Same
  # optimizer state: a run may switch at a resume.
  c.muon_distribution = "owner"
  c.distributed = ml_collections.ConfigDict({
      "coordinator_address": "", "num_processes": 0, "process_id": -1, "cpu_collectives": False})
  # A workdir remembers the fields that define its run (glm5_jax/train/workdir.py); True
  # continues it with changed ones on purpose.
  c.allow_changed_run = False
  return c


def add_rollout_precision(r: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """An RL section's rollout-engine precision and rollout routing replay (GLM-5 §3 runs its
  rollouts in FP8; glm5_jax/inference/precision.py). Every RL metric stream measures the gap
  it opens: |dlogp|, the IcePop-masked fraction, DSA top-k and MoE routing mismatch rates."""
  r.rollout_weight_dtype = "float32"      # float32 | bfloat16 | float8_e4m3fn | int4
  r.rollout_kv_dtype = "float32"          # the latent KV cache: float32 | bfloat16 | float8_e4m3fn
  r.rollout_quant_targets = ""            # "" = the format's default (FP8: all_linear, INT4: experts)
  r.rollout_quant_block = 0               # 0 = the format's default (FP8 128 x 128, INT4 groups of 32)
  r.rollout_indexer_dtype = "same"        # "float32": the indexer keeps the trainer's precision
  # Rollout routing replay (R3): the trainer's MoE layers use the experts the engine routed
  # each token to (the routing weights still the trainer's own).
  r.routing_replay = False
  return r


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'k1=v1,k2=v2' into a ConfigDict, typed by `defaults`; unknown keys fail.

  Example: `--config=configs/model_summary.py:model=glm5`.
  """
  out = ml_collections.ConfigDict(defaults)
  if not arg:
    return out
  for item in arg.split(","):
    if "=" not in item:
      raise ValueError(f"config argument {item!r}: expected key=value (known keys: "
                       f"{sorted(defaults)})")
    k, v = item.split("=", 1)
    if k not in defaults:
      raise ValueError(f"config argument {k!r} is unknown; expected one of {sorted(defaults)}")
    d = defaults[k]
    if isinstance(d, bool):
      if v not in ("True", "False", "true", "false", "1", "0"):
        raise ValueError(f"config argument {k}={v!r}: expected True or False")
      out[k] = v in ("True", "true", "1")
    else:
      out[k] = type(d)(v)
  return out


# Sweeps (big_vision style, next to `get_config`): a config file's module-level
# `SWEEPS = {name: [overrides, ...]}` lists points, each a dict of config fields to set (dotted
# for nested ones: "model.mtp_num_steps"); `python -m experiments.sweep` runs one training per
# point (docs/sweeps.md). These two helpers build the lists.


def _as_sweep(part, what: str) -> list[dict]:
  if isinstance(part, dict):                    # one point (settings every point shares)
    return [dict(part)]
  if isinstance(part, (list, tuple)) and all(isinstance(p, dict) for p in part):
    return [dict(p) for p in part]
  raise ValueError(f"{what}: expected a sweep (a list of override dicts) or one override "
                   f"dict, got {part!r}")


def _parts(fn: str, sweeps, fields) -> list[list[dict]]:
  parts = [_as_sweep(s, f"{fn}() argument {i}") for i, s in enumerate(sweeps)]
  for k, values in fields.items():
    if not isinstance(values, (list, tuple, range)):
      raise ValueError(f"{fn}({k}={values!r}): expected a list of values for config.{k}")
    parts.append([{k: v} for v in values])
  return parts


def _merge(points: tuple[dict, ...], fn: str) -> dict:
  out = {}
  for p in points:
    for k, v in p.items():
      if k in out:
        raise ValueError(f"{fn}(): config.{k} is set by two of its arguments "
                         f"({out[k]!r} and {v!r})")
      out[k] = v
  return out


def product(*sweeps, **fields) -> list[dict]:
  """Every combination of one point from each argument, the last varying fastest.

  Each positional argument is a sweep (a list of override dicts) or one override dict (fields
  every point shares); each keyword `field=[values]` is the sweep `[{field: v} ...]`
  (nested fields: `**{"model.mtp_num_steps": [1, 3]}`).

    product(optimizer=["adamw", "muon"], seed=[0, 1])
    -> [{"optimizer": "adamw", "seed": 0}, {"optimizer": "adamw", "seed": 1},
        {"optimizer": "muon", "seed": 0}, {"optimizer": "muon", "seed": 1}]
  """
  out = [{}]
  for part in _parts("product", sweeps, fields):
    out = [_merge((a, b), "product") for a in out for b in part]
  return out


def zip_(*sweeps, **fields) -> list[dict]:
  """Points taken together: the i-th point of every argument (all of one length; a single
  override dict joins every point).

    zip_(optimizer=["adamw", "muon"], learning_rate=[1e-2, 3e-2])
    -> [{"optimizer": "adamw", "learning_rate": 0.01},
        {"optimizer": "muon", "learning_rate": 0.03}]
  """
  parts = _parts("zip_", sweeps, fields)
  n = max((len(p) for p in parts), default=0)
  if any(len(p) not in (1, n) for p in parts):
    raise ValueError(f"zip_(): its arguments have {[len(p) for p in parts]} points; expected "
                     "equal numbers (or one point, which joins every point)")
  return [_merge(tuple(p[0] if len(p) == 1 else p[i] for p in parts), "zip_")
          for i in range(n)]
