r"""Sweep of the GPU (Triton) kernels' tiles, warps and pipeline stages at one length.

  # on a CUDA GPU, GLM-5 shapes:
  python -m experiments.tune_gpu_kernels --seq_len=32768 --out=tune_gpu_kernels.json
  # CPU (Triton interpreter; checks the script only, times mean nothing):
  python -m experiments.tune_gpu_kernels --shape=tiny --seq_len=128

Times each kernel alone on operands already in its layout, so the numbers are kernel
time, not the wrappers' padding or the custom_vjp's delta:
  sparse_fwd      `gpu.sparse_mla_fwd`   over (block_k, num_warps, num_stages,
                  queries_per_program: 1, or 2 queries per program with their own
                  softmax states)
  sparse_bwd      `gpu.sparse_mla_bwd`   over (block_k, num_warps, num_stages) (lse from
                  the forward, do = 1)
  indexer_scores  `gpu.index_scores_chunk` over all t queries at once, over
                  (block_q, block_k, num_warps, num_stages)
  indexer_topk    `reference.deterministic_topk` (XLA's top_k) of those scores in query
                  chunks: the selection the indexer made before the selection kernel
  indexer_select  the selection kernel (`selection_gpu.select_topk`) on the same scores,
                  all t rows in one call, over (block, radix_bits, num_warps); its
                  `vs first` is against indexer_topk's indices (0: the same lists)
A configuration that does not compile (shared memory, registers) is an error row. Each row
has the roofline fraction of its op (`pallas_kernels.roofline`; the backward's floor is
fwd_bwd's minus fwd's) and `vs first`: the largest difference of its output from the first
configuration's, relative to that output's largest magnitude, over entries finite in both
(the configurations compute the same sums in other orders, so small but not always zero;
the indexer's causal-dead tiles hold -inf, and which tiles are dead depends on the tile). The JSON is rewritten after
every row; the winners become the defaults in the kernels' `gpu.py`.
"""

import functools
import itertools
import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import kernel_ops
from glm5_jax import timing
from pallas_kernels import lightning_indexer
from pallas_kernels import roofline
from pallas_kernels.lightning_indexer import gpu as indexer_gpu
from pallas_kernels.lightning_indexer import selection_gpu
from pallas_kernels.lightning_indexer import xla as indexer_xla
from pallas_kernels.sparse_attention import gpu as sparse_gpu
from pallas_kernels.sparse_attention import kernel as sparse_kernel

KERNELS = ("sparse_fwd", "sparse_bwd", "indexer_scores", "indexer_topk", "indexer_select")
# (block_k, num_warps, num_stages, queries per program); the first row is the current default.
# Two queries per program: the 8-warp configurations that fit sm_90's shared memory
# (experiments/aot_gpu_kernels.py --variants; all spill 2.5-4 KB of registers) and two on
# 16 warps, which halve each thread's share of the two [64, 512] float32 accumulators.
SPARSE_FWD = ([(64, 8, 3, 1)]
              + [(32, 16, 1, 2), (16, 8, 2, 2), (64, 16, 1, 2), (32, 8, 1, 2), (16, 8, 1, 2),
                 (64, 8, 1, 2)]
              + [c + (1,) for c in itertools.product((32, 64, 128), (4, 8, 16), (1, 2, 3))
                 if c != (64, 8, 3)])
# (block, radix_bits, num_warps); the first row is the current default.
# (r = 8 is left out: its [block, 256] counters did not compile in 6 minutes for sm_90a.)
INDEXER_SELECT = [(512, 4, 4), (512, 2, 4), (1024, 4, 8), (256, 4, 4), (512, 4, 8),
                  (1024, 2, 8)]
SPARSE_BWD = [(64, 8, 1), (32, 8, 1), (32, 8, 2), (16, 8, 1), (16, 8, 2), (64, 4, 1),
              (64, 16, 1)]
# (block_q, block_k, num_warps, num_stages)
INDEXER = [(64, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 4, 2), (64, 128, 4, 2),
           (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 8, 3), (64, 128, 16, 2),
           (128, 128, 16, 2), (64, 256, 8, 2)]

_SHAPE = flags.DEFINE_enum("shape", "glm5", list(kernel_ops.SHAPES), "head/dim preset")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32768, "t = s")
_KERNELS = flags.DEFINE_list("kernels", list(KERNELS), f"subset of {KERNELS}")
_FWD_QUERIES = flags.DEFINE_list(
    "sparse_fwd_queries", ["1", "2"],
    "queries per program of the sparse_fwd configurations to sweep (the default "
    "configuration always runs first)")
_MAX_CONFIGS = flags.DEFINE_integer(
    "max_configs", 0, "at most this many configurations per kernel, in table order (each "
    "compiles for 5-20 s); 0 = all")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed runs per configuration (median)")
