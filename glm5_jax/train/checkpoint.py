"""orbax checkpoints holding everything needed to continue exactly.

`WORKDIR/checkpoints/<step>/` holds the TrainState (params, optimizer state,
step, RNG) and the grain iterator state; `WORKDIR/model_config.json` records
the model shape so that a workdir of a different model is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal

from absl import logging
import grain
import jax
import orbax.checkpoint as ocp


class _QuietOrbax:
  """Drops orbax's INFO chatter (dozens of lines per save) from the absl log."""

  def filter(self, record) -> bool:
    return record.levelno >= 30 or "orbax" not in record.pathname


def quiet_orbax():
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _QuietOrbax) for f in handler.filters):
    handler.addFilter(_QuietOrbax())


def manager(workdir: str, *, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
  opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                      enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), "checkpoints"), options=opts,
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "data": grain.checkpoint.CheckpointHandler()})


def save(mngr: ocp.CheckpointManager, step: int, state, data_iter, *, force: bool = False) -> bool:
  return mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iter)),
                   force=force)


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state, data_iter):
  """Restores (state placed like `abstract_state`, and `data_iter` in place)."""
  out = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      data=grain.checkpoint.CheckpointRestore(data_iter)))
  return out["state"]


def restore_params(workdir_or_ckpt: str, abstract_params):
  """Params only, from a run's latest checkpoint (or a `.../checkpoints/<step>` dir)."""
  path = os.path.abspath(workdir_or_ckpt)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  if os.path.basename(path) == "checkpoints":
    steps = sorted(int(d) for d in os.listdir(path) if d.isdigit())
    if not steps:
      raise FileNotFoundError(f"config.init_from={workdir_or_ckpt!r}: no checkpoints found")
    path = os.path.join(path, str(max(steps)))
  state_dir = os.path.join(path, "state")
  if not os.path.isdir(state_dir):
    raise FileNotFoundError(f"config.init_from={workdir_or_ckpt!r}: {state_dir} does not exist")
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(state_dir)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    _check_same_shapes(tree["params"], abstract_params, f"config.init_from={workdir_or_ckpt!r}")
    # The other run's optimizer state may have another structure (another stage's
    # mask): restore the item as saved and keep only its params.
    restored = ckptr.restore(state_dir)
  return jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), restored["params"],
                      abstract_params)


def _check_same_shapes(saved, abstract, what: str):
  flat_s = {jax.tree_util.keystr(p): tuple(v.shape)
            for p, v in jax.tree_util.tree_flatten_with_path(saved)[0]}
  flat_a = {jax.tree_util.keystr(p): tuple(v.shape)
            for p, v in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  if flat_s != flat_a:
    diff = sorted(set(flat_s.items()) ^ set(flat_a.items()))[:8]
    hint = ("; it holds one `layers_{i}` tree per decoder layer, the layout before the layers "
            "were scanned (glm5_jax/nn/layer_stack.py): re-run that stage with this version"
            if any(k.startswith("['layers_") for k in flat_s) else "")
    raise ValueError(f"{what}: the checkpoint's parameters differ from this model: {diff}{hint}")


_HOW_NOT_WHAT = ("attention_type", "attention_impl", "attention_chunk_size", "remat", "dtype",
                 "expert_dispatch")      # how a model runs, not which model it is


def model_fields(cfg) -> dict:
  """The ModelConfig fields that define the model (JSON-ready)."""
  return json.loads(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items()
                                if k not in _HOW_NOT_WHAT}))


def model_diff(old: dict, now: dict) -> dict:
  """{field: (old, now)} where two `model_fields` differ."""
  return {k: (old.get(k), now.get(k)) for k in set(old) | set(now) if old.get(k) != now.get(k)}


class SigtermFlag:
  """Sets `.hit` on SIGTERM so a training loop can checkpoint and stop cleanly."""

  def __init__(self):
    self.hit = False
    try:
      self._old = signal.signal(signal.SIGTERM, self._handler)
    except ValueError:                                 # not in the main thread
      self._old = None

  def _handler(self, *_):
    logging.warning("SIGTERM: checkpointing and stopping")
    self.hit = True

  def restore(self):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


def check_model_config(workdir: str, cfg) -> None:
  """Writes WORKDIR/model_config.json, or refuses a workdir of a different model shape."""
  path = os.path.join(workdir, "model_config.json")
  now = model_fields(cfg)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    diff = model_diff(old, now)
    if diff:
      raise ValueError(f"workdir {workdir!r} holds a run of a different model "
                       f"(field: (saved, now)): {diff}; use a new --workdir or "
                       "--config.init_from to start from its weights")
    return
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w") as f:
      json.dump(now, f, indent=2)


def state_manager(workdir: str, *, keep: int | None = None) -> ocp.CheckpointManager:
  """A manager of WORKDIR/checkpoints/<step>/state alone (no data iterator: RL, saved
  params)."""
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"),
                               options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                                    create=True),
                               item_handlers={"state": ocp.StandardCheckpointHandler()})


def save_params(workdir: str, cfg, params, *, step: int = 0) -> str:
  """Writes `params` as a workdir that `load_model`, `init_from` and RL's `init_from` /
  `distill.teacher` read (model_config.json + checkpoints/<step>/state). Returns its path."""
  check_model_config(workdir, cfg)
  with state_manager(workdir) as m:
    m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params})),
           force=True)
    m.wait_until_finished()
  return workdir


def load_model(path: str):
  """(ModelConfig, params) from a Hugging Face directory or a pretraining workdir.

  A workdir (or one of its `checkpoints/<step>` dirs) gives its latest (or that)
  step's params, placed on the first device.
  """
  if os.path.exists(os.path.join(path, "config.json")):
    from glm5_jax import hf  # pylint: disable=g-import-not-at-top
    return hf.load_pretrained(path)
  from glm5_jax import nn as gnn  # pylint: disable=g-import-not-at-top
  from glm5_jax.config import ModelConfig  # pylint: disable=g-import-not-at-top
  workdir = os.path.abspath(path)
  while workdir != "/" and not os.path.exists(os.path.join(workdir, "model_config.json")):
    workdir = os.path.dirname(workdir)
  if workdir == "/":
    raise FileNotFoundError(f"{path!r}: no model_config.json in it or above it; expected a "
                            "pretraining workdir")
  with open(os.path.join(workdir, "model_config.json")) as f:
    cfg = ModelConfig(**json.load(f))
  shapes, _ = gnn.abstract_params(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)
  return cfg, restore_params(path, target)
