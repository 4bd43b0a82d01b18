r"""DSA kernel benchmark: Pallas kernels vs the xla (jnp) path, against the roofline floor.

  # CPU (kernels in interpret mode; checks that the script and kernels run, times mean little):
  python -m experiments.bench_kernels --out=/tmp/bench_kernels.json
  # accelerator, GLM-5 shapes:
  python -m experiments.bench_kernels --shape=glm5 --lengths=8192,32768,131072 \
      --out=bench_kernels.json

For each op and sequence length (prefill, t = s), times the `pallas` and `xla`
implementations (median wall clock after a warm-up; `block_until_ready`), and
prints the roofline floor: FLOPs that must run and bytes that must move, each at
the device's peak (`--peak_tflops` / `--peak_gbs`, measured with a large matmul
and a large copy when 0), floor = max of the two, and the achieved fraction
floor / time. The sizing is in `pallas_kernels.roofline`.

Correctness on the device, per point:
  `vs xla`  (pallas rows) how far the kernel's outputs are from the xla path's;
  `vs f32`  (every row) how far each impl's are from the float32 reference: the
            xla path on float32 copies of the same inputs with every matmul at
            HIGHEST precision (`--check_f32=false` skips it);
  `rerun`   (pallas rows) whether a second call gave bitwise the same outputs
            (the GPU backward adds dkv with float atomics, whose order varies).
For the indexer the distance is the fraction of selected (query, slot) entries that
the other selection lacks (`rows_differ` in the JSON: the fraction of queries whose
top-k differs at all); for attention it is the largest normwise relative error,
max|a - b| / max|b|, of any output.
A point that fails (out of memory, a compile error) is recorded as an error row
and the run goes on; the JSON is rewritten after every point, so a run cut short
by a time limit still leaves what it measured.

Impls: `pallas` (the kernels), `xla` (the jnp path), `pallas_topk` (indexer only: the
score kernel followed by XLA's top_k instead of the selection kernel; the pallas row's
`same_as_topk` says whether the two selections were identical).

Ops: `indexer` (scores + top-k), `sparse_fwd` (sparse MLA forward),
`sparse_fwd_bwd` (forward + gradients of q and kv). Indices come from the
indexer on random inputs, so early queries have -1 tails as in the model.
"""

import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import kernel_ops
from glm5_jax import timing
from pallas_kernels import lightning_indexer
from pallas_kernels import roofline

_SHAPE = flags.DEFINE_enum("shape", "tiny", list(kernel_ops.SHAPES), "head/dim preset")
_LENGTHS = flags.DEFINE_list("lengths", ["64", "128"], "sequence lengths (t = s)")
_OPS = flags.DEFINE_list("ops", list(kernel_ops.OPS), f"subset of {kernel_ops.OPS}")
_IMPLS = flags.DEFINE_list("impls", ["pallas", "xla"],
                           f"implementations to time, of {kernel_ops.IMPLS} (pallas_topk: the "
                           "indexer's score kernel with XLA's top_k, the selection before "
                           "the selection kernel)")
_BATCH = flags.DEFINE_integer("batch", 1, "batch size")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "activation dtype")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs per point (median)")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", 0.0, "matmul peak; 0 = measure")
_PEAK_GBS = flags.DEFINE_float("peak_gbs", 0.0, "memory bandwidth peak; 0 = measure")
_CHUNK = flags.DEFINE_integer("chunk_size", 256, "query chunk of both impls")
_CHECK_F32 = flags.DEFINE_bool("check_f32", True, "compare each impl with a float32 reference")
_TILES = {name: flags.DEFINE_integer(name, 0, f"pallas kernel tile {name}; 0 = the default")
          for name in ("sparse_block_k", "indexer_block_q", "indexer_block_k")}
_BACKEND = flags.DEFINE_enum(
    "backend", "auto", ["auto", "tpu", "gpu"],
    "kernel lowering; auto = the device's, and on CPU the GPU (Triton) kernels, whose "
    "interpreter is compiled and fast (the TPU interpreter simulates every DMA)")
_OUT = flags.DEFINE_string("out", "", "JSON output path (optional)")


