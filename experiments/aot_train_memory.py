r"""Per-device memory of one GLM-5 train step, compiled for a described TPU slice on this host.

  bash launch/local.sh aot python -m experiments.aot_train_memory --topology=v5p:4x4x8 \
      --rules=lora_over_fsdp --mesh=fsdp=16,expert=8 --mesh=fsdp=4,context=4,expert=8 \
      --seq_lens=32768,131072,202752 --stages=midtrain --out=/tmp/a.json
  ... --merge=/tmp/a.json,/tmp/b.json --out=docs/aot_train_memory_v5p.json   # one table

What is compiled (`--part=step`) is `train.step.train_step` as `train.loop.run` jits it:
value_and_grad of the stage's loss (LM + MTP, or the indexer KL), gradient clipping, Muon
Split over the whole parameter tree with the stage's frozen mask (midtrain: the indexer is
frozen and holds no state) and `--muon_distribution`, the routing-bias update; in/out
shardings of the train state from `sharding.param_shardings` (rules of `--rules`) and
`optim.state_shardings`, the state donated. `--part=grad` / `--part=update` compile only the loss gradient / only the optimizer
update, to split the step's memory. The model is the `glm5` preset (78 layers, scanned),
bfloat16 activations, `--remat` (default "full"), `attention_impl="xla"` (context
parallelism needs it), parameters in `--param_dtype` (float32 master weights by default; Muon momentum and Adam
moments follow the parameters' dtype). The batch is one sequence per batch group
(`--microbatches` per group, accumulated): `data * fsdp * expert` sequences of `seq_len`
tokens, each split over `context`.

`jax.experimental.topologies.get_topology_desc` describes the slice, `.compile()` runs XLA:TPU
(nothing executes). From `compiled.memory_analysis()`, per device: arguments (params +
optimizer state + batch), outputs, aliased (the donated state the outputs reuse),
temporaries, and total = arguments + outputs - aliased + temporaries. A program over the
chip's HBM does not compile: XLA:TPU's error names the temporaries it needs ("HLO
temporaries (1.07T) exceeds available HBM"); the row keeps that (`oom_temp_bytes`, 3
significant digits) next to `state_bytes`, params + optimizer state + batch per device
computed from the shardings. Such compiles fail fast (about a minute at 78 layers);
programs that fit take far longer on a 2-core host (15 minutes for 4 layers).
`--compile=False` gives only `state_bytes`. libtpu admits one process at a time; set
ALLOW_MULTIPLE_LIBTPU_LOAD=1 to compile in two at once.
"""

import functools
import json
import math
import re
import time

from absl import app
from absl import flags
import jax
from jax.experimental import topologies
import jax.numpy as jnp
import numpy as np
import optax

from configs import pretrain as pretrain_config
from glm5_jax import collectives
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import optim
from glm5_jax import sharding as shd
from glm5_jax.train import step as step_lib

_TOPOLOGY = flags.DEFINE_string("topology", "v5p:4x4x8",
                                "TPU topology, e.g. v5p:4x4x8 (v5p-256, 128 chips), v5e:16x16")
_MESHES = flags.DEFINE_multi_string(
    "mesh", ["fsdp=16,expert=8", "fsdp=4,context=4,expert=8"],
    "mesh sizes 'axis=n,...' over data, fsdp, context, expert, tensor (absent axes are 1); "
    "repeat the flag for several meshes")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["32768", "131072", "202752"], "sequence lengths")
_STAGES = flags.DEFINE_list("stages", ["midtrain"],
                            "train stages (step.STAGES): midtrain, dsa_warmup, dsa_sparse, ...")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 0, "decoder layers (0: the preset's 78)")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16"],
                                 "master weights (and optimizer state) dtype")
_RULES = flags.DEFINE_enum(
    "rules", "default", ["default", "embed_over_context", "lora_over_fsdp"],
    "logical-axis rules: sharding.DEFAULT_RULES; or with 'embed' over (fsdp, context), so that "
    "context-parallel devices also shard the parameters; or that and 'q_lora', 'kv_lora' over "
    "(fsdp, context) too (MLA's up-projections are otherwise sharded over tensor only)")
_DISPATCH = flags.DEFINE_enum(
    "expert_dispatch", "all_to_all", ["all_to_all", "gspmd"],
    "ModelConfig.expert_dispatch with expert > 1: nn/moe_ep.py's dropless all-to-all, or GSPMD")
_DENSE_FORM = flags.DEFINE_enum(
    "dense_attention_form", "expanded", ["expanded", "absorbed"],
    "ModelConfig.dense_attention_form: the dense stages' MLA attention over per-head keys "
    "and values, or absorbed (MQA over the latent rows)")
