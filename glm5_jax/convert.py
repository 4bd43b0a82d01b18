"""Converts between Hugging Face checkpoints and orbax workdirs, sharded on a mesh.

    hf_to_workdir(hf_dir, workdir, mesh=mesh)    # each process reads only its own shards
    workdir_to_hf(workdir, hf_dir, mesh=mesh)    # restored sharded, written tensor by tensor
    quantize_to_hf(hf_dir_or_workdir, int4_dir)  # INT4 HF checkpoint (glm5_jax/hf_int4.py)

    cfg, params = load_model(hf_dir_or_workdir)  # the mains' model, on the first device
    params = load_params(path, cfg, shardings, mesh=mesh)   # into the trainer's shardings

A workdir is what `glm5_jax/orbax_io.py` `save_params` writes
(model_config.json + checkpoints/<step>/state holding {"params": ...}, orbax's
tensorstore OCDBT format); `restore_sharded` restores its params onto any mesh,
each process reading only its shards (docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import os

import jax

from glm5_jax import config as config_lib
from glm5_jax import hf
from glm5_jax import nn as gnn
from glm5_jax import orbax_io
from glm5_jax import quant
from glm5_jax import sharding
from glm5_jax.config import ModelConfig
from glm5_jax.optim.param_groups import QUANT_TARGETS
from glm5_jax.train import workdir as workdir_lib


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


def check_paths(src: str, dst: str) -> None:
  """Refuses a destination equal to or inside its source (a workdir would then find its HF
  copy and load it forever, ignoring later checkpoints), or a source inside it."""
  a, b = os.path.realpath(src), os.path.realpath(dst)
  if a == b or b.startswith(a + os.sep) or a.startswith(b + os.sep):
    where = "is" if a == b else ("is inside" if b.startswith(a + os.sep) else "contains")
    raise ValueError(f"--dst={dst!r} {where} --src={src!r}: write the conversion to a "
                     "directory of its own")


def hf_to_workdir(hf_dir: str, workdir: str, *, mesh=None, rules=None, step: int = 0,
                  **config_overrides) -> str:
  """Writes the HF checkpoint as a workdir, holding the workdir's lock (train/workdir.py)."""
  check_paths(hf_dir, workdir)
  if hf.quantization(hf_dir):
    raise ValueError(f"--src={hf_dir!r} is an INT4 checkpoint (config.json quantization_config: "
                     f"{hf.quantization(hf_dir)}); a workdir holds float weights: convert the "
                     "float checkpoint it came from (the engine serves the INT4 one: "
                     "hf.load_pretrained(path, quantized=True))")
  with (workdir_lib.lock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()):
    cfg, params = hf.load_pretrained(hf_dir, mesh=mesh, rules=rules, **config_overrides)
    return orbax_io.save_params(workdir, cfg, params, step=step)


def restore_sharded(workdir: str, mesh, rules=None) -> tuple[ModelConfig, dict]:
  """(ModelConfig, params) of a workdir's latest step, as global arrays sharded on `mesh`
  (`orbax_io.restore_params`: a partial restore straight into the target shardings)."""
  _, cfg = orbax_io.find_model_config(workdir)
  shapes, specs = gnn.abstract_params(cfg)
  shardings = sharding.param_shardings(specs, mesh, sharding.DEFAULT_RULES if rules is None
                                       else rules)
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
  return cfg, orbax_io.restore_params(workdir, target, what="--src")


def workdir_to_hf(workdir: str, hf_dir: str, *, mesh=None, rules=None,
                  max_shard_bytes: int = 5 * 2**30) -> str:
  check_paths(workdir, hf_dir)
  if mesh is None:
    cfg, params = load_model(workdir)
  else:
    cfg, params = restore_sharded(workdir, mesh, rules)
  hf.save_pretrained(cfg, params, hf_dir, max_shard_bytes=max_shard_bytes)
  return hf_dir


def is_hf_dir(path: str) -> bool:
  return os.path.exists(os.path.join(path, "config.json"))


def model_config_of(path: str, what: str = "checkpoint"):
  """The ModelConfig of a Hugging Face directory or a training workdir, without reading its
  parameters; errors name `what`."""
  try:
    if is_hf_dir(path):
      return hf.read_config(path)
    return orbax_io.find_model_config(path)[1]
  except (FileNotFoundError, ValueError) as e:
    raise ValueError(f"{what}={path!r}: {e}") from None


