r"""Ahead-of-time compile of the Pallas Triton kernels for an H200 (sm_90a), no GPU needed.

`tests/pallas_kernels/test_export.py` stops at JAX's Pallas -> Triton IR lowering. This script
goes on through Triton's own compiler (TTIR -> TTGIR -> LLVM -> PTX -> cubin) with the
`triton` wheel from PyPI, then runs the wheel's `ptxas -v` on the PTX, and reports per
kernel: registers/thread, spill bytes, shared memory (Triton's dynamic smem), GPU-scope
fences in the SASS (`MEMBAR.ALL.GPU`, which acquire-release atomics cost), or the error.
Shapes: GLM-5 prefill (t = s = 4096) and decode (t = 1 against a 4096-row cache; forward
kernels only); the top-k selection also alone at GLM-5's longest context (k = 2048 of
s = 202,752 keys); the sparse forward also with two queries per program.

Runs in the `aot` venv of launch/local.sh (the project's venv does not get `triton`):

  bash launch/local.sh aot python -m experiments.aot_gpu_kernels \
      --out=/tmp/aot_gpu_kernels.json [--variants]

How: `jax.export(..., platforms=["cuda"])` lowers each `pallas_call`; the script wraps
`lower_jaxpr_to_triton_module` to keep each kernel's Triton module as text (the custom
call carries it as MLIR bytecode), and reads num_warps / num_stages from the custom
call's backend_config. The module is run through Triton's `make_ttir` passes (as XLA's
pipeline does; `triton.compile` skips the first stage for an IR file) and compiled.

Caveats: on a GPU, XLA compiles the same IR with the Triton bundled in jaxlib and the
CUDA toolkit's ptxas, not this wheel's, so numbers can differ somewhat. num_warps and
num_stages are compile options (the TTIR does not depend on them), so the variants
here equal editing NUM_WARPS / num_stages in the kernels' gpu.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import pallas_call_registration as _pallas_triton

import triton
from triton._C.libtriton import ir as tt_ir
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

from pallas_kernels import testing
from pallas_kernels.lightning_indexer import kernel as indexer_kernel
from pallas_kernels.lightning_indexer import selection_gpu
from pallas_kernels.sparse_attention import gpu as sparse_gpu
from pallas_kernels.sparse_attention import kernel as sparse_kernel

SEQ = 4096
H, D_QK, V_DIM, TOPK = 64, 576, 512, 2048      # sparse MLA (GLM-5, docs/design.md §1)
H_I, D_I = 32, 128                              # lightning indexer
TARGET = GPUTarget("cuda", 90, 32)              # H200
SMEM_LIMIT = 227 * 1024                         # per block, sm_90
TRITON_CALL = "__gpu$xla.gpu.triton"


def export_triton_modules(fn, *args):
  """Lowers jit(fn)(*args) for CUDA; returns {kernel name: (ttir text, num_warps, num_stages)}."""
  texts = {}
  orig = _pallas_triton.lowering.lower_jaxpr_to_triton_module

  def capture(jaxpr, *a, **kw):
    result = orig(jaxpr, *a, **kw)
    texts[jaxpr.debug_info.func_name] = result.module.operation.get_asm()
    return result

  _pallas_triton.lowering.lower_jaxpr_to_triton_module = capture
  try:
    with testing.cuda_target():
      module = jax.export.export(
          jax.jit(fn), platforms=["cuda"],
          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
      )(*args).mlir_module()
  finally:
    _pallas_triton.lowering.lower_jaxpr_to_triton_module = orig
  kernels = {}
  for line in module.splitlines():
    if f"custom_call @{TRITON_CALL}" in line:
      name = re.search(r'name = "([\w$.]+)"', line).group(1)
      warps = int(re.search(r"num_warps = (\d+)", line).group(1))
      stages = int(re.search(r"num_stages = (\d+)", line).group(1))
      kernels[name] = (texts[name], warps, stages)
  return kernels


def sparse_mla_modules(block_k=None, t=SEQ, backward=True):
  """Triton modules of sparse MLA forward (and backward) for t queries over SEQ cache rows."""
  args = (jax.ShapeDtypeStruct((1, t, H, D_QK), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, SEQ, D_QK), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, t, TOPK), jnp.int32))

  def f(q, kv, idx):
    return sparse_kernel.sparse_mla(q, kv, idx, v_dim=V_DIM, scale=D_QK ** -0.5,
                                    backend="gpu", block_k=block_k)

  def fwd_bwd(q, kv, idx):
    (out, lse), vjp = jax.vjp(lambda q, kv: f(q, kv, idx), q, kv)
    return out, lse, vjp((out, lse))

  return export_triton_modules(fwd_bwd if backward else f, *args)


def indexer_modules(block_q=None, block_k=None, t=SEQ):
  """Triton module of the lightning-indexer scores kernel for t queries over SEQ keys."""
  args = (jax.ShapeDtypeStruct((1, t, H_I, D_I), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, SEQ, D_I), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, t, H_I), jnp.float32))
  f = lambda q, k, w: indexer_kernel.topk_indices(q, k, w, TOPK, backend="gpu",
                                                  block_q=block_q, block_k=block_k)
  return export_triton_modules(f, *args)


def selection_modules(s=202752, rows=256, block=None, radix_bits=None):
  """Triton module of the top-k selection kernel alone: k = TOPK of s keys, `rows` queries."""
  args = (jax.ShapeDtypeStruct((1, rows, s), jnp.float32),
          jax.ShapeDtypeStruct((1, rows), jnp.int32), jax.ShapeDtypeStruct((1, rows), jnp.int32))
  kw = {k: v for k, v in (("block", block), ("radix_bits", radix_bits)) if v is not None}
  f = lambda x, lo, hi: selection_gpu.select_topk(x, lo, hi, topk=TOPK, n_keys=s, **kw)
  return export_triton_modules(f, *args)


def sparse_fwd_modules(queries_per_program=2, block_k=32, num_stages=1, t=SEQ):
  """Triton module of the sparse MLA forward with `queries_per_program` queries per program."""
  args = (jax.ShapeDtypeStruct((1, t, H, D_QK), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, SEQ, D_QK), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, t, TOPK), jnp.int32),
          jax.ShapeDtypeStruct((1, t, 1), jnp.int32))
  f = lambda q, kv, idx, n: sparse_gpu.sparse_mla_fwd(
      q, kv, idx, n, v_dim=V_DIM, scale=D_QK ** -0.5, block_k=block_k, num_stages=num_stages,
      queries_per_program=queries_per_program)
  return export_triton_modules(f, *args)


def ptxas_report(ptx: str) -> dict:
  """Runs the wheel's ptxas -v on `ptx` with Triton's flags for sm_90; parses its summary."""
  ptxas = triton.knobs.nvidia.ptxas_blackwell.path    # what Triton itself uses for sm >= 90
  with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "k.ptx")
    with open(src, "w") as f:
      f.write(ptx)
    proc = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2",
                           "--gpu-name=sm_90a", src, "-o", src + ".o"],
                          capture_output=True, text=True, check=True)
  log = proc.stderr
  num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None
  return dict(registers=num(r"Used (\d+) registers"),
              spill_stores=num(r"(\d+) bytes spill stores"),
              spill_loads=num(r"(\d+) bytes spill loads"),
              stack_frame=num(r"(\d+) bytes stack frame"))


def gpu_fences(cubin: bytes) -> int:
  """Number of `MEMBAR.ALL.GPU` instructions in the kernel's SASS (wheel's nvdisasm)."""
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    sass = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", f.name],
                          capture_output=True, text=True, check=True).stdout
  return sass.count("MEMBAR.ALL.GPU")


def compile_kernel(name: str, ttir: str, num_warps: int, num_stages: int) -> dict:
  """Compiles one kernel's TTIR for TARGET; returns resource use or the error."""
  row = dict(kernel=name, num_warps=num_warps, num_stages=num_stages)
  t0 = time.time()
  try:
    backend = make_backend(TARGET)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    ctx = tt_ir.context()
    tt_ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, f"{name}.ttir")
      with open(path, "w") as f:
        f.write(ttir)
      mod = tt_ir.parse_mlir_module(path, ctx)
      mod.context = ctx
      mod = backend.make_ttir(mod, {}, options, TARGET.arch)
      with open(path, "w") as f:
        f.write(str(mod))
      compiled = triton.compile(path, target=TARGET,
                                options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    row.update(ok=True, shared=compiled.metadata.shared, **ptxas_report(ptx),
               wgmma="wgmma" in ptx, gpu_fences=gpu_fences(compiled.asm["cubin"]), error=None)
    row["smem_ok"] = row["shared"] <= SMEM_LIMIT
  except Exception as e:  # pylint: disable=broad-except
    row.update(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
  row["compile_s"] = round(time.time() - t0, 1)
  return row


HEADER = ["kernel", "config", "warps", "stages", "regs", "spill st/ld B", "smem B", "wgmma",
          "membar.gpu", "status"]


def print_row(r):
  """One table line: kernel, launch config, registers, spills, smem, status."""
  if r["ok"]:
    status = "ok" if r["smem_ok"] else f"smem > {SMEM_LIMIT}"
    vals = [r["registers"], f'{r["spill_stores"]}/{r["spill_loads"]}', r["shared"],
            r["wgmma"], r["gpu_fences"], status]
  else:
    vals = ["-", "-", "-", "-", "-", "error: " + r["error"].strip().splitlines()[0][:120]]
  print(" | ".join(str(v) for v in [r["kernel"], r["config"], r["num_warps"],
                                      r["num_stages"], *vals]), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="/tmp/aot_gpu_kernels.json")
  parser.add_argument("--variants", action="store_true",
                      help="also try other block sizes / num_warps / num_stages")
  parser.add_argument("--dump_dir", default=None,
                      help="write each kernel's TTIR (as lowered by JAX) here")
  flags = parser.parse_args()
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # 3.9's default, minus the warning

  # (config label, kernels dict, [(num_warps, num_stages) overrides or None = as exported])
  jobs = [("default", sparse_mla_modules(), [None]),
          ("default", indexer_modules(), [None]),
          ("decode t=1", sparse_mla_modules(t=1, backward=False), [None]),
          ("decode t=1", indexer_modules(t=1), [None]),
          ("s=202752", selection_modules(), [None]),
          ("2 queries/program, bk=32", sparse_fwd_modules(2, 32, 1), [None])]
  if flags.variants:
    jobs[0][2].extend([(8, 2), (8, 3), (16, 1), (16, 2)])
    jobs[1][2].extend([(8, 2), (4, 3)])
    for bk in (32, 16):
      jobs.append((f"block_k={bk}", sparse_mla_modules(block_k=bk), [None, (8, 2), (8, 3)]))
    for bq, bk in ((64, 64), (64, 128), (128, 128)):
      jobs.append((f"block_q={bq},block_k={bk}", indexer_modules(bq, bk), [None, (8, 2)]))
    for bk, stages in ((16, 1), (16, 2), (32, 2), (64, 1)):
      jobs.append((f"2 queries/program, bk={bk}", sparse_fwd_modules(2, bk, stages), [None]))
    for block, bits in ((1024, 4), (512, 2)):      # r = 8: no compile within 6 minutes
      jobs.append((f"select block={block},r={bits}", selection_modules(block=block,
                                                                       radix_bits=bits),
                   [None, (8, 2)]))

  print(" | ".join(HEADER))
  rows = []
  for label, kernels, configs in jobs:
    for name, (ttir, warps, stages) in kernels.items():
      if flags.dump_dir:
        os.makedirs(flags.dump_dir, exist_ok=True)
        with open(os.path.join(flags.dump_dir, f"{name}.{label}.ttir"), "w") as f:
          f.write(ttir)
      for w, s in dict.fromkeys(cfg or (warps, stages) for cfg in configs):
        row = compile_kernel(name, ttir, w, s)
        row["config"] = label
        rows.append(row)
        print_row(row)

  with open(flags.out, "w") as f:
    json.dump(dict(triton=triton.__version__, jax=jax.__version__, target="cuda sm_90a",
                   smem_limit=SMEM_LIMIT, rows=rows), f, indent=1)
  print(f"wrote {flags.out}")


if __name__ == "__main__":
  main()