_CAPACITY = flags.DEFINE_float(
    "moe_capacity_factor", 0.0, "ModelConfig.moe_capacity_factor: 0 = dropless all-to-all "
    "buffers sized for the worst case; c > 0 bounds them to ceil(c n K / ep) rows per shard pair")
PARTS = ("step", "grad", "update")
_REMAT = flags.DEFINE_enum("remat", "full", list(config_lib._REMAT),
                           "ModelConfig.remat: the decoder layer's remat policy; offload_* move "
                           "the marked activations to host memory (nn/decoder.py)")
_MUON = flags.DEFINE_enum("muon_distribution", "owner", list(optim.DISTRIBUTIONS),
                          "config.muon_distribution (the loop's default: owner): Newton–Schulz "
                          "on owner devices (optim/muon_owner.py) or on the sharded matrices "
                          "as they are (replicated; the rows compiled before 2026-12-05)")
MICROBATCHES = flags.DEFINE_integer("microbatches", 1,
                              "config.microbatches: gradient accumulation; the step's batch is "
                              "this many sequences per batch group")
_PART = flags.DEFINE_enum("part", "step", list(PARTS),
                          "what to compile: the train step, or (to split its memory) only the "
                          "loss gradient, or only the optimizer update")
_COMPILE = flags.DEFINE_bool("compile", True,
                             "False: only the per-device params + optimizer state + batch")
_MERGE = flags.DEFINE_list("merge", [], "JSON files of earlier runs: print one table of their "
                           "rows and write them to --out (nothing is compiled)")
_HBM_GIB = flags.DEFINE_float("hbm_gib", 0.0, "HBM per chip in GiB (0: from the chip kind)")
_OUT = flags.DEFINE_string("out", "", "JSON output path (optional)")

HBM_GIB = {"TPU v5": 95.0, "TPU v5p": 95.0, "TPU v5 lite": 16.0, "TPU v5e": 16.0,
           "TPU v4": 32.0, "TPU v6 lite": 32.0}
GIB = 2 ** 30


def parse_mesh(spec: str) -> dict[str, int]:
  """'fsdp=4,context=4' -> {'fsdp': 4, 'context': 4} (axes of sharding.MESH_AXES)."""
  sizes = {}
  for item in spec.split(","):
    axis, _, n = item.partition("=")
    if axis not in shd.MESH_AXES or not n.isdigit():
      raise ValueError(f"--mesh={spec!r}: {item!r} is not 'axis=n' with axis in {shd.MESH_AXES}")
    sizes[axis] = int(n)
  return sizes


def rules(name: str):
  """The logical-axis rules of --rules (first match wins, as in sharding.DEFAULT_RULES)."""
  over = {"default": (), "embed_over_context": ("embed",),
          "lora_over_fsdp": ("embed", "q_lora", "kv_lora")}[name]
  return tuple((k, ("fsdp", "context") if k in over else v) for k, v in shd.DEFAULT_RULES)


def train_config(stage: str, seq_len: int, batch: int, mesh_sizes: dict[str, int]):
  """configs/pretrain.py for the glm5 preset and `stage`, at this length and batch."""
  c = pretrain_config.get_config(f"model=glm5,stage={stage}")
  c.seq_len, c.batch_size = seq_len, batch
  c.mesh = dict(mesh_sizes)
  return c


def model_config(stage: str, num_layers: int, param_dtype: str, dispatch: str,
                 capacity_factor: float = 0.0, dense_form: str = "expanded",
                 remat: str = "full"):
  over = dict(dtype="bfloat16", param_dtype=param_dtype, remat=remat, attention_impl="xla",
              num_hidden_layers=num_layers, expert_dispatch=dispatch,
              moe_capacity_factor=capacity_factor, dense_attention_form=dense_form)
  return step_lib.stage_model_config(config_lib.get_preset("glm5", **over), stage)


def param_shardings(cfg, mesh, rule_set):
  """(parameter ShapeDtypeStructs, their shardings), checked against the mesh."""
  shapes, specs = gnn.abstract_params(cfg)
  p_sh = shd.param_shardings(specs, mesh, rule_set)
  shd.check_divisible(shapes, p_sh, mesh)
  return shapes, p_sh