def load_params(path: str, cfg, shardings, *, mesh=None, rules=None,
                what: str = "config.init_from", solo: bool = False):
  """The parameters of a Hugging Face directory or a workdir's latest (or given) step, read
  straight into `shardings` (a tree of NamedShardings for `cfg`'s parameters): each process
  reads only the slices its devices hold. `cfg` must be the model `path` holds. `solo`:
  this process alone reads (as in `manager`; a training workdir only)."""
  if is_hf_dir(path):
    if solo and jax.process_count() > 1:
      raise ValueError(f"{what}={path!r}: a Hugging Face directory is read by every process "
                       "of the cluster; a trainer alone in its cluster (config.rl.backend="
                       "'distributed') starts from a training workdir: convert it first "
                       "(python -m experiments.convert_checkpoint)")
    int4 = hf.quantization(path)
    if int4:
      raise ValueError(f"{what}={path!r} is an INT4 checkpoint (config.json quantization_config: "
                       f"{int4}), not float weights: start from the float checkpoint it was "
                       "quantized from, or write a float copy (hf.load_pretrained(path, "
                       "dequantize=True), then hf.save_pretrained)")
    got, params = hf.load_pretrained(path, mesh=mesh, rules=rules)
    diff = config_lib.model_diff(config_lib.model_fields(got), config_lib.model_fields(cfg))
    if diff:
      raise ValueError(f"{what}={path!r} holds another model (field: (there, here)): {diff}")
    return jax.tree.map(lambda x, sh: jax.device_put(x, sh), params, shardings)
  shapes, _ = gnn.abstract_params(cfg)
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
  try:
    return orbax_io.restore_params(path, target, what=what, solo=solo)
  except FileNotFoundError as e:
    raise ValueError(str(e)) from None


def load_model(path: str, what: str = "checkpoint"):
  """(ModelConfig, params) from a Hugging Face directory or a pretraining workdir.

  A workdir (or one of its `checkpoints/<step>` dirs) gives its latest (or that)
  step's params, placed on the first device.
  """
  cfg = model_config_of(path, what)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shapes, _ = gnn.abstract_params(cfg)
  return cfg, load_params(path, cfg, jax.tree.map(lambda _: device, shapes), what=what)


QUANTIZE_FORMATS = ("int4",)          # what an HF checkpoint stores quantized (hf_int4.py)


def quantize_to_hf(src: str, dst: str, *, quantize: str = "int4", targets: str = "experts",
                   group_size: int = 32, mesh=None, rules=None,
                   max_shard_bytes: int = 5 * 2**30) -> str:
  """Writes the float checkpoint `src` (an HF directory or a workdir) as an INT4 HF directory.

  The weights of the target group `targets` (optim/param_groups.QUANT_TARGETS) are quantized
  by `quant.quantize_tree` with `group_size` values per scale: the quantizer INT4 QAT trains
  through (`config.qat`), so a QAT model's INT4 checkpoint holds bitwise the weights its
  training forward used. Errors name the flag (--quantize, --quantize_targets,
  --quantize_group_size, --src) before any weight is read.
  """
  check_paths(src, dst)
  if quantize not in QUANTIZE_FORMATS:
    raise ValueError(f"--quantize={quantize!r}: expected one of {QUANTIZE_FORMATS}")
  if targets not in QUANT_TARGETS:
    raise ValueError(f"--quantize_targets={targets!r}: expected one of {tuple(QUANT_TARGETS)}")
  if is_hf_dir(src) and hf.quantization(src):
    raise ValueError(f"--src={src!r} is already quantized (config.json quantization_config: "
                     f"{hf.quantization(src)}); quantize the float checkpoint it came from")
  cfg = model_config_of(src, "--src")
  scheme = quant.Scheme(quantize, group_size, targets)
  try:
    quant.check_tree(gnn.abstract_params(cfg)[0], scheme)
  except ValueError as e:
    raise ValueError(f"--quantize_group_size={group_size!r} (--quantize_targets={targets}): "
                     f"{e}") from None
  if is_hf_dir(src):
    cfg, params = hf.load_pretrained(src, mesh=mesh, rules=rules)
  elif mesh is None:
    cfg, params = load_model(src, what="--src")
  else:
    cfg, params = restore_sharded(src, mesh, rules)
  params = jax.jit(quant.quantize_tree, static_argnums=1)(params, scheme)
  hf.save_pretrained(cfg, params, dst, max_shard_bytes=max_shard_bytes)
  return dst
