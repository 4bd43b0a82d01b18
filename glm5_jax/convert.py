"""Converts between Hugging Face checkpoints and orbax workdirs, sharded on a mesh.

    hf_to_workdir(hf_dir, workdir, mesh=mesh)    # each process reads only its own shards
    workdir_to_hf(workdir, hf_dir, mesh=mesh)    # restored sharded, written tensor by tensor

A workdir is what `glm5_jax/train/checkpoint.py` `save_params` writes
(model_config.json + checkpoints/<step>/state holding {"params": ...}, orbax's
tensorstore OCDBT format); `restore_sharded` restores its params onto any mesh,
each process reading only its shards (docs/checkpoints.md).
"""

from __future__ import annotations

import os

import jax

from glm5_jax import hf
from glm5_jax import nn as gnn
from glm5_jax import sharding
from glm5_jax.config import ModelConfig
from glm5_jax.train import checkpoint


def parse_mesh(text: str) -> dict[str, int]:
  """Parses `expert=8,fsdp=-1` into {"expert": 8, "fsdp": -1} (axes: sharding.MESH_AXES)."""
  sizes = {}
  for item in filter(None, text.split(",")):
    name, _, size = item.partition("=")
    if name not in sharding.MESH_AXES or not size.lstrip("-").isdigit():
      raise ValueError(f"--mesh item {item!r}: expected AXIS=SIZE with AXIS in "
                       f"{sharding.MESH_AXES}")
    sizes[name] = int(size)
  return sizes


def hf_to_workdir(hf_dir: str, workdir: str, *, mesh=None, rules=None, step: int = 0,
                  **config_overrides) -> str:
  cfg, params = hf.load_pretrained(hf_dir, mesh=mesh, rules=rules, **config_overrides)
  return checkpoint.save_params(workdir, cfg, params, step=step)


def restore_sharded(workdir: str, mesh, rules=None) -> tuple[ModelConfig, dict]:
  """(ModelConfig, params) of a workdir's latest step, as global arrays sharded on `mesh`
  (`checkpoint.restore_params`: a partial restore straight into the target shardings)."""
  _, cfg = checkpoint.find_model_config(workdir)
  shapes, specs = gnn.abstract_params(cfg)
  shardings = sharding.param_shardings(specs, mesh, sharding.DEFAULT_RULES if rules is None
                                       else rules)
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
  return cfg, checkpoint.restore_params(workdir, target, what="--src")


def workdir_to_hf(workdir: str, hf_dir: str, *, mesh=None, rules=None,
                  max_shard_bytes: int = 5 * 2**30) -> str:
  if mesh is None:
    cfg, params = checkpoint.load_model(workdir)
  else:
    cfg, params = restore_sharded(workdir, mesh, rules)
  hf.save_pretrained(cfg, params, hf_dir, max_shard_bytes=max_shard_bytes)
  return hf_dir


def is_hf_dir(path: str) -> bool:
  return os.path.exists(os.path.join(path, "config.json"))