def abstract_state(cfg, tx, mesh, rule_set):
  """TrainState of ShapeDtypeStructs in the loop's shardings (nothing is allocated)."""
  shapes, p_sh = param_shardings(cfg, mesh, rule_set)
  with_sh = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
  params = jax.tree.map(with_sh, shapes, p_sh)
  rep = shd.replicated(mesh)
  opt_shapes = jax.eval_shape(tx.init, params)
  opt = jax.tree.map(with_sh, opt_shapes,
                     optim.state_shardings(opt_shapes, params, p_sh, rep))
  return step_lib.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                             params=params, opt_state=opt,
                             rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep))


def _oom(msg: str) -> dict:
  """Bytes XLA:TPU's out-of-memory error names: temporaries required, or total used."""
  unit = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
  num = lambda v, u: float(v) * unit[u]
  m = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])",
                msg)
  if m:
    return {"oom_temp_bytes": num(m[1], m[2]), "hbm_limit_bytes": num(m[3], m[4])}
  m = re.search(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm", msg)
  if m:
    return {"oom_total_bytes": num(m[1], m[2]), "hbm_limit_bytes": num(m[3], m[4])}
  return {}


def compile_one(topology, devices, mesh_sizes, stage, seq_len, num_layers, param_dtype,
                rule_name, dispatch, hbm, *, part="step", do_compile=True,
                capacity_factor: float = 0.0, dense_form: str = "expanded",
                remat: str = "full", muon_distribution: str = "replicated",
                microbatches: int = 1):
  """Compiles one train step; returns a result row.

  `state_bytes` (params + optimizer state + batch per device) comes from the shardings,
  before compiling; the rest from `memory_analysis()`, or from the out-of-memory error.
  """
  mesh = shd.make_mesh(mesh_sizes, devices)
  batch = shd.batch_axis_size(mesh) * microbatches
  n_ctx = mesh.shape["context"]
  if n_ctx > 1 and seq_len % (2 * n_ctx):
    raise ValueError(f"--seq_lens entry {seq_len} is not divisible by 2 * context = {2 * n_ctx}")
  row = dict(topology=topology, mesh={a: int(mesh.shape[a]) for a in shd.MESH_AXES},
             part=part, rules=rule_name, expert_dispatch=dispatch,
             moe_capacity_factor=capacity_factor, stage=stage, seq_len=seq_len,
             global_batch=batch, tokens_per_device=batch * seq_len // mesh.size,
             microbatches=microbatches,
             num_layers=num_layers, param_dtype=param_dtype, hbm_bytes=hbm * GIB,
             dense_attention_form=dense_form, remat=remat,
             muon_distribution=muon_distribution)
  cfg = model_config(stage, num_layers, param_dtype, dispatch, capacity_factor, dense_form,
                     remat)
  c = train_config(stage, seq_len, batch, mesh_sizes)
  c.muon_distribution = muon_distribution
  c.microbatches = microbatches
  tx = step_lib.make_optimizer(c, param_shardings(cfg, mesh, rules(rule_name))[1])
  # Outside the mesh context, as in the loop: GLM5.init traces the model on [1, 8] tokens,
  # which expert parallelism's shard_map cannot split over the batch axes.
  state = abstract_state(cfg, tx, mesh, rules(rule_name))
  batch_sh = shd.batch_sharding(mesh)
  tok = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=batch_sh)
  batch_d = {"tokens": tok, "segment_ids": tok, "positions": tok}
  row.update(params=int(sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))),
             param_bytes=_bytes(state.params), opt_state_bytes=_bytes(state.opt_state),
             state_bytes=_bytes((state, batch_d)))
  if not do_compile:
    return dict(row, ok=None, compile_seconds=0.0)
  start = time.perf_counter()
  try:
    with jax.set_mesh(mesh):
      state_sh = jax.tree.map(lambda x: x.sharding, state)
      fn = part_fn(part, cfg, stage, tx, c, state_sh, batch_sh)
      lowered = fn.trace(state, batch_d).lower(lowering_platforms=("tpu",))
      row["lower_seconds"] = time.perf_counter() - start
      compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e)
    row.update(ok=False, compile_seconds=time.perf_counter() - start,
               error=f"{type(e).__name__}: " + " | ".join(msg.splitlines()[:3])[:600], **_oom(msg))
    return row
  mem, hlo = compiled.memory_analysis(), compiled.as_text()
  total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
           + mem.temp_size_in_bytes)
  row.update(ok=True, compile_seconds=time.perf_counter() - start,
             argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
             alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
             peak_bytes=getattr(mem, "peak_memory_in_bytes", None), total_bytes=total,
             host_temp_bytes=mem.host_temp_size_in_bytes,
             collectives=collectives.collective_stats(hlo),
             host_copies=len(re.findall(r"\bS\(5\)", hlo)))   # buffers in host memory space
  return row


