r"""GLM-5 post-training, sized: the RL train step and the rollout engine's decode step compiled
for a described TPU slice on this host, and the weight push between them estimated.

  bash launch/local.sh aot python -m experiments.aot_post_training --part=train \
      --topology=v5p:4x8x8 --mesh=fsdp=4,context=8,expert=8 --seq_lens=32768 --out=/tmp/t.json
  bash launch/local.sh aot python -m experiments.aot_post_training --part=decode \
      --topology=v5p:4x8x8 --mesh=tensor=8,expert=8 --contexts=32768 --requests=64 --out=/tmp/d.json
  bash launch/local.sh aot python -m experiments.aot_post_training --part=push \
      --topology=v5p:4x8x8 --trainer_mesh=fsdp=4,context=8,expert=8 --mesh=tensor=8,expert=8
  ... --merge=/tmp/t.json,/tmp/d.json --out=docs/aot_post_training_v5p.json   # one table per part

`--part=train`: `train.step.train_step` as `train.loop` jits it for an RL stage (`--stages`:
`rl_async`, direct double-sided IS, or `rl`, GRPO + IcePop): the policy's forward
(`policy.policy_forward`, top-k sparse attention, no MTP) and its loss on a rollout batch,
value_and_grad, clipping, Muon Split with the indexer frozen, the state donated. Config:
configs/rl_async.py (or configs/rl.py) with the mesh of `--mesh`; the model is
experiments/aot_train_memory.py's (`glm5` preset, bfloat16 activations, remat full,
attention_impl xla, master weights in `--param_dtype`), its train state and rules too. The
batch: `--sequences` sequences of `seq_len` tokens (0: one per batch group, data x fsdp x
expert), each split over `context`. Rows and table are aot_train_memory's.

`--part=decode`: one call of the engine's decode function (`steps.jit_steps(...)[1]`:
`steps_per_sync` decode steps of `steps.decode` under `lax.while_loop`, the cache donated),
with the parameters in the engine's serving shardings (`placement.shardings`: `--serve_rules`
over the rollout mesh, default heads over tensor and experts over expert, in
`--serve_param_dtype`) and a paged latent KV pool for `--requests` concurrent requests of
`--contexts` tokens each (`layer_stack.init_cache`, rows split over the batch axes as the
engine places it), every slot's block table as long as a full context. Per device: params,
KV pool, temporaries, total; `kv_room_requests` is an estimate (requests whose KV would fit
beside the parameters and the measured temporaries).

`--part=push` (no compile): per-device parameter bytes of the trainer (`--trainer_mesh`,
`--rules`, `--param_dtype`) and of each rollout mesh (`--mesh`, `--serve_rules`, pushed in
`--serve_param_dtype`), and from them the time of one weight push, an estimate from
published v5p bandwidths (BANDWIDTH), for three placements: colocated (the engine serves the
trainer's arrays: a version bump, 0 bytes); disaggregated in one slice over ICI (every
leaf resharded device to device, `Engine.update_params`); across slices over DCN (a sharded
snapshot, `rl/orchestration/snapshots.py`: trainer hosts write their replica-0 shards, rollout hosts
read their slices, after the commit: write time + read time; storage bandwidth not modelled).

`--compile=False` gives only the bytes computed from the shardings. libtpu admits one
process at a time. The flags shared with experiments/aot_train_memory.py (`--topology`,
`--mesh`, `--seq_lens`, `--num_layers`, `--param_dtype`, `--rules`, `--expert_dispatch`,
`--moe_capacity_factor`, `--compile`, `--merge`, `--hbm_gib`, `--out`) are its flags, with
this script's defaults; `--part` and `--stages` are redefined here.
"""

import collections
import functools
import importlib.metadata
import json
import math
import os
import platform
import time

from absl import app
from absl import flags
import jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np

from configs import rl as rl_config
from configs import rl_async as rl_async_config
from experiments import aot_train_memory as atm
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import sharding as shd
from glm5_jax.inference import packing
from glm5_jax.inference import steps as steps_lib
from glm5_jax.nn import kv_cache
from glm5_jax.nn import layer_stack
from glm5_jax.train import step as step_lib

PARTS = ("train", "decode", "push")
RL_CONFIGS = {"rl": rl_config, "rl_async": rl_async_config}
DEFAULT_MESHES = {"train": ["fsdp=4,context=8,expert=8"], "decode": ["tensor=8,expert=8"],
                  "push": ["tensor=8,expert=8"]}

_PART = flags.DEFINE_enum("part", "train", list(PARTS),
                          "train: the RL train step; decode: the engine's decode step; push: "
                          "weight-push estimates from the parameter shardings (no compile)",
                          allow_override=True)
