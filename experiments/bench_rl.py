r"""RL benchmarks on N (fake) devices: sharded GRPO steps, weight pushes, the async loop.

  python -m experiments.bench_rl --presets=tiny --out=/tmp/bench_rl.json

Three parts (`--parts`), each a ratio measured in this one run on this machine:

  grpo   GRPO steps (`glm5_jax.rl.orchestration.grpo.run`, random weights, the arithmetic task) on
  one
         device and under each mesh of `--meshes` over all devices: per step rollout,
         recompute and update seconds (medians over `--steps` steps after the first, which
         compiles), rollout and trainer tokens/s, and the mesh's step time over one device's.
  push   one weight push of the preset's parameters from a trainer sharded over the first half
         of the devices to a replica engine on two other devices: device to device, leaf by
         leaf (`weights.DeviceWeights` + `Engine.update_params`), against the host round trip
         (`weights.InProcessWeights`: publish copies every leaf to numpy, the replica pulls
         and places them), medians of `--repeats`.
  async  the asynchronous loop (`glm5_jax.rl.orchestration.async_loop.run`) with the trainer on the
  first
         half of the devices and two rollout replicas on the rest: updates per second after
         the first update, and the train/rollout |dlogp| it measured.

Numbers of fake CPU devices are what this machine's cores give; they show the overheads of
sharding and of the push paths, not accelerator speed.
"""

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # as the RL entry points run
numerics.cpu_devices(8)

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import os
import platform
import tempfile
import time

from absl import app
from absl import flags
import jax
import numpy as np

from configs import rl as rl_config
from configs import rl_async as rl_async_config
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import orbax_io
from glm5_jax import sharding as shd
from glm5_jax.inference import Engine
from glm5_jax.rl.orchestration import async_loop
from glm5_jax.rl.orchestration import grpo
from glm5_jax.rl.orchestration import weights as weights_lib
from glm5_jax.train import metrics as metrics_lib

_PRESETS = flags.DEFINE_list("presets", ["tiny"], "model presets")
_PARTS = flags.DEFINE_list("parts", ["grpo", "push", "async"], "grpo, push, async")
_MESHES = flags.DEFINE_list("meshes", ["fsdp=2;tensor=2;expert=2", "data=8"],
                            "GRPO meshes over all devices, axes joined by ';'")
_GROUP = flags.DEFINE_integer("group_size", 8, "samples per prompt")
_PROMPTS = flags.DEFINE_integer("prompts_per_step", 8, "prompts per step")
_MINIBATCHES = flags.DEFINE_integer("minibatches", 2, "updates per step")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "generated tokens per response (cap)")
_STEPS = flags.DEFINE_integer("steps", 4, "GRPO steps per run (the first compiles)")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed pushes")
_UPDATES = flags.DEFINE_integer("updates", 6, "async updates")
_OUT = flags.DEFINE_string("out", "", "JSON output path (optional)")


def _mesh(text: str) -> dict:
  return {k: int(v) for k, v in (kv.split("=") for kv in text.split(";"))}


def _init_dir(preset: str) -> str:
  cfg = config_lib.get_preset(preset)
  return orbax_io.save_params(tempfile.mkdtemp(), cfg, gnn.init_params(cfg, 0))


def grpo_rows(preset: str, init: str) -> list[dict]:
  rows = []
  for name, axes, n in [("1 device", {"data": 1}, 1)] + [
      (m, _mesh(m), jax.device_count()) for m in _MESHES.value]:
    c = rl_config.get_config("task=arith")
    c.init_from, c.total_steps, c.tensorboard = init, _STEPS.value, False
    c.rl.update(dict(group_size=_GROUP.value, prompts_per_step=_PROMPTS.value,
                     minibatches=_MINIBATCHES.value, max_new_tokens=_NEW.value, max_len=128,
                     prefill_chunk=64, eval_every=10**6, eval_problems=_PROMPTS.value,
                     checkpoint_every=10**6))
    c.num_devices = n
    c.mesh.update({"data": 1, **axes})
    wd = tempfile.mkdtemp()
    grpo.run(c, wd)
    steps = [m for m in metrics_lib.read_rows(wd) if "loss" in m][1:]
    med = lambda k: float(np.median([m[k] for m in steps]))
    n_req = _GROUP.value * _PROMPTS.value
    step_s = med("rollout_s") + med("reward_s") + med("recompute_s") + med("update_s")
    rows.append({"preset": preset, "mesh": name, "devices": n, "step_s": step_s,
                 "rollout_s": med("rollout_s"), "recompute_s": med("recompute_s"),
                 "update_s": med("update_s"),
                 "rollout_tokens_per_s": med("response_len_mean") * n_req / med("rollout_s"),
                 "trainer_tokens_per_s": med("batch_tokens") * (1 + _MINIBATCHES.value)
                                         / (med("recompute_s") + med("update_s")),
                 "logp_abs_diff_max": max(m["logp_abs_diff_max"] for m in steps)})
  for r in rows:
    r["vs_1_device"] = r["step_s"] / rows[0]["step_s"]
  return rows


