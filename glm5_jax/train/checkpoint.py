"""orbax checkpoints holding everything needed to continue exactly.

`WORKDIR/checkpoints/<step>/` holds the TrainState (params, optimizer state,
step, RNG) and the grain iterator state; `WORKDIR/model_config.json` records
the model shape so that a workdir of a different model is refused. A corrupt latest step
(a truncated or missing file) is reported in one line and the previous one is used
(`restore_latest`); `restore_params` reads params alone, into their target shardings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging as std_logging
import os
import shutil
import sys

from absl import logging
from etils import epath
import grain
import jax
import orbax.checkpoint as ocp


_DISK_FULL = ("No space left on device", "os_error_code='28'")


def _disk_full(text: str) -> bool:
  return any(m in text for m in _DISK_FULL)


class _QuietOrbax:
  """Drops orbax's INFO chatter (dozens of lines per save) from the absl log, and the pages
  of tracebacks its background threads log for a save that found the disk full: that error
  reaches the training loop, which reports it in one line (`saving`)."""

  def filter(self, record) -> bool:
    if "orbax" not in record.pathname:
      return True
    if record.levelno < 30:
      return False
    exc = record.exc_info[1] if record.exc_info else None
    return not _disk_full(record.getMessage() + (repr(exc) if exc else ""))


def quiet_orbax():
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _QuietOrbax) for f in handler.filters):
    handler.addFilter(_QuietOrbax())


def check_keep(keep, field: str = "config.keep_checkpoints") -> None:
  """orbax keeps every checkpoint for None and deletes every one for 0: neither is meant."""
  if not isinstance(keep, int) or keep < 1:
    raise ValueError(f"{field}={keep!r}: expected an integer >= 1 (the newest checkpoints "
                     "kept; the one a run resumes from is among them)")


def check_run_fields(c, counts: tuple[str, ...]) -> None:
  """The fields every training loop shares: `counts` (integers >= 1), keep_checkpoints,
  learning_rate >= 0 and a seed in [0, 2**31); errors name the field."""
  for f in counts:
    if not isinstance(c[f], int) or isinstance(c[f], bool) or c[f] < 1:
      raise ValueError(f"config.{f}={c[f]!r}: expected an integer >= 1")
  check_keep(c.keep_checkpoints)
  if not c.learning_rate >= 0:
    raise ValueError(f"config.learning_rate={c.learning_rate}: expected >= 0")
  if not isinstance(c.seed, int) or not 0 <= c.seed < 2**31:
    raise ValueError(f"config.seed={c.seed!r}: expected an integer in [0, 2**31)")


def find_model_config(path: str) -> tuple[str, "ModelConfig"]:  # noqa: F821
  """(workdir, ModelConfig) from the model_config.json in `path` or a directory above it."""
  from glm5_jax.config import ModelConfig  # pylint: disable=g-import-not-at-top
  workdir = os.path.abspath(path)
  while workdir != "/" and not os.path.exists(os.path.join(workdir, "model_config.json")):
    workdir = os.path.dirname(workdir)
  if workdir == "/":
    raise FileNotFoundError(f"{path!r}: no model_config.json in it or above it; expected a "
                            "training workdir (or one written by experiments.convert_checkpoint)")
  with open(os.path.join(workdir, "model_config.json")) as f:
    return workdir, ModelConfig(**json.load(f))


def multiprocessing_options(solo: bool = False) -> ocp.options.MultiprocessingOptions:
  """Orbax's processes: all of them, or with `solo` this process alone (its arrays live on
  its own devices; its cluster's other processes do other work)."""
  if not solo or jax.process_count() == 1:
    return ocp.options.MultiprocessingOptions()
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                            barrier_sync_key_prefix=f"solo{me}")


def manager(workdir: str, *, keep: int, async_save: bool = True,
            items: dict | None = None, solo: bool = False) -> ocp.CheckpointManager:
  """The manager of WORKDIR/checkpoints/<step>/{state, ...}: the TrainState plus `items`
  ({name: orbax handler}; default the grain iterator as "data"). `solo`: this process alone
  saves and restores (its state lives on its own devices; the cluster's other processes
  serve rollouts), so orbax's barriers involve no other process."""
  check_keep(keep)
  mp = multiprocessing_options(solo)
  root = os.path.join(os.path.abspath(workdir), "checkpoints")
  if mp.active_processes is not None:
    os.makedirs(root, exist_ok=True)          # orbax creates it only with every process
  opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=mp.active_processes is None,
                                      enable_async_checkpointing=async_save,
                                      multiprocessing_options=mp)
  items = {"data": grain.checkpoint.CheckpointHandler()} if items is None else items
  return ocp.CheckpointManager(
      root, options=opts,
      item_handlers={"state": ocp.StandardCheckpointHandler(), **items})