def part_fn(part, cfg, stage, tx, c, state_sh, batch_sh):
  """The jitted function of --part, all taking (state, batch).

  step: train.step.train_step as the loop jits it (state donated). grad: value_and_grad of
  the loss only (gradients out in the params' shardings). update: the optimizer update and
  `apply_updates` only, with the parameters standing in for the gradients (state donated).
  """
  if part == "step":
    return jax.jit(functools.partial(step_lib.train_step, cfg=cfg, stage=stage, tx=tx,
                                     loss_chunk=c.loss_chunk, bias_rate=c.bias_update_rate,
                                     microbatches=c.microbatches),
                   in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                   donate_argnums=(0,))
  if part == "grad":
    def grad(state, batch):
      return jax.grad(lambda p: step_lib.loss_fn(p, batch, cfg=cfg, stage=stage,
                                                 loss_chunk=c.loss_chunk)[0])(state.params)
    return jax.jit(grad, in_shardings=(state_sh, batch_sh), out_shardings=state_sh.params)
  if part == "update":
    def update(state, batch):
      del batch
      updates, opt_state = tx.update(state.params, state.opt_state, state.params)
      return state.replace(params=optax.apply_updates(state.params, updates),
                           opt_state=opt_state)
    return jax.jit(update, in_shardings=(state_sh, batch_sh), out_shardings=state_sh,
                   donate_argnums=(0,))
  raise ValueError(f"--part={part!r}: expected one of {PARTS}")