def bench(shape, lengths, ops, impls, batch, dtype, repeats, peak_tflops, peak_gbs, chunk,
          backend, tiles=None, on_row=lambda rows: None, check_f32=True):
  """Times every (length, op, impl); a failure (e.g. out of memory) becomes an error row.

  on_row(rows) runs after each row, so a run cut short still leaves its results.
  """
  rows = []
  for t in lengths:
    qi, ki, wi, q, kv = kernel_ops.random_inputs(t, shape, batch, t, dtype)
    # The selection the model would make (xla path: robust; not timed here).
    idx = jax.jit(lambda q, k, w: lightning_indexer.topk_indices(
        q, k, w, shape["topk"], chunk_size=chunk))(qi, ki, wi)
    n_valid = int(jnp.sum(idx >= 0))
    for op in ops:
      args = (qi, ki, wi) if op == "indexer" else (q, kv, idx)
      cost = roofline.cost(op, b=batch, t=t, s=t, n_valid=n_valid, dtype=dtype, **shape)
      floor_s = roofline.floor_seconds(cost, peak_tflops, peak_gbs)
      outputs, op_rows = {}, {}
      for impl in impls:
        if impl == "pallas_topk" and op != "indexer":
          continue
        row = dict(op=op, seq_len=t, impl=impl, gflop=cost.flops / 1e9, mbytes=cost.bytes / 1e6,
                   floor_seconds=floor_s, bound=roofline.bound(cost, peak_tflops, peak_gbs))
        try:
          fn = kernel_ops.op_fn(op, impl, shape, backend, chunk, tiles=tiles)
          secs = timing.median_time(fn, *args, repeats=repeats)
          row.update(seconds=secs, fraction=floor_s / secs)
          outputs[impl] = fn(*args)
          print(f"  {op} t={t} {impl}: {secs * 1e3:.2f} ms", flush=True)
          if impl != "xla":
            row["rerun"] = _identical(outputs[impl], fn(*args))
        except Exception as e:  # pylint: disable=broad-except
          row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
          print(f"  {op} t={t} {impl}: FAILED {row['error']}", flush=True)
        rows.append(row)
        op_rows[impl] = row
        on_row(rows)
      for impl in outputs:                           # the kernels checked on this device
        if impl != "xla" and "xla" in outputs:
          _check(op_rows[impl], "vs_xla", op, outputs[impl], outputs["xla"])
      if len(outputs) > 1:
        on_row(rows)
      if "pallas" in outputs and "pallas_topk" in outputs:   # the two selections: identical?
        op_rows["pallas"]["same_as_topk"] = _identical(outputs["pallas"], outputs["pallas_topk"])
        print(f"  {op} t={t} pallas selection == XLA top_k on the same scores: "
              f"{op_rows['pallas']['same_as_topk']}", flush=True)
        on_row(rows)
      if check_f32 and outputs:
        try:
          want = f32_reference(op, shape, chunk)(*args)
          for impl, got in outputs.items():
            _check(op_rows[impl], "vs_f32", op, got, want)
          del want
        except Exception as e:  # pylint: disable=broad-except
          err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
          for name in outputs:
            op_rows[name]["vs_f32_error"] = err
          print(f"  {op} t={t} f32 reference FAILED {err}", flush=True)
        on_row(rows)
      del outputs
  return rows


def f32_reference(op, shape, chunk):
  """The xla path on float32 copies of the inputs, every matmul at HIGHEST precision."""
  fn = kernel_ops.op_fn(op, "xla", shape, None, chunk)
  up = lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a

  def ref(*args):
    with jax.default_matmul_precision("highest"):
      return fn(*map(up, args))
  return ref


