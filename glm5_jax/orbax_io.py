"""Parameter trees in orbax workdirs: written, read back into any shardings, checked.

A workdir written by `save_params` (or a training run) holds `WORKDIR/model_config.json`
(the model's shape: `check_model_config` refuses a workdir of another model) and
`WORKDIR/checkpoints/<step>/state` ({"params": ...} or a whole TrainState, orbax's
tensorstore OCDBT format). `restore_params` reads the params of its latest (or a given) step
straight into target shardings, each process reading only its own slices. A step that
cannot be read back (a truncated or missing file) is a `CorruptCheckpoint` naming the file,
in one line (`read_step`). The training state's manager is glm5_jax/train/checkpoint.py;
loading a model from either kind of checkpoint, glm5_jax/convert.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging as std_logging
import os
import sys

from etils import epath
import jax
import orbax.checkpoint as ocp

from glm5_jax import config as config_lib

class CorruptCheckpoint(ValueError):
  """A checkpoint step that cannot be read back (a truncated or missing file)."""


def root_cause(e: BaseException) -> str:
  """The innermost message of an exception chain, on one line (orbax wraps tensorstore's
  error, which names the file, in pages of its spec)."""
  msgs = []
  while e is not None and len(msgs) < 10:
    msgs.append(f"{type(e).__name__}: {str(e).strip()}")
    e = e.__cause__ or e.__context__
  named = [m for m in msgs if "file" in m] or msgs
  return " ".join(named[-1].split(" [tensorstore_spec=")[0].split())[:400]


def _is_aftermath(exc) -> bool:
  """What a failed orbax read leaves behind once it has raised: tensorstore callbacks into
  the closed asyncio loop of the read, and its other reads' errors (never retrieved, or
  raised in a coroutine closed at garbage collection), which name tensorstore."""
  return ((isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")
          or (type(exc) in (ValueError, Exception) and "tensorstore" in str(exc).lower()))


class _DropAftermath(std_logging.Filter):

  def filter(self, record) -> bool:
    return not (record.exc_info and _is_aftermath(record.exc_info[1]))


def mute_aftermath() -> None:
  """Keeps the traceback pages that a failed checkpoint read prints after it has raised
  (from tensorstore threads, and at garbage collection) out of the log: the failure is
  reported once, in one line, by `read_step`'s caller. Only those messages are dropped."""
  asyncio_log = std_logging.getLogger("asyncio")
  if not any(isinstance(f, _DropAftermath) for f in asyncio_log.filters):
    asyncio_log.addFilter(_DropAftermath())
  previous = sys.unraisablehook
  if getattr(previous, "drops_checkpoint_aftermath", False):
    return

  def hook(unraisable):
    if not _is_aftermath(unraisable.exc_value):
      previous(unraisable)
  hook.drops_checkpoint_aftermath = True
  sys.unraisablehook = hook


def _check_files(step_dir: str) -> None:
  """Raises CorruptCheckpoint naming the first JSON file of `step_dir` that does not parse
  (orbax's own error names none) or a missing `state/` / commit marker."""
  for sub in ("state", "state/_METADATA"):
    if not os.path.exists(os.path.join(step_dir, sub)):
      raise CorruptCheckpoint(f"{os.path.join(step_dir, sub)} is missing")
  for root, _, files in os.walk(step_dir):
    for f in files:
      path = os.path.join(root, f)
      if f.endswith(".json") or f in ("_METADATA", "_CHECKPOINT_METADATA", "_sharding"):
        try:
          with open(path) as fh:
            json.load(fh)
        except (ValueError, OSError) as e:
          raise CorruptCheckpoint(f"{path}: {type(e).__name__}: {e}") from None


def read_step(step_dir: str, fn):
  """`fn()` (a restore of the checkpoint in `step_dir`), its failure as CorruptCheckpoint
  with one line naming the file."""
  _check_files(step_dir)
  mute_aftermath()
  try:
    return fn()
  except CorruptCheckpoint:
    raise
  except Exception as e:  # pylint: disable=broad-except  (tensorstore raises bare Exception)
    raise CorruptCheckpoint(f"{step_dir}: {root_cause(e)}") from None