_STAGES = flags.DEFINE_list("stages", ["rl_async"], f"--part=train: RL stages, of {tuple(RL_CONFIGS)}",
                            allow_override=True)
_SEQUENCES = flags.DEFINE_integer("sequences", 0, "--part=train: sequences per step (0: one "
                                  "per batch group, data x fsdp x expert)")
# --microbatches (config.microbatches; --part=train) is aot_train_memory's flag, imported above.
_MICROBATCHES = atm.MICROBATCHES
_CONTEXTS = flags.DEFINE_list("contexts", ["32768", "202752"],
                              "--part=decode: tokens per request (engine max_len)")
_REQUESTS = flags.DEFINE_list("requests", ["64"], "--part=decode: concurrent requests "
                              "(engine max_batch; a multiple of data x fsdp x expert, and "
                              "with expert > 1 of data x fsdp x context x expert)")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "--part=decode: rows per cache block")
_STEPS_PER_SYNC = flags.DEFINE_integer("steps_per_sync", 8, "--part=decode: decode steps per call")
_SERVE_DTYPE = flags.DEFINE_enum("serve_param_dtype", "bfloat16", ["float32", "bfloat16"],
                                 "--part=decode|push: the rollout engine's parameter dtype")
_SERVE_RULES = flags.DEFINE_enum("serve_rules", "default",
                                 ["default", "embed_over_context", "lora_over_fsdp"],
                                 "--part=decode|push: the engine's logical-axis rules (names "
                                 "as --rules; the engine's default is sharding.DEFAULT_RULES)")
_TRAINER_MESH = flags.DEFINE_multi_string("trainer_mesh", ["fsdp=4,context=8,expert=8"],
                                          "--part=push: trainer meshes (as --mesh)")
_REPLICAS = flags.DEFINE_integer("replicas", 1, "--part=push: rollout replicas fed per push")
_ICI_TOPOLOGY = flags.DEFINE_string("ici_topology", "v5p:8x8x8",
                                    "--part=push: the one slice that holds trainer and rollout "
                                    "for the ICI estimate, trainer and rollout as slabs along "
                                    "its last axis")

FLAGS = flags.FLAGS
FLAGS.set_default("topology", "v5p:4x8x8")
FLAGS.set_default("seq_lens", ["32768", "131072"])
FLAGS.set_default("rules", "lora_over_fsdp")
FLAGS.set_default("moe_capacity_factor", 1.25)

GIB = atm.GIB
# Google Cloud, "TPU v5p" (https://cloud.google.com/tpu/docs/v5p), key specifications:
# bidirectional ICI bandwidth per chip 1200 GBps, DCN bandwidth per chip 50 Gbps, 4 chips
# per host (ct5p-hightpu-4t). A 3D torus chip has 6 ICI links (our assumption: equal links).
BANDWIDTH = {
    "source": "https://cloud.google.com/tpu/docs/v5p (key specifications)",
    "ici_bidirectional_per_chip_GBps": 1200.0,
    "ici_links_per_chip": 6,
    "dcn_per_chip_Gbps": 50.0,
    "chips_per_host": 4,
}


def ici_one_way_per_chip() -> float:
  """Bytes/s a chip can send (or receive) over all its ICI links: half the bidirectional."""
  return BANDWIDTH["ici_bidirectional_per_chip_GBps"] * 1e9 / 2


def ici_one_way_per_link() -> float:
  return ici_one_way_per_chip() / BANDWIDTH["ici_links_per_chip"]


def dcn_per_host() -> float:
  """Bytes/s of one host's DCN: its chips' DCN bandwidth."""
  return BANDWIDTH["dcn_per_chip_Gbps"] * 1e9 / 8 * BANDWIDTH["chips_per_host"]


def environment() -> dict:
  """Host and library versions, for the JSON."""
  def version(pkg):
    try:
      return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      return None
  mem = None
  if os.path.exists("/proc/meminfo"):
    with open("/proc/meminfo") as f:
      mem = int(f.readline().split()[1]) * 1024
  return dict(host=platform.node(), machine=platform.machine(), cpus=os.cpu_count(),
              host_memory_bytes=mem, python=platform.python_version(), jax=jax.__version__,
              jaxlib=version("jaxlib"), libtpu=version("libtpu"), flax=version("flax"),
              optax=version("optax"))


def make_mesh(sizes: dict, devices):
  """A mesh of `sizes` over the first prod(sizes) devices of the slice (all of them with a -1
  size): a rollout mesh can be a part of the described slice."""
  n = len(devices) if -1 in sizes.values() else math.prod(sizes.values())
  if n > len(devices):
    raise ValueError(f"--mesh={sizes}: needs {n} chips, the topology has {len(devices)}")
  return shd.make_mesh(sizes, list(devices)[:n])


