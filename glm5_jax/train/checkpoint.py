"""orbax checkpoints of a training run, holding everything needed to continue exactly.

`WORKDIR/checkpoints/<step>/` holds the TrainState (params, optimizer state,
step, RNG) and the grain iterator state; `WORKDIR/model_config.json` records
the model shape so that a workdir of a different model is refused. A corrupt latest step
(a truncated or missing file) is reported in one line and the previous one is used
(`restore_latest`). Params alone (saved, or read into target shardings) are
glm5_jax/orbax_io.py's; `load_model` (re-exported here) is glm5_jax/convert.py's.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from absl import logging
import grain
import jax
import orbax.checkpoint as ocp

from glm5_jax import orbax_io
from glm5_jax.convert import load_model  # pylint: disable=unused-import  (its former home)


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


def manager(workdir: str, *, keep: int, async_save: bool = True,
            items: dict | None = None, solo: bool = False) -> ocp.CheckpointManager:
  """The manager of WORKDIR/checkpoints/<step>/{state, ...}: the TrainState plus `items`
  ({name: orbax handler}; default the grain iterator as "data"). `solo`: this process alone
  saves and restores (its state lives on its own devices; the cluster's other processes
  serve rollouts), so orbax's barriers involve no other process."""
  check_keep(keep)
  mp = orbax_io.multiprocessing_options(solo)
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
  orbax_io.mute_aftermath()   # tensorstore's callbacks into a failed write's closed event loop
  try:
    yield
  except SaveFailed:
    raise
  except Exception as e:  # pylint: disable=broad-except
    cause, chain, x = orbax_io.root_cause(e), [], e
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


def _saved_tree(mngr, step: int):
  return orbax_io.tree_of(mngr.item_metadata(step)["state"])


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
      saved = orbax_io.read_step(step_dir, lambda step=step: _saved_tree(mngr, step))
      if _tree_paths(saved) != _tree_paths(abstract_state):
        diff = sorted(_tree_paths(saved) ^ _tree_paths(abstract_state))
        raise ValueError(
            f"{step_dir}: the saved training state does not fit {what} ({len(diff)} paths "
            f"differ, e.g. {diff[:3]}); this workdir was trained with another stage or "
            "optimizer: use a new --workdir with --config.init_from pointing at this one")
      out = orbax_io.read_step(step_dir, lambda step=step: restore(mngr, step, abstract_state,
                                                          data_iter, items))
      return step, (out if items is not None else out["state"])
    except orbax_io.CorruptCheckpoint as e:
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


