r"""Forward-pass timing vs sequence length: glm5-jax (jit) vs transformers (eager).

  python -m experiments.bench_forward --lengths=1024,4096,16384 --topk=256 --out=/tmp/bench_forward.json

For each length: our jitted model forward, transformers' eager forward on the
same weights (CPU, float32, batch 1), and our lightning indexer (scores +
top-k) and sparse MLA attention timed alone for one layer. With a fixed top-k,
sparse attention should grow linearly with length and the indexer
quadratically (small constant). Prints a table, writes JSON and a PNG.
"""

import json
import os
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import timing
from glm5_jax import hf
from glm5_jax import nn as gnn
from pallas_kernels import lightning_indexer
from pallas_kernels import sparse_attention

_LENGTHS = flags.DEFINE_list("lengths", ["1024", "4096", "16384"], "sequence lengths")
_TOPK = flags.DEFINE_integer("topk", 256, "DSA index_topk (fixed across lengths)")
_PRESET = flags.DEFINE_string("preset", "tiny", "model preset")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs per point (median)")
_HF_MAX = flags.DEFINE_integer("hf_max_len", 16384, "skip transformers above this length")
_OUT = flags.DEFINE_string("out", "bench_forward.json", "JSON output path (PNG beside it)")


def _time_torch(model, tokens, repeats):
  import torch  # pylint: disable=g-import-not-at-top
  ts = []
  with torch.no_grad():
    model(torch.tensor(tokens))                        # warm up
    for _ in range(repeats):
      t0 = time.perf_counter()
      model(torch.tensor(tokens))
      ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def bench(cfg, lengths, repeats, hf_max_len):
  """Returns a list of per-length result dicts."""
  params = gnn.init_params(cfg, 0)
  hf_model = None
  try:
    import transformers  # pylint: disable=g-import-not-at-top
    d = tempfile.mkdtemp()
    hf.save_pretrained(cfg, params, d)
    hf_model = transformers.GlmMoeDsaForCausalLM.from_pretrained(d).eval()
  except ImportError:
    print("transformers not installed: skipping the eager reference")
  model = gnn.GLM5(cfg)
  fwd = jax.jit(lambda p, t: model.apply({"params": p}, t, mtp=False).logits)
  rows = []
  rng = np.random.default_rng(0)
  h, hi, di = cfg.num_attention_heads, cfg.index_n_heads, cfg.index_head_dim
  dq = cfg.kv_lora_rank + cfg.qk_rope_head_dim
  for t in lengths:
    tokens = rng.integers(0, cfg.vocab_size, (1, t))
    row = {"seq_len": t, "ours_forward_s": timing.median_time(
        fwd, params, jnp.asarray(tokens, jnp.int32), repeats=repeats)}
    f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    q_i, k_i, w_i = f32(1, t, hi, di), f32(1, t, di), f32(1, t, hi)
    topk_fn = jax.jit(lambda q, k, w: lightning_indexer.topk_indices(
        q, k, w, cfg.index_topk, chunk_size=cfg.attention_chunk_size))
    row["indexer_s"] = timing.median_time(topk_fn, q_i, k_i, w_i, repeats=repeats)
    idx = topk_fn(q_i, k_i, w_i)
    attn_fn = jax.jit(lambda q, kv, i: sparse_attention.sparse_mla(
        q, kv, i, v_dim=cfg.kv_lora_rank, scale=cfg.softmax_scale,
        chunk_size=cfg.attention_chunk_size)[0])
    row["sparse_attention_s"] = timing.median_time(attn_fn, f32(1, t, h, dq), f32(1, t, dq),
                                                   idx, repeats=repeats)
    if hf_model is not None and t <= hf_max_len:
      row["hf_eager_forward_s"] = _time_torch(hf_model, tokens, repeats)
    rows.append(row)
    print(f"  measured seq_len={t}: {row}", flush=True)
  return rows


def _growth(rows, key):
  out = [None]
  for a, b in zip(rows, rows[1:]):
    out.append(b[key] / a[key] if key in a and key in b else None)
  return out


def table(rows) -> str:
  keys = ["ours_forward_s", "hf_eager_forward_s", "indexer_s", "sparse_attention_s"]
  growth = {k: _growth(rows, k) for k in keys}
  head = f"{'seq':>7} | " + " | ".join(f"{k:>22}" for k in keys)
  lines = [head, "-" * len(head)]
  for i, r in enumerate(rows):
    cells = []
    for k in keys:
      if k not in r:
        cells.append(f"{'-':>22}")
        continue
      g = growth[k][i]
      cells.append(f"{r[k]:>10.4f}s" + (f" (x{g:5.1f})" if g else " " * 9) + "  ")
    lines.append(f"{r['seq_len']:>7} | " + " | ".join(cells))
  lines.append("(xN = growth over the previous length)")
  return "\n".join(lines)


def plot(rows, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for k in ["ours_forward_s", "hf_eager_forward_s", "indexer_s", "sparse_attention_s"]:
    pts = [(r["seq_len"], r[k]) for r in rows if k in r]
    if pts:
      ax.loglog(*zip(*pts), marker="o", label=k)
  ax.set_xlabel("sequence length")
  ax.set_ylabel("seconds")
  ax.legend()
  ax.set_title("forward time vs length (CPU)")
  fig.tight_layout()
  fig.savefig(path)


def main(argv):
  del argv
  cfg = config_lib.get_preset(_PRESET.value, index_topk=_TOPK.value, num_nextn_predict_layers=0,
                              mtp_num_steps=0, max_position_embeddings=max(
                                  int(x) for x in _LENGTHS.value))
  lengths = [int(x) for x in _LENGTHS.value]
  print(f"backend={jax.default_backend()} devices={jax.devices()} preset={_PRESET.value} "
        f"topk={_TOPK.value}")
  rows = bench(cfg, lengths, _REPEATS.value, _HF_MAX.value)
  print(table(rows))
  with open(_OUT.value, "w") as f:
    json.dump({"preset": _PRESET.value, "topk": _TOPK.value, "backend": jax.default_backend(),
               "rows": rows}, f, indent=2)
  plot(rows, os.path.splitext(_OUT.value)[0] + ".png")


if __name__ == "__main__":
  app.run(main)
