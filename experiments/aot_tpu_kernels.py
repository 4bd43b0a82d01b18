r"""Compiles the DSA kernels for a TPU with libtpu's compiler, on a host without a TPU.

  bash launch/local.sh aot python -m experiments.aot_tpu_kernels \
      --topology=v5e:2x2 --lengths=4096,32768 --out=/tmp/aot_tpu.json

`jax.export` (tests/pallas_kernels/test_export.py) runs only JAX's Pallas lowering. This
script goes one step further: with `libtpu` installed (the `aot` venv of
launch/local.sh), `jax.experimental.topologies.get_topology_desc` describes a
TPU slice without owning one, and `jit(...).trace(...).lower(...).compile()`
runs XLA:TPU and Mosaic, the compilers that run on a real TPU VM. A kernel that
does not fit VMEM, uses an op Mosaic cannot lay out, or makes XLA pad an
operand's HBM layout shows up here. Nothing executes, so there are no times.

For each op (those of bench_kernels: `indexer`, `sparse_fwd`, `sparse_fwd_bwd`),
sequence length (t = s) and implementation it prints the compiled program's
HBM use from `memory_analysis()`: arguments, outputs and temporaries (with
row-major argument layouts, see `row_major`), next to the roofline's bytes that
must move (`pallas_kernels.roofline`); the top-k selection kernel, compiled alone at
--select_lengths keys (up to GLM-5's 202,752), reports the VMEM it declares and the least
VMEM limit under which Mosaic compiles it. The `xla`
reference is compiled too: at long context its gathered [t, topk, d] rows are
what the kernels exist to avoid.
"""

import json
import time

from absl import app
from absl import flags
import jax
from jax.experimental import topologies
from jax.experimental.layout import Format
from jax.experimental.layout import Layout
import jax.numpy as jnp

from experiments import kernel_ops
from pallas_kernels import roofline
from pallas_kernels.lightning_indexer import selection_tpu

_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x2",
                                "TPU topology name, e.g. v5e:2x2, v6e:2x2, v5p:2x2x1, v4:2x2x1")
_LENGTHS = flags.DEFINE_list("lengths", ["4096", "32768"], "sequence lengths (t = s)")
_OPS = flags.DEFINE_list("ops", list(kernel_ops.OPS), "subset of kernel_ops.OPS")
_IMPLS = flags.DEFINE_list("impls", ["pallas", "xla"], "implementations to compile")
_SHAPE = flags.DEFINE_enum("shape", "glm5", list(kernel_ops.SHAPES), "head/dim preset")
_BATCH = flags.DEFINE_integer("batch", 1, "batch size")
_CHUNK = flags.DEFINE_integer("chunk_size", 256, "query chunk of both impls")
_SELECT_LENGTHS = flags.DEFINE_list(
    "select_lengths", ["32768", "202752"],
    "key counts s at which the top-k selection kernel also compiles alone (256 query rows, "
    "k = the shape's topk), with the least VMEM limit it compiles under; empty: skip")
_OUT = flags.DEFINE_string("out", "", "JSON output path (optional)")


def tpu_device(topology: str):
  """First device of a described (not owned) TPU slice."""
  try:
    topo = topologies.get_topology_desc(topology, "tpu")
  except Exception as e:  # pylint: disable=broad-except
    raise SystemExit(f"--topology={topology!r}: no TPU topology description ({e}). This "
                     "needs libtpu: run through `bash launch/local.sh aot ...`.") from e
  return topo.devices[0]


def row_major(arg, sharding):
  """`arg` with a fixed row-major HBM layout.

  Left free, XLA:TPU picks each entry parameter's layout and then copies q into
  the layout the kernel asks for, a temporary as large as q that a model (where
  q comes out of an einsum laid out for its consumer) does not have.
  """
  fmt = Format(Layout(major_to_minor=tuple(range(arg.ndim))), sharding)
  return jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=fmt)


def compile_one(op, impl, shape, b, t, chunk, sharding):
  """Compiles one (op, impl, t) for the TPU; returns a result row."""
  fn = kernel_ops.op_fn(op, impl, shape, backend="tpu", chunk=chunk, interpret=False)
  row = dict(op=op, impl=impl, seq_len=t)
  args = [row_major(a, sharding) for a in kernel_ops.arg_shapes(op, shape, b, t)]
  start = time.perf_counter()
  try:
    compiled = fn.trace(*args).lower(lowering_platforms=("tpu",)).compile()
  except Exception as e:  # pylint: disable=broad-except
    row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return row
  mem = compiled.memory_analysis()
  n_valid = b * sum(min(i + 1, shape["topk"]) for i in range(t))
  need = roofline.cost(op, b=b, t=t, s=t, n_valid=n_valid, dtype=jnp.bfloat16, **shape).bytes
  row.update(ok=True, compile_seconds=time.perf_counter() - start,
             argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
             temp_bytes=mem.temp_size_in_bytes, roofline_bytes=need)
  return row


