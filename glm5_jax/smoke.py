"""The main job until pretraining lands: build a model, run forward + backward, summarize.

Data: byte-level tokens of the Python standard library's own source files
(a real code corpus already on the machine; no download).
"""

from __future__ import annotations

import glob
import os
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import losses
from glm5_jax import nn as gnn
from glm5_jax import summary


def stdlib_bytes(n_bytes: int, seed: int = 0) -> np.ndarray:
  """n_bytes of concatenated standard-library .py files, from a seeded random start file."""
  files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
  if not files:
    raise FileNotFoundError("no standard-library .py files found for the byte corpus")
  rng = np.random.default_rng(seed)
  out, i = bytearray(), int(rng.integers(len(files)))
  while len(out) < n_bytes:
    with open(files[i % len(files)], "rb") as f:
      out += f.read()
    i += 1
  return np.frombuffer(bytes(out[:n_bytes]), np.uint8).astype(np.int32)


def total_loss(model, cfg, params, tokens):
  """LM CE + MTP loss + indexer KL (coefficient from the config); returns (loss, parts)."""
  out = model.apply({"params": params}, tokens, with_indexer_loss=True, return_logits=False)
  head = params["lm_head"]["kernel"]
  y, m = losses.next_token_targets(tokens)
  ce, _ = losses.chunked_cross_entropy(out.hidden, head, y, m)
  mtp_ce = []
  for k in range(cfg.mtp_num_steps if out.mtp_hidden is not None else 0):
    yk, mk = losses.next_token_targets(tokens, offset=k + 2)
    mtp_ce.append(losses.chunked_cross_entropy(out.mtp_hidden[k], head, yk, mk)[0])
  mtp = losses.mtp_loss(mtp_ce, cfg.mtp_loss_weight)
  kl = jnp.sum(out.indexer_kl) * cfg.indexer_loss_coeff
  parts = {"ce": ce, "mtp": mtp, "indexer_kl": jnp.mean(out.indexer_kl),
           "expert_load_max": jnp.max(out.expert_load)}
  return ce + mtp + kl, parts


def run(config) -> dict:
  cfg = config_lib.from_config_dict(config.model)
  table, info = summary.report(cfg, config.model.preset)
  print(table)
  b, t = config.batch_size, config.seq_len
  tokens = jnp.asarray(stdlib_bytes(b * t, config.seed).reshape(b, t) % cfg.vocab_size)
  t0 = time.perf_counter()
  params = gnn.init_params(cfg, config.seed)
  model = gnn.GLM5(cfg)
  step = jax.jit(jax.value_and_grad(lambda p: total_loss(model, cfg, p, tokens), has_aux=True))
  (loss, parts), grads = jax.block_until_ready(step(params))
  t_compile = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(step(params))
  t_step = time.perf_counter() - t0
  gnorm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads))))
  result = {"loss": float(loss), **{k: float(v) for k, v in parts.items()}, "grad_norm": gnorm,
            "compile_s": t_compile, "step_s": t_step, "tokens_per_s": b * t / t_step,
            "total_params": info["total_params_with_mtp"]}
  print("\nforward + backward on standard-library bytes "
        f"(batch {b} x {t} tokens, {jax.default_backend()})")
  for k, v in result.items():
    print(f"  {k:<16} {v:.6g}" if isinstance(v, float) else f"  {k:<16} {v:,}")
  if not np.isfinite(result["loss"]):
    raise FloatingPointError("non-finite loss in the smoke run")
  return result
