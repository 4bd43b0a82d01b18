"""Model FLOPs of a training step, attention included, and MFU per chip.

Convention (PaLM, Chowdhery et al. 2022, appendix B; MaxText's
`calculate_tflops_training_per_device` counts the same way): a matmul of an
[m, k] by a [k, n] operand is 2 m k n FLOPs; elementwise ops, norms, softmax,
RoPE, top-k selection, sorting and gathers count 0; recomputation (remat,
`jax.checkpoint` in the chunked CE and the KL losses) counts 0. A matmul on the
gradient path costs 3x its forward (forward, d input, d weight); one whose
input is detached costs 2x (forward, d weight: the indexer's projections); one
on no gradient path costs 1x (the top-k scoring, the indexer KL's target
logits, the whole main model in `dsa_warmup`, where only the indexer trains).

Per token, with T = seq_len, K_vis the visible keys of a query and k = index_topk
(notation of nn/mla.py: d hidden, r q_lora, c kv_lora, n qk_nope, p qk_rope,
v v_head, h heads, h_i / d_i indexer heads / dim, V vocab, E / K routed experts):

  MLA projections   2 (d r + r h (n+p) + d (c+p) + h v d)
    dense (expanded) + 2 c h (n + v)                    k_nope, v per key row
    sparse (absorbed)+ 2 c h (n + v)                    q_nope W_UK^T, u W_UV
  dense attention   2 h (n + p + v) K_vis               logits + probs @ v
  sparse attention  2 h (2c + p) k                      logits over [c_kv|k_rope], probs @ c_kv
  indexer proj.     2 (r h_i d_i + d d_i + d h_i)       (layers with their own indexer)
  indexer scores    2 h_i (d_i + 1) per scored key      top-k: K_vis keys; sparse KL: k
                                                        keys; dense KL: K_vis keys
  KL target logits  2 h (c + p) per key (+ 2 h n c for q~ in the dense KL)
  FFN               dense 6 d I; MoE 2 d E + 6 d I_moe (K + n_shared)
  MTP step          4 d^2 (eh_proj) + one decoder layer + the head
  LM head           2 d V per prediction (main + each MTP step)

K_vis counts causal visibility over the whole row, (T + 1) / 2 on average: with
packed documents this is an upper bound (a query sees only its own document).
`keys="all"` counts every key (T for dense, k for sparse), which is what one
attention tile over the whole row computes (the comparison with XLA in
tests/train/test_flops.py). Sparse attention counts min(k, visible) slots per query
under "causal".

Not model FLOPs, so not counted: recomputation (the blockwise indexer KL's two passes, the
checkpointed CE chunks, remat), and the padding rows of the MoE's CPU kernel
(`nn/ffn.py` `blocked_swiglu` pads each expert's rows to whole blocks; tests/train/test_flops.py
adds them back to compare with XLA). In `dsa_warmup` the whole forward is counted, although the last MTP
step's attention output and FFN feed nothing there; the sparse stages count the indexer
KL's target logits although XLA may share them with the attention's.

Usage (train/loop.py): est_mfu = mfu(tokens/s of the global batch,
flops_per_token(cfg, seq_len, stage), jax.device_count(), peak TFLOP/s of one chip).
"""

from __future__ import annotations

from glm5_jax.train import stages as step_lib

KEYS = ("causal", "all")


def _visible(seq_len: int, limit: int | None, keys: str) -> float:
  """Mean number of keys a query scores: min(limit, i + 1) over i < T (causal), or all."""
  if keys not in KEYS:
    raise ValueError(f"keys={keys!r}: expected one of {KEYS}")
  cap = seq_len if limit is None else limit
  if keys == "all":
    return float(min(cap, seq_len))
  full = max(0, seq_len - cap)                        # queries that see >= cap keys
  ramp = min(cap, seq_len)                            # 1, 2, .., ramp
  return (ramp * (ramp + 1) / 2 + full * cap) / seq_len


