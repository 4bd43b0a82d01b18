r"""Compile time of the training loss's forward + backward vs depth (scanned layers).

  python -m experiments.bench_compile --preset=small --layers=4,32 --out=/tmp/bench_compile.json

Lowers and compiles `value_and_grad(loss_fn)` of one stage for abstract parameters (nothing
allocated, nothing run) at each depth. With the layers scanned (glm5_jax/nn/layer_stack.py)
the program holds one layer per stack, so compile time should barely grow with depth.
Prints a table and writes JSON.
"""

import json
import platform
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.train import step as step_lib

_PRESET = flags.DEFINE_string("preset", "small", "model preset")
_LAYERS = flags.DEFINE_list("layers", ["4", "32"], "depths (num_hidden_layers)")
_STAGE = flags.DEFINE_string("stage", "pretrain", "training stage (selects the loss)")
_SEQ = flags.DEFINE_integer("seq_len", 256, "sequence length")
_BATCH = flags.DEFINE_integer("batch", 2, "batch size")
_REMAT = flags.DEFINE_string("remat", "full", "ModelConfig.remat")
_OUT = flags.DEFINE_string("out", "bench_compile.json", "JSON output path")


def compile_seconds(cfg, stage: str, batch: int, seq: int) -> dict:
  shapes, _ = gnn.abstract_params(cfg)
  ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  data = {"tokens": ids, "positions": ids, "segment_ids": ids}
  loss = lambda p, b: step_lib.loss_fn(p, b, cfg=cfg, stage=stage, loss_chunk=128)
  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  t0 = time.perf_counter()
  lowered = fn.lower(shapes, data)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
          "hlo_lines": len(lowered.as_text().splitlines())}


def main(_):
  rows = []
  for n in map(int, _LAYERS.value):
    cfg = config_lib.get_preset(_PRESET.value, num_hidden_layers=n, remat=_REMAT.value)
    rows.append({"layers": n, **compile_seconds(cfg, _STAGE.value, _BATCH.value, _SEQ.value)})
  base = rows[0]["total_s"]
  print(f"{_PRESET.value}, stage {_STAGE.value}, batch {_BATCH.value} x {_SEQ.value}, "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__}")
  print(f"{'layers':>7} {'lower s':>9} {'compile s':>10} {'total s':>9} {'vs first':>9} "
        f"{'HLO lines':>10}")
  for r in rows:
    r["vs_first"] = r["total_s"] / base
    print(f"{r['layers']:>7} {r['lower_s']:>9.2f} {r['compile_s']:>10.2f} {r['total_s']:>9.2f} "
          f"{r['vs_first']:>8.2f}x {r['hlo_lines']:>10}")
  with open(_OUT.value, "w") as f:
    json.dump({"preset": _PRESET.value, "stage": _STAGE.value, "batch": _BATCH.value,
               "seq_len": _SEQ.value, "remat": _REMAT.value, "jax": jax.__version__,
               "machine": platform.node(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