def _check(row, key, op, got, want):
  """Stores mismatch(op, got, want) in row[key] (an error string where it fails), prints it."""
  try:
    row.update(mismatch(op, got, want, prefix=key))
    print(f"  {op} t={row['seq_len']} {row['impl']} {key}: {row[key]:.3g}", flush=True)
  except Exception as e:  # pylint: disable=broad-except
    row[key + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    print(f"  {op} t={row['seq_len']} {row['impl']} {key}: FAILED {row[key + '_error']}",
          flush=True)


@jax.jit
def _normwise_error(a, b):
  """max|a - b| / max|b| over b's finite entries, in float32 (fused: no float32 copies)."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  finite = jnp.isfinite(b)
  scale = jnp.max(jnp.where(finite, jnp.abs(b), 0.0))
  return jnp.max(jnp.where(finite, jnp.abs(a - b), 0.0)) / jnp.maximum(scale, 1e-30)


@jax.jit
def _selection_mismatch(got_btk, want_btk):
  """(fraction of want's valid (query, slot) entries missing from got's row, fraction of rows
  whose selection differs as a set)."""
  k = got_btk.shape[-1]
  got = jnp.sort(got_btk.reshape(-1, k), axis=-1)
  want = want_btk.reshape(-1, k)

  def missing(g, w):
    found = g[jnp.minimum(jnp.searchsorted(g, w), k - 1)] == w
    return (w >= 0) & ~found

  miss = jax.vmap(missing)(got, want)
  n_valid = jnp.maximum(jnp.sum(want >= 0), 1)
  return jnp.sum(miss) / n_valid, jnp.mean(jnp.any(miss, axis=-1))


def mismatch(op, got, want, prefix="vs") -> dict:
  """{prefix: distance} (and for the indexer {prefix_rows_differ: ...}); see the docstring."""
  if op == "indexer":
    slots, rows = _selection_mismatch(got, want)
    return {prefix: float(slots), prefix + "_rows_differ": float(rows)}
  return {prefix: max(float(_normwise_error(a, b))
                      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))}


def _identical(a, b) -> bool:
  return all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def table(rows) -> str:
  head = (f"{'op':<15}{'seq':>8} {'impl':<12}{'time ms':>11}{'GFLOP':>11}{'MB':>11}"
          f"{'floor ms':>11} {'bound':<8}{'fraction':>9}{'vs xla':>10}{'vs f32':>10}{'rerun':>8}")
  lines = [head, "-" * len(head)]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['op']:<15}{r['seq_len']:>8} {r['impl']:<12}  FAILED {r['error']}")
      continue
    lines.append(f"{r['op']:<15}{r['seq_len']:>8} {r['impl']:<12}{r['seconds'] * 1e3:>11.4g}"
                 f"{r['gflop']:>11.4g}{r['mbytes']:>11.4g}{r['floor_seconds'] * 1e3:>11.4g} "
                 f"{r['bound']:<8}{r['fraction']:>9.3%}"
                 + "".join(f"{r[k]:>10.2g}" if k in r else f"{'-':>10}" for k in ("vs_xla", "vs_f32"))
                 + (f"{('same' if r['rerun'] else 'differs'):>8}" if "rerun" in r else ""))
  return "\n".join(lines)


def main(argv):
  del argv
  kernel_ops.check_ops(_OPS.value)
  bad = set(_IMPLS.value) - set(kernel_ops.IMPLS)
  if bad:
    raise ValueError(f"--impls: {sorted(bad)} unknown; expected a subset of {kernel_ops.IMPLS}")
  dtype = jnp.dtype(_DTYPE.value)
  peak_tflops, peak_gbs = _PEAK_TFLOPS.value, _PEAK_GBS.value
  if not peak_tflops or not peak_gbs:
    m_tflops, m_gbs = kernel_ops.measure_peaks(dtype)
    peak_tflops, peak_gbs = peak_tflops or m_tflops, peak_gbs or m_gbs
  device = jax.devices()[0].device_kind
  print(f"device: {device} ({jax.default_backend()}); peak {peak_tflops:.2f} TFLOP/s, "
        f"{peak_gbs:.1f} GB/s; shape {_SHAPE.value} {kernel_ops.SHAPES[_SHAPE.value]}; dtype {dtype}")
  backend = None if _BACKEND.value == "auto" else _BACKEND.value
  if jax.default_backend() == "cpu":
    backend = backend or "gpu"
    print(f"CPU: the pallas impl runs the {backend} kernels in the Pallas interpreter; "
          "its times are not kernel times.")
  tiles = {name: f.value or None for name, f in _TILES.items()}
  meta = dict(device=device, backend=jax.default_backend(), kernels=backend or "auto",
              shape=_SHAPE.value, dims=kernel_ops.SHAPES[_SHAPE.value], dtype=str(dtype),
              peak_tflops=peak_tflops, peak_gbs=peak_gbs, tiles=tiles)

  def write(rows):
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)

  rows = bench(kernel_ops.SHAPES[_SHAPE.value], [int(x) for x in _LENGTHS.value], _OPS.value,
               _IMPLS.value, _BATCH.value, dtype, _REPEATS.value, peak_tflops, peak_gbs,
               _CHUNK.value, backend, tiles=tiles, on_row=write, check_f32=_CHECK_F32.value)
  print(table(rows))
  if _OUT.value:
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