def _bytes(tree) -> int:
  """Bytes of one device's shards of a tree of ShapeDtypeStructs with shardings."""
  return sum(int(math.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def table(rows) -> str:
  """One line per row; compile-OOM rows show state (computed) + required temporaries; cf is
  the expert-parallel capacity factor (- = dropless)."""
  gib = lambda x: f"{x / GIB:,.1f}" if x is not None else "-"
  head = (f"{'topology':<11}{'mesh':<19}{'stage':<11}{'seq':>7}{'L':>4}{'params':>7}"
          f"{'cf':>5}{'compile s':>10}{'args GiB':>10}{'temp GiB':>10}{'total GiB':>11}{'HBM':>5}"
          "  fits?")
  lines = [head, "-" * len(head)]
  for r in rows:
    m = r["mesh"]
    mesh = "".join(f"{a[0]}{m[a]} " for a in shd.MESH_AXES if m[a] > 1).strip()
    mesh += {"default": "", "embed_over_context": "*", "lora_over_fsdp": "**"}[r["rules"]]
    stage = r["stage"] if r.get("part", "step") == "step" else f"{r['stage'][:5]}:{r['part']}"
    stage += "+abs" if r.get("dense_attention_form") == "absorbed" else ""
    stage += {"offload_inputs": "+oi", "offload_inputs_attention": "+oia"}.get(r.get("remat"), "")
    stage += "+own" if r.get("muon_distribution") == "owner" else ""
    lead = (f"{r['topology']:<11}{mesh:<19}{stage:<11}{r['seq_len']:>7}{r['num_layers']:>4}"
            f"{'f32' if r['param_dtype'] == 'float32' else 'bf16':>7}"
            f"{r.get('moe_capacity_factor') or '-':>5}{r['compile_seconds']:>10.0f}")
    hbm = f"{r['hbm_bytes'] / GIB:>5.0f}"
    if r["ok"]:
      fits = "yes" if r["total_bytes"] <= r["hbm_bytes"] else "NO"
      lines.append(lead + f"{gib(r['argument_bytes']):>10}{gib(r['temp_bytes']):>10}"
                   f"{gib(r['total_bytes']):>11}{hbm}  {fits}")
    elif r["ok"] is None:
      fits = "NO" if r["state_bytes"] > r["hbm_bytes"] else "?"
      lines.append(lead + f"{gib(r['state_bytes']):>10}{'-':>10}{'>=' + gib(r['state_bytes']):>11}"
                   f"{hbm}  {fits} (not compiled)")
    elif "oom_temp_bytes" in r:
      total = r["state_bytes"] + r["oom_temp_bytes"]
      lines.append(lead + f"{gib(r['state_bytes']):>10}{gib(r['oom_temp_bytes']):>10}"
                   f"{'~' + gib(total):>11}{hbm}  NO (compile OOM)")
    elif "oom_total_bytes" in r:
      lines.append(lead + f"{gib(r['state_bytes']):>10}{'-':>10}{gib(r['oom_total_bytes']):>11}"
                   f"{hbm}  NO (compile OOM)")
    else:
      lines.append(lead + f"{gib(r['state_bytes']):>10}  FAILED {r['error'][:140]}")
  lines.append("stage: +abs absorbed dense attention, +oi / +oia remat offload_inputs / "
               "offload_inputs_attention, +own muon_distribution=owner.")
  lines.append("mesh: d data, f fsdp, c context, e expert, t tensor; * rules=embed_over_context "
               "(parameters' embed dim over fsdp x context), ** rules=lora_over_fsdp (embed, "
               "q_lora, kv_lora over fsdp x context). args: compiled arguments, or "
               "params + optimizer state + batch from the shardings where the compile failed; "
               "~total = that + the temporaries XLA:TPU's out-of-memory error requires.")
  return "\n".join(lines)


def main(argv):
  del argv
  if _MERGE.value:                      # earlier runs' rows -> one table and one JSON
    runs = []
    for path in _MERGE.value:
      with open(path) as f:
        runs.append(json.load(f))
    rows = [r for run in runs for r in run["rows"]]
    print(table(rows))
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        json.dump(dict(runs=[{k: v for k, v in run.items() if k != "rows"} for run in runs],
                       rows=rows), f, indent=1)
      print(f"wrote {_OUT.value}")
    return
  try:
    topo = topologies.get_topology_desc(_TOPOLOGY.value, "tpu")
  except Exception as e:  # pylint: disable=broad-except
    raise SystemExit(f"--topology={_TOPOLOGY.value!r}: no TPU topology description ({e}). This "
                     "needs libtpu: run through `bash launch/local.sh aot ...`.") from e
  devices = np.array(topo.devices)
  kind = devices.flat[0].device_kind
  hbm = _HBM_GIB.value or HBM_GIB.get(kind)
  if not hbm:
    raise ValueError(f"--hbm_gib=0: no HBM size known for device kind {kind!r}; pass --hbm_gib")
  for s in _STAGES.value:
    step_lib.get_stage(s)
  meshes = [parse_mesh(m) for m in _MESHES.value]
  layers = _NUM_LAYERS.value or config_lib.get_preset("glm5").num_hidden_layers
  settings = dict(topology=_TOPOLOGY.value, device_kind=kind, hbm_gib=hbm, jax=jax.__version__,
                  preset="glm5", num_layers=layers, param_dtype=_PARAM_DTYPE.value,
                  dtype="bfloat16", attention_impl="xla", rules=_RULES.value,
                  expert_dispatch=_DISPATCH.value, moe_capacity_factor=_CAPACITY.value,
                  part=_PART.value, dense_attention_form=_DENSE_FORM.value,
                  remat=_REMAT.value, muon_distribution=_MUON.value)
  print(f"target: {len(devices)} x {kind}, {hbm:g} GiB HBM each; compiled on "
        f"{jax.devices()[0].device_kind}; {settings}")
  rows = []
  for sizes in meshes:
    for stage in _STAGES.value:
      for t in (int(x) for x in _SEQ_LENS.value):
        r = compile_one(_TOPOLOGY.value, devices, sizes, stage, t, layers, _PARAM_DTYPE.value,
                        _RULES.value, _DISPATCH.value, hbm, part=_PART.value,
                        do_compile=_COMPILE.value, capacity_factor=_CAPACITY.value,
                        dense_form=_DENSE_FORM.value, remat=_REMAT.value,
                        muon_distribution=_MUON.value, microbatches=MICROBATCHES.value)
        rows.append(r)
        done = {True: "ok", None: "not compiled", False: f"FAILED {r.get('error', '')[:300]}"}
        print(f"  {sizes} {stage} t={t}: {done[r['ok']]} ({r['compile_seconds']:.0f} s); "
              f"params {r['param_bytes'] / GIB:.2f} GiB, opt state {r['opt_state_bytes'] / GIB:.2f}"
              f" GiB per device", flush=True)
        if r["ok"]:
          print(f"    args {r['argument_bytes'] / GIB:.2f}, temp {r['temp_bytes'] / GIB:.2f}, "
                f"out {r['output_bytes'] / GIB:.2f}, alias {r['alias_bytes'] / GIB:.2f}, total "
                f"{r['total_bytes'] / GIB:.2f} GiB; host temp {r['host_temp_bytes'] / GIB:.2f} "
                f"GiB, {r['host_copies']} host-memory shapes in the HLO", flush=True)
          print("    collectives per device: " + ", ".join(
              f"{k} {v['count']} x, {v['bytes'] / GIB:.3f} GiB"
              for k, v in r["collectives"].items() if v["count"]), flush=True)
  print(table(rows))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(dict(settings, rows=rows), f, indent=1)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