def tree_of(meta):
  """The tree of orbax's tree metadata (older orbax returns the tree itself)."""
  return meta.tree if hasattr(meta, "tree") else meta


def multiprocessing_options(solo: bool = False) -> ocp.options.MultiprocessingOptions:
  """Orbax's processes: all of them, or with `solo` this process alone (its arrays live on
  its own devices; its cluster's other processes do other work)."""
  if not solo or jax.process_count() == 1:
    return ocp.options.MultiprocessingOptions()
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                            barrier_sync_key_prefix=f"solo{me}")


def find_model_config(path: str) -> tuple[str, config_lib.ModelConfig]:
  """(workdir, ModelConfig) from the model_config.json in `path` or a directory above it."""
  workdir = os.path.abspath(path)
  while workdir != "/" and not os.path.exists(os.path.join(workdir, "model_config.json")):
    workdir = os.path.dirname(workdir)
  if workdir == "/":
    raise FileNotFoundError(f"{path!r}: no model_config.json in it or above it; expected a "
                            "training workdir (or one written by experiments.convert_checkpoint)")
  with open(os.path.join(workdir, "model_config.json")) as f:
    return workdir, config_lib.ModelConfig(**json.load(f))


def check_model_config(workdir: str, cfg) -> None:
  """Writes WORKDIR/model_config.json, or refuses a workdir of a different model shape."""
  path = os.path.join(workdir, "model_config.json")
  now = config_lib.model_fields(cfg)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    # A field added to ModelConfig after the workdir was written, at its default, is the
    # same model.
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    old = {**{k: v for k, v in now.items() if k not in old and v == defaults.get(k)}, **old}
    diff = config_lib.model_diff(old, now)
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


def latest_step_dir(workdir_or_ckpt: str, what: str) -> str:
  """`.../checkpoints/<step>` of a workdir's latest step (or the step dir given)."""
  path = os.path.abspath(workdir_or_ckpt)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  if os.path.basename(path) == "checkpoints":
    steps = sorted(int(d) for d in os.listdir(path) if d.isdigit())
    if not steps:
      raise FileNotFoundError(f"{what}={workdir_or_ckpt!r}: no checkpoints found")
    path = os.path.join(path, str(max(steps)))
  if not os.path.isdir(os.path.join(path, "state")):
    raise FileNotFoundError(f"{what}={workdir_or_ckpt!r}: {os.path.join(path, 'state')} does "
                            "not exist")
  return path


def restore_params(workdir_or_ckpt: str, abstract_params, what: str = "config.init_from",
                   solo: bool = False):
  """Params only, from a run's latest checkpoint (or a `.../checkpoints/<step>` dir), read
  straight into the shardings of `abstract_params` (a partial restore: the other run's
  optimizer state, whatever its structure, is never read). `solo`: as in `manager`."""
  step_dir = latest_step_dir(workdir_or_ckpt, what)
  state_dir = os.path.join(step_dir, "state")

  item = {"params": abstract_params}
  try:
    mp = multiprocessing_options(solo)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=mp),
                          multiprocessing_options=mp) as ckptr:
      # The handler's metadata raises on an unreadable tree (the checkpointer's logs two
      # warnings and returns None).
      meta = read_step(step_dir, lambda: ocp.PyTreeCheckpointHandler().metadata(
          epath.Path(state_dir)))
      _check_same_shapes(tree_of(meta)["params"], abstract_params, f"{what}={workdir_or_ckpt!r}")
      return read_step(step_dir, lambda: ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
          item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True)))["params"]
  except CorruptCheckpoint as e:
    raise CorruptCheckpoint(f"{what}={workdir_or_ckpt!r}: checkpoint unreadable: {e}") from None


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
