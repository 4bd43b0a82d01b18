"""Parameter counts and KV-cache sizes of a ModelConfig, from `jax.eval_shape` (nothing allocated)."""

from __future__ import annotations

import math

import jax

from glm5_jax.config import ModelConfig

_COMPONENTS = (  # (name, predicate on the '/'-joined param path), first match wins
    ("mtp", lambda p: p.startswith("mtp/")),
    ("embed", lambda p: p.startswith("embed/")),
    ("lm_head", lambda p: p.startswith("lm_head/")),
    ("indexer", lambda p: "/indexer/" in p),
    ("attention (MLA)", lambda p: "/attn/" in p),
    ("routed experts", lambda p: "/moe/experts/" in p),
    ("shared experts", lambda p: "/moe/shared/" in p),
    ("router", lambda p: "/moe/router/" in p),
    ("dense MLP", lambda p: "/mlp/" in p),
    ("norms", lambda p: p.endswith("/scale")),
)


def _path(keys) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in keys)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
  """Parameter count per component (see `_COMPONENTS`), including the MTP layer."""
  from glm5_jax import nn  # pylint: disable=g-import-not-at-top
  shapes, _ = nn.abstract_params(cfg)
  counts = {name: 0 for name, _ in _COMPONENTS}
  for keys, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    p = _path(keys)
    name = next((n for n, pred in _COMPONENTS if pred(p)), None)
    if name is None:
      raise ValueError(f"param {p} fits no component of the summary")
    counts[name] += math.prod(leaf.shape)
  return counts


def totals(cfg: ModelConfig, counts: dict[str, int]) -> dict[str, int]:
  """total (no MTP), total with MTP, active per token (no MTP; embeddings included)."""
  with_mtp = sum(counts.values())
  total = with_mtp - counts["mtp"]
  inactive = counts["routed experts"] * (1 - cfg.num_experts_per_tok / cfg.n_routed_experts)
  return {"total_params": total, "total_params_with_mtp": with_mtp,
          "active_params": int(round(total - inactive))}


def kv_cache_per_token(cfg: ModelConfig, bytes_per_value: int = 2) -> dict[str, int]:
  """Cache values per token per layer: MLA latent + rope key + indexer key, vs GQA-8.

  The GQA-8 baseline keeps 8 key heads of qk_head_dim and 8 value heads of
  v_head_dim (the same attention width as MLA's heads).
  """
  mla = cfg.kv_lora_rank + cfg.qk_rope_head_dim
  idx = cfg.index_head_dim
  gqa = 8 * (cfg.qk_head_dim + cfg.v_head_dim)
  return {"mla_latent": cfg.kv_lora_rank * bytes_per_value,
          "mla_rope": cfg.qk_rope_head_dim * bytes_per_value,
          "indexer_key": idx * bytes_per_value,
          "glm5_total": (mla + idx) * bytes_per_value,
          "gqa8_baseline": gqa * bytes_per_value}


def report(cfg: ModelConfig, name: str = "") -> tuple[str, dict]:
  """A printable table and the summary dict."""
  counts = param_counts(cfg)
  tot = totals(cfg, counts)
  kv = kv_cache_per_token(cfg)
  lines = [f"GLM-5 model summary {name}".rstrip(), "", f"{'component':<20}{'params':>20}"]
  for k, v in counts.items():
    lines.append(f"{k:<20}{v:>20,}")
  lines += ["", f"{'total (no MTP)':<20}{tot['total_params']:>20,}  ({tot['total_params']/1e9:.1f}B)",
            f"{'total with MTP':<20}{tot['total_params_with_mtp']:>20,}  "
            f"({tot['total_params_with_mtp']/1e9:.1f}B)",
            f"{'active per token':<20}{tot['active_params']:>20,}  ({tot['active_params']/1e9:.1f}B)",
            "", "KV cache per token per layer (bf16 bytes):"]
  for k, v in kv.items():
    lines.append(f"  {k:<18}{v:>10,}")
  layers = cfg.num_hidden_layers
  lines.append(f"  per token, all {layers} layers: GLM-5 {kv['glm5_total'] * layers:,} B vs GQA-8 "
               f"{kv['gqa8_baseline'] * layers:,} B ({kv['gqa8_baseline'] / kv['glm5_total']:.1f}x)")
  summary = {**tot, "components": counts, "kv_cache_bytes_per_token_per_layer": kv}
  return "\n".join(lines), summary