def save(mngr: ocp.CheckpointManager, step: int, state, data_iter=None, *, force: bool = False,
         items: dict | None = None) -> bool:
  """Saves the state, the grain iterator (unless None) and `items` ({name: orbax save
  args})."""
  if mngr._options.multiprocessing_options.active_processes is not None:   # pylint: disable=protected-access
    # A solo manager (`manager`): orbax writes no array of one process's devices while the
    # cluster has others (its check against pmap's host-local arrays); its host values
    # instead, read back into the shardings of the restore's target.
    state = jax.device_get(state)
  args = {"state": ocp.args.StandardSave(state), **(items or {})}
  if data_iter is not None:
    args["data"] = grain.checkpoint.CheckpointSave(data_iter)
  return mngr.save(step, args=ocp.args.Composite(**args), force=force)


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state, data_iter, items=None):
  """{"state": state placed like `abstract_state`, name: each of `items` restored} (the
  grain `data_iter` in place unless None)."""
  args = {"state": ocp.args.StandardRestore(abstract_state), **(items or {})}
  if data_iter is not None:                  # None: a state-only manager (RL, saved params)
    args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
  out = mngr.restore(step, args=ocp.args.Composite(**args))
  return {k: out[k] for k in args if k != "data"}


class SaveFailed(SystemExit):
  """A checkpoint could not be written (disk full, permissions): exits 1 with one line
  naming the path and the error; the checkpoints saved before are intact."""


@contextlib.contextmanager
def saving(mngr: ocp.CheckpointManager, workdir: str):
  """Turns a failed save (also one that failed in orbax's background thread and surfaces in
  a later call: the next save, a wait, close) into `SaveFailed`; removes the unfinished
  step directory, so that the space it took is free again."""
  _mute_aftermath()       # tensorstore's callbacks into a failed write's closed event loop
  try:
    yield
  except SaveFailed:
    raise
  except Exception as e:  # pylint: disable=broad-except
    cause, chain, x = _root_cause(e), [], e
    while x is not None and len(chain) < 10:
      chain.append(str(x))
      x = x.__cause__ or x.__context__
    text = " ".join(chain)
    if not (isinstance(e, OSError) or _disk_full(text) or "RESOURCE_EXHAUSTED" in text):
      raise
    root = str(mngr.directory)
    partial = [d for d in (os.listdir(root) if os.path.isdir(root) else []) if "tmp" in d]
    for d in partial:
      shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    good = [st for st in (mngr.all_steps() or [])]
    if _disk_full(text):
      cause = "[Errno 28] No space left on device"
    raise SaveFailed(
        f"saving a checkpoint in {root} failed: {cause}. The last good checkpoint "
        f"({max(good) if good else 'none'}) in {workdir} is intact; free space (or use "
        "another --workdir) and rerun to continue from it"
        + (f" (removed the unfinished {partial})" if partial else "")) from None


class CorruptCheckpoint(ValueError):
  """A checkpoint step that cannot be read back (a truncated or missing file)."""


def _root_cause(e: BaseException) -> str:
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


def _mute_aftermath() -> None:
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
  _mute_aftermath()
  try:
    return fn()
  except CorruptCheckpoint:
    raise
  except Exception as e:  # pylint: disable=broad-except  (tensorstore raises bare Exception)
    raise CorruptCheckpoint(f"{step_dir}: {_root_cause(e)}") from None


def _tree(meta):
  """The tree of orbax's tree metadata (older orbax returns the tree itself)."""
  return meta.tree if hasattr(meta, "tree") else meta


def _saved_tree(mngr, step: int):
  return _tree(mngr.item_metadata(step)["state"])


def _key_name(k) -> str:
  for attr in ("name", "key", "idx"):          # GetAttrKey, DictKey, SequenceKey
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _tree_paths(tree) -> set:
  """Leaf paths as 'a/b/0' (orbax's metadata turns dataclass and namedtuple fields into
  dict keys: only the names are compared)."""
  return {"/".join(_key_name(k) for k in p)
          for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, data_iter=None, *,
                   what: str = "this run's config", items: dict | None = None,
                   solo: bool = False):
  """(step, state) of the newest readable checkpoint, or (None, None) without one.

  A corrupt step (a truncated or missing file) is reported in one log line naming its
  file, moved to WORKDIR/corrupt_checkpoints/<step> (process 0) and the previous one is
  used. A checkpoint whose state has another tree (another stage's frozen mask, another
  optimizer) is a ValueError naming `what`, not corruption. With `items` ({name: orbax
  restore args}), the state is a dict {"state": ..., name: ...}. `solo`: as in `manager`.
  """
  for step in sorted(mngr.all_steps(), reverse=True):
    step_dir = os.path.join(str(mngr.directory), str(step))
    try:
      saved = read_step(step_dir, lambda step=step: _saved_tree(mngr, step))
      if _tree_paths(saved) != _tree_paths(abstract_state):
        diff = sorted(_tree_paths(saved) ^ _tree_paths(abstract_state))
        raise ValueError(
            f"{step_dir}: the saved training state does not fit {what} ({len(diff)} paths "
            f"differ, e.g. {diff[:3]}); this workdir was trained with another stage or "
            "optimizer: use a new --workdir with --config.init_from pointing at this one")
      out = read_step(step_dir, lambda step=step: restore(mngr, step, abstract_state,
                                                          data_iter, items))
      return step, (out if items is not None else out["state"])
    except CorruptCheckpoint as e:
      logging.error("checkpoint step %d is unreadable, using the previous one: %s", step, e)
      _move_aside(mngr, step, solo)
  return None, None