def push_row(preset: str) -> dict:
  cfg = config_lib.get_preset(preset).replace(attention_type="sparse")
  n = jax.device_count()
  trainer = shd.make_mesh({"fsdp": -1}, jax.devices()[:n // 2])
  _, specs = gnn.abstract_params(cfg)
  host = gnn.init_params(cfg, 0)
  params = jax.tree.map(shd.from_host, host, shd.param_shardings(specs, trainer))
  replica = shd.make_mesh({"tensor": 2}, jax.devices()[n - 2:])
  engine = Engine(cfg, params, max_batch=2, max_len=64, mesh=replica)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))

  def timed(store):
    ts = []
    for v in range(1, _REPEATS.value + 2):
      t0 = time.perf_counter()
      store.publish(params, v)
      version, got = store.latest()
      engine.update_params(got, version)
      jax.block_until_ready(engine.params)
      ts.append(time.perf_counter() - t0)
    return float(np.median(ts[1:]))
  dev, host_s = timed(weights_lib.DeviceWeights()), timed(weights_lib.InProcessWeights())
  return {"preset": preset, "bytes": int(nbytes), "device_to_device_s": dev,
          "host_round_trip_s": host_s, "speedup": host_s / dev}


def async_row(preset: str, init: str) -> dict:
  c = rl_async_config.get_config("task=tool_calc,runlocal=True")
  c.init_from, c.tensorboard, c.total_steps = init, False, _UPDATES.value
  n = jax.device_count()
  c.num_devices = n // 2
  c.mesh.update({"data": 1, "fsdp": n // 2})
  r = c.rl
  r.workers, r.rollout_devices = 2, n // 4
  r.rollout_mesh.update({"data": -1})
  r.group_size, r.groups_per_update = 4, 4
  r.eval_every, r.checkpoint_every, r.eval_problems = 10**6, 10**6, 4
  wd = tempfile.mkdtemp()
  async_loop.run(c, wd)
  ups = [m for m in metrics_lib.read_rows(wd) if "loss" in m]
  span = ups[-1]["wall_s"] - ups[0]["wall_s"]
  return {"preset": preset, "trainer_devices": n // 2, "replicas": "2 x %d" % (n // 4),
          "updates": len(ups), "updates_per_s": (len(ups) - 1) / max(span, 1e-9),
          "push_bytes": ups[-1]["push_bytes"],
          "logp_abs_diff_max": max(m["logp_abs_diff_max"] for m in ups),
          "topk_mismatches": sum(m["topk_mismatches"] for m in ups)}


def _table(rows: list[dict]) -> None:
  keys = list(rows[0])
  fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
  width = {k: max(len(k), *(len(fmt(r[k])) for r in rows)) + 2 for k in keys}
  print("".join(k.rjust(width[k]) for k in keys))
  for r in rows:
    print("".join(fmt(r[k]).rjust(width[k]) for k in keys))


def main(argv):
  del argv
  machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
            f"{jax.device_count()} {jax.devices()[0].platform} devices"
  print(f"machine: {machine}")
  out = {"machine": machine}
  for preset in _PRESETS.value:
    init = _init_dir(preset)
    if "grpo" in _PARTS.value:
      out.setdefault("grpo", []).extend(grpo_rows(preset, init))
    if "push" in _PARTS.value:
      out.setdefault("push", []).append(push_row(preset))
    if "async" in _PARTS.value:
      out.setdefault("async", []).append(async_row(preset, init))
  for part in ("grpo", "push", "async"):
    if part in out:
      print(f"\n{part}")
      _table(out[part])
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