def compile_selection(s, topk, rows, sharding, vmem_limit_bytes=None):
  """The selection kernel alone over float32 scores [1, rows, s], compiled for the TPU."""
  sds = lambda shp, dt: jax.ShapeDtypeStruct(shp, dt, sharding=sharding)
  args = (sds((1, rows, s), jnp.float32), sds((1, rows), jnp.int32), sds((1, rows), jnp.int32))
  fn = jax.jit(lambda x, lo, hi: selection_tpu.select_topk(
      x, lo, hi, topk=topk, n_keys=s, vmem_limit_bytes=vmem_limit_bytes))
  return fn.trace(*args).lower(lowering_platforms=("tpu",)).compile()


def selection_row(s, topk, sharding, rows=256) -> dict:
  """Compiles the selection at s keys; the VMEM it declares and the least limit (MiB) that
  compiles (a bisection: Mosaic refuses a kernel whose buffers and temporaries exceed it)."""
  row = dict(op="select", impl="pallas", seq_len=s, topk=topk,
             declared_vmem_bytes=selection_tpu.vmem_bytes(s, selection_tpu.padded_topk(topk)))
  start = time.perf_counter()
  try:
    compile_selection(s, topk, rows, sharding)
  except Exception as e:  # pylint: disable=broad-except
    row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return row
  row["compile_seconds"] = time.perf_counter() - start
  lo, hi = 0, -(-row["declared_vmem_bytes"] // 2 ** 20) + 8     # MiB: lo fails, hi compiles
  while hi - lo > 1:
    mid = (lo + hi) // 2
    try:
      compile_selection(s, topk, rows, sharding, vmem_limit_bytes=mid * 2 ** 20)
      hi = mid
    except Exception:  # pylint: disable=broad-except
      lo = mid
  row.update(ok=True, least_vmem_limit_mib=hi)
  return row


def table(rows) -> str:
  mib = lambda x: f"{x / 2 ** 20:,.0f}"
  head = (f"{'op':<15}{'seq':>7} {'impl':<7}{'compile s':>10}{'args MiB':>11}{'out MiB':>10}"
          f"{'temp MiB':>11}{'temp/roofline':>14}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lead = f"{r['op']:<15}{r['seq_len']:>7} {r['impl']:<7}"
    if r["ok"] and r["op"] == "select":
      lines.append(lead + f"{r['compile_seconds']:>10.1f}  VMEM declared "
                   f"{r['declared_vmem_bytes'] / 2 ** 20:.1f} MiB, compiles under a limit of "
                   f"{r['least_vmem_limit_mib']} MiB (k = {r['topk']}, 8 query rows per program)")
      continue
    if not r["ok"]:
      lines.append(lead + f"  FAILED {r['error']}")
      continue
    lines.append(lead + f"{r['compile_seconds']:>10.1f}{mib(r['argument_bytes']):>11}"
                 f"{mib(r['output_bytes']):>10}{mib(r['temp_bytes']):>11}"
                 f"{r['temp_bytes'] / r['roofline_bytes']:>14.2f}")
  return "\n".join(lines)


def main(argv):
  del argv
  kernel_ops.check_ops(_OPS.value)
  device = tpu_device(_TOPOLOGY.value)
  sharding = jax.sharding.SingleDeviceSharding(device)
  shape = kernel_ops.SHAPES[_SHAPE.value]
  print(f"target: {device.device_kind} ({_TOPOLOGY.value}), compiled on "
        f"{jax.devices()[0].device_kind}; shape {_SHAPE.value} {shape}; jax {jax.__version__}")
  rows = []
  for t in (int(x) for x in _LENGTHS.value):
    for op in _OPS.value:
      for impl in _IMPLS.value:
        rows.append(compile_one(op, impl, shape, _BATCH.value, t, _CHUNK.value, sharding))
        print(f"  {op} t={t} {impl}: {'ok' if rows[-1]['ok'] else 'FAILED'}", flush=True)
  for s in (int(x) for x in _SELECT_LENGTHS.value):
    rows.append(selection_row(s, shape["topk"], sharding))
    print(f"  select s={s}: {'ok' if rows[-1]['ok'] else 'FAILED'}", flush=True)
  print(table(rows))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(dict(target=device.device_kind, topology=_TOPOLOGY.value,
                     jax=jax.__version__, shape=_SHAPE.value, dims=shape, rows=rows), f,
                indent=1)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