def _move_aside(mngr, step: int, solo: bool) -> None:
  src = os.path.join(str(mngr.directory), str(step))
  if (solo or jax.process_index() == 0) and os.path.exists(src):
    dst = os.path.join(os.path.dirname(str(mngr.directory)), "corrupt_checkpoints", str(step))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.exists(dst):
      shutil.rmtree(dst)
    os.replace(src, dst)
  if jax.process_count() > 1 and not solo:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(f"glm5_corrupt_checkpoint_{step}")
  mngr.reload()


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
      _check_same_shapes(_tree(meta)["params"], abstract_params, f"{what}={workdir_or_ckpt!r}")
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


_HOW_NOT_WHAT = ("attention_type", "attention_impl", "attention_chunk_size", "remat", "dtype",
                 "expert_dispatch", "moe_capacity_factor")  # how a model runs, not which
                                                            # model it is


def model_fields(cfg) -> dict:
  """The ModelConfig fields that define the model (JSON-ready)."""
  return json.loads(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items()
                                if k not in _HOW_NOT_WHAT}))


def model_diff(old: dict, now: dict) -> dict:
  """{field: (old, now)} where two `model_fields` differ."""
  return {k: (old.get(k), now.get(k)) for k in set(old) | set(now) if old.get(k) != now.get(k)}


def check_model_config(workdir: str, cfg) -> None:
  """Writes WORKDIR/model_config.json, or refuses a workdir of a different model shape."""
  path = os.path.join(workdir, "model_config.json")
  now = model_fields(cfg)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    # A field added to ModelConfig after the workdir was written, at its default, is the
    # same model.
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    old = {**{k: v for k, v in now.items() if k not in old and v == defaults.get(k)}, **old}
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


def _is_hf_dir(path: str) -> bool:
  return os.path.exists(os.path.join(path, "config.json"))


def model_config_of(path: str, what: str = "checkpoint"):
  """The ModelConfig of a Hugging Face directory or a training workdir, without reading its
  parameters; errors name `what`."""
  try:
    if _is_hf_dir(path):
      from glm5_jax import hf  # pylint: disable=g-import-not-at-top
      return hf.read_config(path)
    return find_model_config(path)[1]
  except (FileNotFoundError, ValueError) as e:
    raise ValueError(f"{what}={path!r}: {e}") from None


def load_params(path: str, cfg, shardings, *, mesh=None, rules=None,
                what: str = "config.init_from", solo: bool = False):
  """The parameters of a Hugging Face directory or a workdir's latest (or given) step, read
  straight into `shardings` (a tree of NamedShardings for `cfg`'s parameters): each process
  reads only the slices its devices hold. `cfg` must be the model `path` holds. `solo`:
  this process alone reads (as in `manager`; a training workdir only)."""
  from glm5_jax import nn as gnn  # pylint: disable=g-import-not-at-top
  if _is_hf_dir(path):
    if solo and jax.process_count() > 1:
      raise ValueError(f"{what}={path!r}: a Hugging Face directory is read by every process "
                       "of the cluster; a trainer alone in its cluster (config.rl.backend="
                       "'distributed') starts from a training workdir: convert it first "
                       "(python -m experiments.convert_checkpoint)")
    from glm5_jax import hf  # pylint: disable=g-import-not-at-top
    int4 = hf.quantization(path)
    if int4:
      raise ValueError(f"{what}={path!r} is an INT4 checkpoint (config.json quantization_config: "
                       f"{int4}), not float weights: start from the float checkpoint it was "
                       "quantized from, or write a float copy (hf.load_pretrained(path, "
                       "dequantize=True), then hf.save_pretrained)")
    got, params = hf.load_pretrained(path, mesh=mesh, rules=rules)
    diff = model_diff(model_fields(got), model_fields(cfg))
    if diff:
      raise ValueError(f"{what}={path!r} holds another model (field: (there, here)): {diff}")
    return jax.tree.map(lambda x, sh: jax.device_put(x, sh), params, shardings)
  shapes, _ = gnn.abstract_params(cfg)
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
  try:
    return restore_params(path, target, what=what, solo=solo)
  except FileNotFoundError as e:
    raise ValueError(str(e)) from None


def load_model(path: str, what: str = "checkpoint"):
  """(ModelConfig, params) from a Hugging Face directory or a pretraining workdir.

  A workdir (or one of its `checkpoints/<step>` dirs) gives its latest (or that)
  step's params, placed on the first device.
  """
  cfg = model_config_of(path, what)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  from glm5_jax import nn as gnn  # pylint: disable=g-import-not-at-top
  shapes, _ = gnn.abstract_params(cfg)
  return cfg, load_params(path, cfg, jax.tree.map(lambda _: device, shapes), what=what)