def _sds(tree, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      tree, shardings)


def _measure(fn, args, row: dict) -> dict:
  """Lowers and compiles fn(*args) for TPU (under the caller's mesh); adds the memory
  analysis, or the out-of-memory error's bytes, to `row` (aot_train_memory's fields)."""
  start = time.perf_counter()
  try:
    lowered = fn.trace(*args).lower(lowering_platforms=("tpu",))
    row["lower_seconds"] = time.perf_counter() - start
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e)
    return dict(row, ok=False, compile_seconds=time.perf_counter() - start,
                error=f"{type(e).__name__}: " + " | ".join(msg.splitlines()[:3])[:600],
                **atm._oom(msg))  # pylint: disable=protected-access
  mem = compiled.memory_analysis()
  total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
           + mem.temp_size_in_bytes)
  return dict(row, ok=True, compile_seconds=time.perf_counter() - start,
              argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
              alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
              peak_bytes=getattr(mem, "peak_memory_in_bytes", None), total_bytes=total)


# ------------------------------------------------------------------ the RL train step
def model_config(stage: str, num_layers: int, param_dtype: str, dispatch: str,
                 capacity_factor: float = 0.0):
  """aot_train_memory's model (glm5 preset, bfloat16, remat full, xla attention) for
  `stage`; a probe of 3 layers or fewer keeps one MoE layer (first_k_dense_replace =
  num_layers - 1 instead of the preset's 3)."""
  if num_layers > 3:
    return atm.model_config(stage, num_layers, param_dtype, dispatch, capacity_factor)
  deep = atm.model_config(stage, 4, param_dtype, dispatch, capacity_factor)
  return deep.replace(num_hidden_layers=num_layers, first_k_dense_replace=num_layers - 1)


def rl_config_for(stage: str, mesh_sizes: dict, microbatches: int):
  """configs/rl_async.py (or rl.py) for `stage` on this mesh."""
  if stage not in RL_CONFIGS:
    raise ValueError(f"--stages entry {stage!r}: expected one of {tuple(RL_CONFIGS)}")
  c = RL_CONFIGS[stage].get_config()
  c.mesh = dict(mesh_sizes)
  c.microbatches = microbatches
  return c


def rl_batch(stage: str, batch: int, seq_len: int, sharding) -> dict:
  """A rollout batch of ShapeDtypeStructs (train/step.py's RL losses)."""
  ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=sharding)
  per_token = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32, sharding=sharding)
  out = {"tokens": ids, "positions": ids, "segment_ids": ids, "loss_mask": per_token,
         "rollout_logp": per_token,
         "advantages": jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=sharding)}
  if step_lib.get_stage(stage).loss == "icepop_grpo":
    out["old_logp"] = per_token
  return out


def train_row(topology, devices, mesh_sizes, stage, seq_len, *, num_layers, param_dtype,
              rule_name, dispatch, capacity_factor, hbm, sequences=0, microbatches=1,
              do_compile=True) -> dict:
  """One RL train step compiled (or only its state sized); a row of aot_train_memory's
  fields (its `table` prints it)."""
  mesh = make_mesh(mesh_sizes, devices)
  groups = shd.batch_axis_size(mesh)
  batch = sequences or groups
  if batch % groups:
    raise ValueError(f"--sequences={sequences}: expected a multiple of the mesh's batch axes "
                     f"data x fsdp x expert = {groups}")
  if batch % microbatches or (batch // microbatches) % groups:
    raise ValueError(f"--microbatches={microbatches}: each part of the {batch} sequences must "
                     f"be a multiple of {groups} (the batch axes)")
  n_ctx = mesh.shape["context"]
  if n_ctx > 1 and seq_len % (2 * n_ctx):
    raise ValueError(f"--seq_lens entry {seq_len} is not divisible by 2 * context = {2 * n_ctx}")
  c = rl_config_for(stage, mesh_sizes, microbatches)
  cfg = model_config(stage, num_layers, param_dtype, dispatch, capacity_factor)
  tx = step_lib.make_optimizer(c)
  state = atm.abstract_state(cfg, tx, mesh, atm.rules(rule_name))
  batch_sh = shd.batch_sharding(mesh)
  batch_d = rl_batch(stage, batch, seq_len, batch_sh)
  row = dict(kind="train", topology=topology, chips=mesh.size,
             mesh={a: int(mesh.shape[a]) for a in shd.MESH_AXES}, part="step", rules=rule_name,
             expert_dispatch=dispatch, moe_capacity_factor=capacity_factor, stage=stage,
             loss=step_lib.get_stage(stage).loss, seq_len=seq_len, global_batch=batch,
             microbatches=microbatches, tokens_per_device=batch * seq_len // mesh.size,
             num_layers=num_layers, dense_layers=cfg.first_k_dense_replace,
             param_dtype=param_dtype, hbm_bytes=hbm * GIB, optimizer=c.optimizer,
             params=int(sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))),
             param_bytes=atm._bytes(state.params),  # pylint: disable=protected-access
             opt_state_bytes=atm._bytes(state.opt_state),  # pylint: disable=protected-access
             state_bytes=atm._bytes((state, batch_d)))  # pylint: disable=protected-access
  if not do_compile:
    return dict(row, ok=None, compile_seconds=0.0)
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  fn = jax.jit(functools.partial(step_lib.train_step, cfg=cfg, stage=stage, tx=tx,
                                 microbatches=microbatches, hp=step_lib.loss_hparams(c)),
               in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
               donate_argnums=(0,))
  with jax.set_mesh(mesh):
    return _measure(fn, (state, batch_d), row)