_CHUNK = flags.DEFINE_integer("chunk_size", 256, "query chunk of the top-k selection")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", 0.0, "matmul peak; 0 = measure")
_PEAK_GBS = flags.DEFINE_float("peak_gbs", 0.0, "memory bandwidth peak; 0 = measure")
_OUT = flags.DEFINE_string("out", "", "JSON output path (optional)")


def _rel_diff(a, b):
  """Over entries finite in both (the indexer's causal-dead tiles are -inf, at tile size)."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  fin = jnp.isfinite(a) & jnp.isfinite(b)
  return jnp.max(jnp.where(fin, jnp.abs(a - b), 0.0)) / jnp.maximum(
      jnp.max(jnp.where(fin, jnp.abs(b), 0.0)), 1e-30)


_rel_diff_jit = jax.jit(_rel_diff)


def sparse_operands(shape, t, dtype, chunk):
  """Padded q, kv, blocked indices and n_live per block size, as `kernel._gpu_fwd` builds."""
  qi, ki, wi, q, kv = kernel_ops.random_inputs(t, shape, 1, t, dtype)
  idx = jax.jit(lambda q, k, w: lightning_indexer.topk_indices(
      q, k, w, shape["topk"], chunk_size=chunk))(qi, ki, wi)
  q_p, kv_p = sparse_gpu.pad_operands(q, kv, shape["v_dim"])
  n_valid = int(jnp.sum(idx >= 0))
  return (qi, ki, wi), (q_p, kv_p, idx), n_valid


def _blocked(idx, bk):
  idx_b = sparse_kernel._blocked_indices(idx, bk)  # pylint: disable=protected-access
  return idx_b, sparse_kernel._live_blocks(idx_b, bk)[..., None]  # pylint: disable=protected-access


def configs_and_fns(kernel, shape, t, ops, chunk, interpret):
  """[(config dict, jitted fn, args)] for `kernel`."""
  (qi, ki, wi), (q_p, kv_p, idx), _ = ops
  v, scale = shape["v_dim"], shape["d_qk"] ** -0.5
  out = []
  if kernel in ("sparse_fwd", "sparse_bwd"):
    if kernel == "sparse_fwd":
      wanted = {int(x) for x in _FWD_QUERIES.value}
      table = SPARSE_FWD[:1] + [c for c in SPARSE_FWD[1:] if c[3] in wanted]
    else:
      table = [c + (1,) for c in SPARSE_BWD]
    for bk, warps, stages, queries in table:
      idx_b, live = _blocked(idx, bk)
      cfg = dict(block_k=bk, num_warps=warps, num_stages=stages)
      if kernel == "sparse_fwd":
        cfg["queries"] = queries
        fn = jax.jit(lambda q, kv, i, n, bk=bk, w=warps, st=stages, qp=queries:
                     sparse_gpu.sparse_mla_fwd(q, kv, i, n, v_dim=v, scale=scale, block_k=bk,
                                               interpret=interpret, num_warps=w,
                                               num_stages=st, queries_per_program=qp))
        out.append((cfg, fn, (q_p, kv_p, idx_b, live)))
      else:
        o, lse = jax.jit(lambda q, kv, i, n: sparse_gpu.sparse_mla_fwd(
            q, kv, i, n, v_dim=v, scale=scale, block_k=bk, interpret=interpret))(
                q_p, kv_p, idx_b, live)
        do = jnp.ones_like(o)
        delta = jnp.sum(o.astype(jnp.float32), axis=-1)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        fn = jax.jit(lambda q, kv, i, n, do, lse, dl, bk=bk, w=warps, st=stages:
                     sparse_gpu.sparse_mla_bwd(q, kv, i, n, do, lse, dl, v_dim=v, scale=scale,
                                               block_k=bk, interpret=interpret, num_warps=w,
                                               num_stages=st))
        out.append((cfg, fn, (q_p, kv_p, idx_b, live, do, lse, delta)))
    return out
  q_bjcd = jnp.swapaxes(qi, 1, 2)
  q0 = jnp.zeros((1,), jnp.int32)
  if kernel == "indexer_scores":
    for bq, bk, warps, stages in INDEXER:
      if t % bq or t % bk:
        continue
      cfg = dict(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)
      fn = jax.jit(lambda q0, q, k, w, bq=bq, bk=bk, wa=warps, st=stages:
                   indexer_gpu.index_scores_chunk(q0, q, k, w, block_q=bq, block_k=bk,
                                                  interpret=interpret, num_warps=wa,
                                                  num_stages=st))
      out.append((cfg, fn, (q0, q_bjcd, ki, wi)))
    return out
  # indexer_topk / indexer_select: selections of precomputed (kernel) scores.
  bq, bk = min(indexer_gpu.DEFAULT_BLOCK_Q, t), min(indexer_gpu.DEFAULT_BLOCK_K, t)
  scores = jax.jit(lambda q0, q, k, w: indexer_gpu.index_scores_chunk(
      q0, q, k, w, block_q=bq, block_k=bk, interpret=interpret))(q0, q_bjcd, ki, wi)
  limit = indexer_xla.causal_limit(t, t)
  if kernel == "indexer_select":
    for block, bits, warps in dict.fromkeys((min(b, t), r, w) for b, r, w in INDEXER_SELECT):
      if t % block:
        continue
      cfg = dict(block=block, radix_bits=bits, num_warps=warps)
      fn = jax.jit(lambda x, l, block=block, bits=bits, warps=warps: selection_gpu.select_topk(
          x, jnp.zeros_like(l), l, topk=shape["topk"], n_keys=t, block=block,
          radix_bits=bits, num_warps=warps, interpret=interpret)[:, :, :shape["topk"]])
      out.append((cfg, fn, (scores, limit[None])))
    return out
  out.append((dict(chunk_size=min(chunk, t)), jax.jit(functools.partial(
      xla_topk, topk=shape["topk"], chunk=min(chunk, t))), (scores,)))
  return out


def xla_topk(scores_bts, *, topk, chunk):
  """deterministic_topk (XLA's top_k) of causal scores [1, t, t] in query chunks."""
  t = scores_bts.shape[1]
  n = t // chunk
  sc = scores_bts.reshape(1, n, chunk, t).swapaxes(0, 1)
  lim = indexer_xla.causal_limit(t, t).reshape(n, chunk)
  idx = jax.lax.map(lambda a: indexer_xla.deterministic_topk(a[0], a[1], topk), (sc, lim))
  return idx.swapaxes(0, 1).reshape(1, t, topk)


def op_cost(kernel, shape, t, n_valid, dtype):
  dims = dict(b=1, t=t, s=t, n_valid=n_valid, dtype=dtype, **shape)
  if kernel == "sparse_fwd":
    return roofline.cost("sparse_fwd", **dims)
  if kernel == "sparse_bwd":
    fb, f = roofline.cost("sparse_fwd_bwd", **dims), roofline.cost("sparse_fwd", **dims)
    return roofline.Cost(fb.flops - f.flops, fb.bytes - f.bytes)
  if kernel == "indexer_scores":
    c = roofline.cost("indexer", **dims)
    return roofline.Cost(c.flops, c.bytes + t * t * 4)     # + the score matrix written
  return roofline.Cost(0.0, t * t * 4)                     # selection: the scores read once


def main(argv):
  del argv
  unknown = set(_KERNELS.value) - set(KERNELS)
  if unknown:
    raise ValueError(f"--kernels: {sorted(unknown)} unknown; expected a subset of {KERNELS}")
  shape, t, dtype = kernel_ops.SHAPES[_SHAPE.value], _SEQ_LEN.value, jnp.bfloat16
  interpret = jax.default_backend() == "cpu"
  peak_tflops, peak_gbs = _PEAK_TFLOPS.value, _PEAK_GBS.value
  if not peak_tflops or not peak_gbs:
    m_tflops, m_gbs = kernel_ops.measure_peaks(dtype)
    peak_tflops, peak_gbs = peak_tflops or m_tflops, peak_gbs or m_gbs
  device = jax.devices()[0].device_kind
  print(f"device: {device}; peak {peak_tflops:.1f} TFLOP/s, {peak_gbs:.0f} GB/s; "
        f"shape {_SHAPE.value}; t = s = {t}", flush=True)
  ops = sparse_operands(shape, t, dtype, _CHUNK.value)
  rows = []

  def write():
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        json.dump(dict(device=device, shape=_SHAPE.value, seq_len=t, peak_tflops=peak_tflops,
                       peak_gbs=peak_gbs, rows=rows), f, indent=1)

  topk_indices = None         # indexer_topk's first result: indexer_select's reference
  for kernel in _KERNELS.value:
    cost = op_cost(kernel, shape, t, ops[2], dtype)
    floor_s = roofline.floor_seconds(cost, peak_tflops, peak_gbs)
    first = topk_indices if kernel == "indexer_select" else None
    configs = configs_and_fns(kernel, shape, t, ops, _CHUNK.value, interpret)
    for cfg, fn, args in configs[:_MAX_CONFIGS.value or None]:
      row = dict(kernel=kernel, floor_seconds=floor_s, **cfg)
      try:
        secs = timing.median_time(fn, *args, repeats=_REPEATS.value)
        res = jax.tree.leaves(fn(*args))[0]
        row.update(seconds=secs, fraction=floor_s / secs)
        if first is None:
          first = res
        row["vs_first"] = float(_rel_diff_jit(res, first))
        if kernel == "indexer_topk" and topk_indices is None:
          topk_indices = res
        del res
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      rows.append(row)
      write()
      cfg_s = " ".join(f"{k}={v}" for k, v in cfg.items())
      print(f"  {kernel:<15} {cfg_s:<48} " + (
          f"FAILED {row['error']}" if "error" in row else
          f"{row['seconds'] * 1e3:9.3f} ms  {row['fraction']:7.2%}  vs first "
          f"{row['vs_first']:.2g}"), flush=True)
    del first
  if _OUT.value:
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