def layer_terms(cfg, seq_len: int, stage: str, *, moe: bool, has_indexer: bool,
                keys: str = "causal") -> dict[str, tuple[float, int]]:
  """{term: (forward FLOPs per token, backward multiplier 0/1/2)} of one decoder layer."""
  st = step_lib.get_stage(stage)
  sparse = st.attention == "sparse"
  d, r, c, h = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.num_attention_heads
  n, p, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  hi, di = cfg.index_n_heads, cfg.index_head_dim
  lm = 0 if st.trains == "indexer" else 2            # main path: forward only in warm-up
  dense_keys = _visible(seq_len, None, keys)
  topk_keys = _visible(seq_len, cfg.index_topk, keys)
  t = {"mla_proj": (2.0 * (d * r + r * h * (n + p) + d * (c + p) + h * v * d + c * h * (n + v)),
                    lm)}
  if sparse:
    t["attention"] = (2.0 * h * (2 * c + p) * topk_keys, lm)
  else:
    t["attention"] = (2.0 * h * (n + p + v) * dense_keys, lm)
  if has_indexer and (sparse or st.indexer_kl):
    t["indexer_proj"] = (2.0 * (r * hi * di + d * di + d * hi), 1 if st.indexer_kl else 0)
  if has_indexer and sparse:
    t["indexer_topk"] = (2.0 * hi * (di + 1) * dense_keys, 0)
  if has_indexer and st.indexer_kl:
    kl_keys = topk_keys if sparse else dense_keys
    t["indexer_kl_scores"] = (2.0 * hi * (di + 1) * kl_keys, 2)
    t["indexer_kl_target"] = (2.0 * h * (c + p) * kl_keys + (0 if sparse else 2.0 * h * n * c), 0)
  if moe:
    k_act = cfg.num_experts_per_tok + cfg.n_shared_experts
    t["ffn"] = (2.0 * d * cfg.n_routed_experts + 6.0 * d * cfg.moe_intermediate_size * k_act, lm)
  else:
    t["ffn"] = (6.0 * d * cfg.intermediate_size, lm)
  return t


def flops_terms(cfg, seq_len: int, stage: str = "pretrain",
                keys: str = "causal") -> dict[str, tuple[float, int]]:
  """{term: (forward FLOPs per token, backward multiplier)} of the whole training step."""
  st = step_lib.get_stage(stage)
  lm = 0 if st.trains == "indexer" else 2
  out: dict[str, tuple[float, int]] = {}

  def add(prefix, terms, times):
    for name, (f, mult) in terms.items():
      old = out.get(f"{prefix}/{name}", (0.0, mult))[0]
      out[f"{prefix}/{name}"] = (old + times * f, mult)

  for i in range(cfg.num_hidden_layers):
    kind = "moe" if cfg.is_moe_layer(i) else "dense"
    add(kind, layer_terms(cfg, seq_len, stage, moe=cfg.is_moe_layer(i),
                          has_indexer=cfg.indexer_type(i) == "full", keys=keys), 1)
  policy = st.loss != "lm"            # RL: the policy forward (no MTP) and its log-probs
  steps = cfg.mtp_num_steps if cfg.has_mtp and not policy else 0
  if steps:
    d = cfg.hidden_size
    add("mtp", layer_terms(cfg, seq_len, stage, moe=cfg.is_moe_layer(cfg.num_hidden_layers),
                           has_indexer=True, keys=keys), steps)
    add("mtp", {"eh_proj": (4.0 * d * d, lm)}, steps)
  if st.lm_loss or policy:
    heads = 1 + steps
    out["lm_head"] = (2.0 * cfg.hidden_size * cfg.vocab_size * heads, 2)
  return out


def flops_per_token(cfg, seq_len: int, stage: str = "pretrain", *, backward: bool = True,
                    keys: str = "causal") -> float:
  """Model FLOPs per token of one training step (forward + backward, or forward only).

  Args:
    cfg: ModelConfig (the stage's attention type is taken from `stage`).
    seq_len: tokens per row T.
    stage: a row of `train.stages.STAGE_TABLE` (which losses run, what trains).
    backward: include the backward pass (the module docstring's multipliers).
    keys: "causal" (model FLOPs, MFU) or "all" (every key of the row; see docstring).
  """
  terms = flops_terms(cfg, seq_len, stage, keys)
  return sum(f * (1 + (mult if backward else 0)) for f, mult in terms.values())


def mfu(tokens_per_s_global: float, flops_per_token_: float, n_chips: int,
        peak_tflops_per_chip: float) -> float:
  """Model FLOPs utilisation: achieved FLOP/s per chip over one chip's peak."""
  if n_chips < 1 or peak_tflops_per_chip <= 0:
    raise ValueError(f"mfu: n_chips={n_chips} (expected >= 1), peak_tflops_per_chip="
                     f"{peak_tflops_per_chip} (expected > 0)")
  return tokens_per_s_global * flops_per_token_ / n_chips / (peak_tflops_per_chip * 1e12)