# ------------------------------------------------------------------ the engine's decode step
def serve_config(num_layers: int, param_dtype: str, dispatch: str):
  """The model the RL rollout engine serves: the RL stages' (top-k sparse attention), dropless
  MoE (a capacity factor would drop tokens the trainer's forward keeps)."""
  return model_config("rl_async", num_layers, param_dtype, dispatch, 0.0)


def serve_params(cfg, mesh, rule_name: str):
  """Parameters as ShapeDtypeStructs in the engine's serving shardings
  (`inference.placement.shardings`)."""
  shapes, specs = gnn.abstract_params(cfg)
  param_sh = shd.param_shardings(specs, mesh, atm.rules(rule_name))
  shd.check_divisible(shapes, param_sh, mesh)
  return _sds(shapes, param_sh)


def pool_sharding(mesh):
  """The engine's KV-pool placement: rows over the batch axes (replicated elsewhere)."""
  axes = tuple(a for a in shd.BATCH_AXES if mesh.shape.get(a, 1) > 1) or None
  return lambda x: NamedSharding(mesh, P(*([None] * (x.ndim - 2)), axes, None))


def decode_args(cfg, mesh, params, requests: int, context: int, block_size: int):
  """(params, cache, block table, packed decode state) of one decode call: the pool holds
  `requests` requests of `context` rows; every slot's table spans a whole context (the
  engine's largest block-table bucket)."""
  per_request = -(-context // block_size)
  num_blocks = requests * per_request
  cache = jax.eval_shape(functools.partial(layer_stack.init_cache, cfg, num_blocks * block_size))
  cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                      sharding=pool_sharding(mesh)(x)), cache)
  rep = shd.replicated(mesh)
  m = packing.pow2(per_request)
  table = jax.ShapeDtypeStruct((requests, m), jnp.int32, sharding=rep)
  packed = (jax.ShapeDtypeStruct((requests, 8), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((requests, 2), jnp.float32, sharding=rep),
            jax.ShapeDtypeStruct((requests, 4), jnp.int32, sharding=rep))
  return (params, cache, table, packed), num_blocks, m


def largest_leaf_bytes(tree) -> int:
  """One device's bytes of the tree's largest leaf (an engine weight swap holds one extra)."""
  return max(atm._bytes(x) for x in jax.tree.leaves(tree))  # pylint: disable=protected-access


def decode_row(topology, devices, mesh_sizes, context, requests, *, num_layers, param_dtype,
               rule_name, dispatch, hbm, block_size=16, steps_per_sync=8,
               do_compile=True) -> dict:
  """One call of the engine's decode function compiled (or only its state sized)."""
  mesh = make_mesh(mesh_sizes, devices)
  shards = shd.batch_axis_size(mesh)
  if requests % shards:
    raise ValueError(f"--requests entry {requests}: expected a multiple of the mesh's batch "
                     f"axes data x fsdp x expert = {shards} (the engine splits slots and pool)")
  tokens = math.prod(mesh.shape[a] for a in shd.TOKEN_AXES)
  if mesh.shape["expert"] > 1 and dispatch == "all_to_all" and requests % tokens:
    raise ValueError(f"--requests entry {requests}: expected a multiple of data x fsdp x "
                     f"context x expert = {tokens} (the MoE's all-to-all dispatch splits the "
                     "N decode tokens over them, nn/moe_ep.py)")
  cfg = serve_config(num_layers, param_dtype, dispatch)
  if not 0 < context <= cfg.max_position_embeddings:
    raise ValueError(f"--contexts entry {context}: expected 1 .. max_position_embeddings = "
                     f"{cfg.max_position_embeddings}")
  params = serve_params(cfg, mesh, rule_name)
  args, num_blocks, m = decode_args(cfg, mesh, params, requests, context, block_size)
  kv_token = kv_cache.bytes_per_token(cfg)["latent"]
  row = dict(kind="decode", topology=topology, chips=mesh.size,
             mesh={a: int(mesh.shape[a]) for a in shd.MESH_AXES}, rules=rule_name,
             expert_dispatch=dispatch, num_layers=num_layers,
             dense_layers=cfg.first_k_dense_replace, param_dtype=param_dtype, context=context, requests=requests, batch_shards=shards,
             requests_per_shard=requests // shards, block_size=block_size,
             num_blocks=num_blocks, table_blocks=m, steps_per_sync=steps_per_sync,
             hbm_bytes=hbm * GIB, kv_bytes_per_token=kv_token,
             params=int(sum(math.prod(x.shape) for x in jax.tree.leaves(params))),
             param_bytes=atm._bytes(params),  # pylint: disable=protected-access
             kv_pool_bytes=atm._bytes(args[1]),  # pylint: disable=protected-access
             mtp_param_bytes=atm._bytes(params.get("mtp", {})),  # pylint: disable=protected-access
             largest_leaf_bytes=largest_leaf_bytes(params),
             state_bytes=atm._bytes(args))  # pylint: disable=protected-access
  if not do_compile:
    return with_kv_room(dict(row, ok=None, compile_seconds=0.0))
  decode = steps_lib.jit_steps(cfg, block_size, False, steps_per_sync, cfg.mtp_num_steps, 1,
                               1)[1]
  with jax.set_mesh(mesh):
    return with_kv_room(with_resident(_measure(decode, args, row)))


def with_resident(row: dict) -> dict:
  """Adds `resident_total_bytes`: XLA's total plus the arguments the compiled program does
  not take. jit drops unused inputs (without speculative decoding, the MTP layer's
  parameters, `mtp_param_bytes`), but the engine holds the whole parameter tree
  (`Engine.update_params` takes the trainer's tree), so they stay in HBM beside the program.
  `resident_peak_bytes`: the same for XLA's peak (its heap simulation, which can be well
  below the total: not every temporary is live with every argument)."""
  if not row.get("ok"):
    return row
  pruned = max(row["state_bytes"] - row["argument_bytes"], 0)
  peak = row.get("peak_bytes")
  return dict(row, pruned_argument_bytes=pruned, resident_total_bytes=row["total_bytes"] + pruned,
              resident_peak_bytes=None if peak is None else peak + pruned)


def with_kv_room(row: dict) -> dict:
  """Adds `kv_room_requests` (estimate): requests whose KV pool rows fit beside the parameters
  and the temporaries (measured; 0 when not compiled), over all batch shards."""
  per_request = row["kv_pool_bytes"] / row["requests_per_shard"]
  free = row["hbm_bytes"] - row["param_bytes"] - (row.get("temp_bytes") or 0)
  return dict(row, kv_room_requests=int(max(free, 0) // per_request) * row["batch_shards"])


# ------------------------------------------------------------------ weight push estimates
def _index_key(idx, shape):
  return tuple(s.indices(n)[:2] for s, n in zip(idx, shape))


def host_bytes(tree, mode: str) -> collections.Counter:
  """Bytes per host (device.process_index) of a tree's shards.

  mode "write": each distinct shard once, on the first device in mesh order holding it (a
  snapshot's replica-0 writers); "read": each host's distinct shards (what its devices
  need, read once per host).
  """
  out = collections.Counter()
  for x in jax.tree.leaves(tree):
    nbytes = atm._bytes(x)  # pylint: disable=protected-access
    index = x.sharding.devices_indices_map(x.shape)
    seen = set()
    for dev in x.sharding.mesh.devices.flat:
      key = _index_key(index[dev], x.shape)
      key = key if mode == "write" else (dev.process_index, key)
      if key not in seen:
        seen.add(key)
        out[dev.process_index] += nbytes
  return out


def slab_cut_links(topology: str) -> int:
  """ICI links between two slabs of a torus slice cut across its last axis (two faces: the
  wrap-around links too)."""
  dims = [int(d) for d in topology.split(":")[-1].split("x")]
  return 2 * math.prod(dims[:-1])


def push_row(topology, devices, trainer_sizes, rollout_sizes, *, num_layers, trainer_dtype,
             trainer_rules, serve_dtype, serve_rules, dispatch, capacity_factor, replicas=1,
             ici_topology="v5p:8x8x8") -> dict:
  """Per-device parameter bytes of both sides and the estimated time of one push for the
  three placements (module docstring). The pushed tree is the rollout's: trainer leaves
  are cast to `serve_dtype` first (`Engine.update_params` takes its own dtypes)."""
  t_mesh, r_mesh = make_mesh(trainer_sizes, devices), make_mesh(rollout_sizes, devices)
  t_cfg = model_config("rl_async", num_layers, trainer_dtype, dispatch, capacity_factor)
  r_cfg = serve_config(num_layers, serve_dtype, dispatch)
  trainer = serve_params(t_cfg, t_mesh, trainer_rules)
  pushed = serve_params(r_cfg, t_mesh, trainer_rules)       # the trainer's shards, cast
  rollout = serve_params(r_cfg, r_mesh, serve_rules)
  n_t, n_r = t_mesh.size, r_mesh.size * replicas
  model = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(rollout))
  recv_chip = atm._bytes(rollout)  # pylint: disable=protected-access
  total_recv = recv_chip * n_r
  send_chip = total_recv / n_t
  cut = slab_cut_links(ici_topology)
  slice_chips = math.prod(int(d) for d in ici_topology.split(":")[-1].split("x"))
  ici_s = max(recv_chip / ici_one_way_per_chip(), send_chip / ici_one_way_per_chip(),
              total_recv / (cut * ici_one_way_per_link()))
  write = host_bytes(pushed, "write")
  read = host_bytes(rollout, "read")
  # A snapshot is committed whole before any reader opens it (rl/orchestration/snapshots.py: COMMIT
  # is written last), so the slowest writer host and the slowest reader host add up.
  write_s = max(write.values()) / dcn_per_host()
  read_s = max(read.values()) / dcn_per_host()
  return dict(
      kind="push", topology=topology, num_layers=num_layers,
      trainer_mesh={a: int(t_mesh.shape[a]) for a in shd.MESH_AXES}, trainer_chips=n_t,
      trainer_rules=trainer_rules, trainer_param_dtype=trainer_dtype,
      trainer_param_bytes=atm._bytes(trainer),  # pylint: disable=protected-access
      trainer_pushed_bytes=atm._bytes(pushed),  # pylint: disable=protected-access
      rollout_mesh={a: int(r_mesh.shape[a]) for a in shd.MESH_AXES},
      rollout_chips=r_mesh.size, replicas=replicas, rollout_rules=serve_rules,
      rollout_param_dtype=serve_dtype, rollout_param_bytes=recv_chip,
      rollout_largest_leaf_bytes=largest_leaf_bytes(rollout), model_bytes=int(model),
      colocated={"bytes": 0, "seconds": 0.0},
      ici={"slice": ici_topology, "fits_slice": n_t + n_r <= slice_chips,
           "recv_bytes_per_chip": recv_chip, "send_bytes_per_chip": send_chip,
           "bytes_total": total_recv, "cut_links": cut, "seconds": ici_s},
      dcn={"write_bytes_per_host_max": max(write.values()), "trainer_hosts": len(write),
           "read_bytes_per_host_max": max(read.values()), "rollout_hosts": len(read),
           "bytes_per_host_s": dcn_per_host(), "write_seconds": write_s,
           "read_seconds": read_s, "seconds": write_s + read_s},
      bandwidth=BANDWIDTH, estimate=True)


# ------------------------------------------------------------------ tables
def _mesh_str(m) -> str:
  return "".join(f"{a[0]}{m[a]} " for a in shd.MESH_AXES if m[a] > 1).strip()


def _gib(x) -> str:
  return f"{x / GIB:,.1f}" if x is not None else "-"


def decode_table(rows) -> str:
  """One line per decode row: per device GiB; compile-OOM rows: state + required temporaries."""
  head = (f"{'topology':<11}{'mesh':<15}{'context':>8}{'N':>5}{'N/sh':>6}{'L':>4}{'dtype':>6}"
          f"{'compile s':>10}{'params':>8}{'KV':>8}{'temp':>8}{'total':>8}{'peak':>8}{'HBM':>5}"
          f"  fits?  KV room (est.)")
  lines = [head, "-" * len(head)]
  for r in rows:
    lead = (f"{r['topology']:<11}{_mesh_str(r['mesh']):<15}{r['context']:>8}{r['requests']:>5}"
            f"{r['requests_per_shard']:>6}{r['num_layers']:>4}"
            f"{'f32' if r['param_dtype'] == 'float32' else 'bf16':>6}"
            f"{r['compile_seconds']:>10.0f}{_gib(r['param_bytes']):>8}"
            f"{_gib(r['kv_pool_bytes']):>8}")
    hbm = f"{r['hbm_bytes'] / GIB:>5.0f}"
    room = f"  {r.get('kv_room_requests', '-')}"
    if r["ok"]:
      total = r.get("resident_total_bytes", r["total_bytes"])
      peak = r.get("resident_peak_bytes", r.get("peak_bytes"))
      fits = ("yes" if total <= r["hbm_bytes"] else
              "peak" if peak is not None and peak <= r["hbm_bytes"] else "NO")
      lines.append(lead + f"{_gib(r['temp_bytes']):>8}{_gib(total):>8}{_gib(peak):>8}{hbm}  "
                   f"{fits:<5}" + room)
    elif r["ok"] is None:
      fits = "NO" if r["state_bytes"] > r["hbm_bytes"] else "?"
      lines.append(lead + f"{'-':>8}{'>=' + _gib(r['state_bytes']):>8}{'-':>8}{hbm}  "
                   f"{fits:<5}" + room + " (not compiled)")
    elif "oom_temp_bytes" in r:
      total = r["state_bytes"] + r["oom_temp_bytes"]
      lines.append(lead + f"{_gib(r['oom_temp_bytes']):>8}{'~' + _gib(total):>8}{'-':>8}{hbm}  "
                   "NO (compile OOM)")
    elif "oom_total_bytes" in r:
      lines.append(lead + f"{'-':>8}{_gib(r['oom_total_bytes']):>8}{'-':>8}{hbm}  NO (compile "
                   "OOM)")
    else:
      lines.append(lead + f"  FAILED {r['error'][:140]}")
  lines.append("Per device, GiB. N: concurrent requests (slots), N/sh: per batch shard (data x "
               "fsdp x expert; the pool is replicated over tensor); KV: the paged pool for N "
               "requests of `context` rows; total: XLA's (arguments + outputs - aliased + "
               "temporaries) plus the parameters the program does not read (the MTP layer, "
               "unused without speculative decoding), which the engine holds too; peak: XLA's "
               "peak (heap simulation) plus the same; fits: yes by total, 'peak' by the peak "
               "only; KV room: requests whose pool rows would fit beside params + temporaries "
               "(an estimate).")
  return "\n".join(lines)


def push_table(rows) -> str:
  """One line per (trainer, rollout) pair: bytes and estimated seconds of one push."""
  head = (f"{'trainer':<16}{'chips':>6}  {'rollout':<16}{'chips':>7}{'model GiB':>10}"
          f"{'recv/chip':>10}{'send/chip':>10}{'ICI s':>7}{'write/host':>11}{'read/host':>10}"
          f"{'DCN s':>7}")
  lines = [head, "-" * len(head)]
  for r in rows:
    ici, dcn = r["ici"], r["dcn"]
    lines.append(
        f"{_mesh_str(r['trainer_mesh']):<16}{r['trainer_chips']:>6}  "
        f"{_mesh_str(r['rollout_mesh']):<16}{r['rollout_chips']:>4}x{r['replicas']:<2}"
        f"{_gib(r['model_bytes']):>10}{_gib(ici['recv_bytes_per_chip']):>10}"
        f"{_gib(ici['send_bytes_per_chip']):>10}{ici['seconds']:>7.2f}"
        f"{_gib(dcn['write_bytes_per_host_max']):>11}{_gib(dcn['read_bytes_per_host_max']):>10}"
        f"{dcn['seconds']:>7.2f}")
  lines.append(
      "Estimates, not measurements. Colocated: 0 bytes, 0 s (a version bump). ICI: one slice, "
      "every leaf resharded device to device; max of per-chip receive, per-chip send and the "
      "slab cut, at 600 GB/s per chip and 100 GB/s per link one way. DCN: sharded snapshot, "
      "the most bytes a trainer host writes (replica 0), then (after the commit) the most a "
      "rollout host reads, each at 25 GB/s per host; storage not modelled. Bandwidths: "
      f"{BANDWIDTH['source']}.")
  return "\n".join(lines)


def print_tables(rows):
  train = [r for r in rows if r.get("kind", "train") == "train"]
  for name, part_rows, fmt in (("train", train, atm.table),
                               ("decode", [r for r in rows if r.get("kind") == "decode"],
                                decode_table),
                               ("push", [r for r in rows if r.get("kind") == "push"],
                                push_table)):
    if part_rows:
      print(f"\n== {name}\n" + fmt(part_rows))


# ------------------------------------------------------------------ main
def _topology(name: str):
  try:
    return topologies.get_topology_desc(name, "tpu")
  except Exception as e:  # pylint: disable=broad-except
    raise SystemExit(f"--topology={name!r}: no TPU topology description ({e}). This needs "
                     "libtpu: run through `bash launch/local.sh aot ...`.") from e


def _merge(paths, out):
  runs = []
  for path in paths:
    with open(path) as f:
      runs.append(json.load(f))
  # Decode rows of runs before `with_resident` existed get its fields (it is idempotent).
  rows = [with_resident(r) if r.get("kind") == "decode" else r
          for run in runs for r in run["rows"]]
  print_tables(rows)
  if out:
    with open(out, "w") as f:
      json.dump(dict(runs=[{k: v for k, v in run.items() if k != "rows"} for run in runs],
                     rows=rows), f, indent=1)
    print(f"wrote {out}")


def rows_for(part, topology, devices, meshes, hbm, layers) -> list:
  """The rows of `part` over the flags' meshes, lengths and stages, printed as they finish."""
  common = dict(num_layers=layers, dispatch=FLAGS.expert_dispatch)
  rows = []
  def done(r, what):
    status = {True: "ok", None: "not compiled", False: f"FAILED {r.get('error', '')[:300]}"}
    print(f"  {what}: {status[r['ok']]} ({r['compile_seconds']:.0f} s); params "
          f"{r['param_bytes'] / GIB:.2f} GiB per device", flush=True)
    rows.append(r)
  for sizes in meshes:
    if part == "train":
      for stage in _STAGES.value:
        for t in (int(x) for x in FLAGS.seq_lens):
          done(train_row(topology, devices, sizes, stage, t, param_dtype=FLAGS.param_dtype,
                         rule_name=FLAGS.rules, capacity_factor=FLAGS.moe_capacity_factor,
                         hbm=hbm, sequences=_SEQUENCES.value, microbatches=_MICROBATCHES.value,
                         do_compile=FLAGS.compile, **common), f"{sizes} {stage} t={t}")
    elif part == "decode":
      for ctx in (int(x) for x in _CONTEXTS.value):
        for n in (int(x) for x in _REQUESTS.value):
          done(decode_row(topology, devices, sizes, ctx, n, param_dtype=_SERVE_DTYPE.value,
                          rule_name=_SERVE_RULES.value, hbm=hbm, block_size=_BLOCK_SIZE.value,
                          steps_per_sync=_STEPS_PER_SYNC.value, do_compile=FLAGS.compile,
                          **common), f"{sizes} context={ctx} requests={n}")
    else:
      for t_spec in _TRAINER_MESH.value:
        rows.append(push_row(topology, devices, atm.parse_mesh(t_spec), sizes,
                             trainer_dtype=FLAGS.param_dtype, trainer_rules=FLAGS.rules,
                             serve_dtype=_SERVE_DTYPE.value, serve_rules=_SERVE_RULES.value,
                             capacity_factor=FLAGS.moe_capacity_factor,
                             replicas=_REPLICAS.value, ici_topology=_ICI_TOPOLOGY.value,
                             **common))
  return rows


def main(argv):
  del argv
  if FLAGS.merge:
    _merge(FLAGS.merge, FLAGS.out)
    return
  part = _PART.value
  for s in _STAGES.value:
    rl_config_for(s, {}, 1)
  devices = np.array(_topology(FLAGS.topology).devices)
  kind = devices.flat[0].device_kind
  hbm = FLAGS.hbm_gib or atm.HBM_GIB.get(kind)
  if not hbm:
    raise ValueError(f"--hbm_gib=0: no HBM size known for device kind {kind!r}; pass --hbm_gib")
  meshes = [atm.parse_mesh(m) for m in (FLAGS.mesh if FLAGS["mesh"].present
                                        else DEFAULT_MESHES[part])]
  layers = FLAGS.num_layers or config_lib.get_preset("glm5").num_hidden_layers
  settings = dict(part=part, topology=FLAGS.topology, device_kind=kind, hbm_gib=hbm,
                  chips=int(devices.size), preset="glm5", num_layers=layers, dtype="bfloat16",
                  remat="full", attention_impl="xla", attention_type="sparse",
                  param_dtype=FLAGS.param_dtype, rules=FLAGS.rules,
                  serve_param_dtype=_SERVE_DTYPE.value, serve_rules=_SERVE_RULES.value,
                  expert_dispatch=FLAGS.expert_dispatch,
                  moe_capacity_factor=FLAGS.moe_capacity_factor, environment=environment())
  print(f"target: {devices.size} x {kind}, {hbm:g} GiB HBM each; compiled on "
        f"{jax.devices()[0].device_kind}; {settings}", flush=True)
  rows = rows_for(part, FLAGS.topology, devices, meshes, hbm, layers)
  print_tables(rows)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(dict(settings, rows=rows), f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
