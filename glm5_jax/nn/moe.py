"""The sigmoid-routed MoE with a shared expert (SwiGLU experts: nn/ffn.py).

docs/design.md §2.6 ("noaux_tc", DeepSeek-V3 §2.1.2). Notation: n tokens, d hidden,
E routed experts, K experts per token, I expert width, G groups.

Routing
  a = sigmoid(x W_g)                        float32 [n, E]
  c = a + b                                 b = e_score_correction_bias: selection only,
                                            never trained by gradient (stop_gradient)
  if G > 1: keep the topk_group groups with the largest sum of their top-2 c
  E_t = top-K of c (ties -> lower expert id)
  g_e = a_e / (sum_{E_t} a + 1e-20) * routed_scaling_factor

Dropless dispatch (docs/design.md decision 7): the n*K (token, expert) pairs are
sorted by expert and run as grouped matmuls with `jax.lax.ragged_dot`; nothing
is dropped, there is no capacity factor.

Dispatch by token count (`select_dispatch`, a Python-level choice on static shapes):

  expert-parallel all-to-all active   -> moe_ep.ep_grouped_swiglu  (regardless of n)
    (cfg.expert_dispatch == "all_to_all" and moe_ep.expert_parallel_size() > 1)
  n*K <  E  (decode, a few tokens)    -> ffn.gathered_swiglu
  n*K >= E  (training, prefill)       -> ffn.grouped_swiglu

`ffn.gathered_swiglu` gathers each token's K expert matrices ([n, K, d, I]) and runs
batched einsums. With fewer (token, expert) pairs than experts it reads at most
n*K expert matrices instead of all E (weight memory reads dominate at decode
sizes), and it avoids `ragged_dot`'s slow CPU lowering. Same routing, same
math, same outputs (y and tokens per expert); only the summation order of the K
experts per token differs, so results agree to float rounding.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax import quant
from glm5_jax.nn import ffn
from glm5_jax.nn import moe_ep
from glm5_jax.nn import params as P


def route(cfg, x_nd, router_de, bias_e, replay_nk=None, matmul=None):
  """Sigmoid top-K routing. Returns (expert ids int32 [n, K], weights f32 [n, K]).

  replay_nk: int32 [n, K] experts recorded by the rollout engine (rollout routing replay,
  R3): a token whose row holds them (>= 0) uses those experts; its weights still come from
  this forward's scores (and the gradient through them). -1 rows route as usual.
  matmul: None (`x @ router`), or the same product another way (the engine's streamed
  kernel, `Router`).
  """
  x, w = x_nd.astype(jnp.float32), router_de.astype(jnp.float32)
  scores = jax.nn.sigmoid(x @ w if matmul is None else matmul(x, w))
  choice = scores + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
  if cfg.n_group > 1:
    n, e = choice.shape
    grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)          # [n, G]
    _, keep = jax.lax.top_k(group_scores, cfg.topk_group)                   # [n, topk_group]
    group_ok = jnp.any(jax.nn.one_hot(keep, cfg.n_group, dtype=jnp.bool_), axis=1)
    choice = jnp.where(jnp.repeat(group_ok, e // cfg.n_group, axis=1), choice, -jnp.inf)
  _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
  if replay_nk is not None:
    ids = jnp.where(replay_nk[:, :1] >= 0, replay_nk.astype(ids.dtype), ids)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


def select_dispatch(cfg, n_tokens: int, cached: bool = False, stack=None, stream: bool = False):
  """The routed-expert kernel for n_tokens tokens (static), per the module docstring table.

  Expert-parallel all-to-all, when active, is kept regardless of the token count;
  otherwise gathered_swiglu when n*K < E, ragged_swiglu when n*K >= E, each through
  `ffn.routed_swiglu`: blocked_swiglu on XLA:CPU, or with `cached` (the engine's forward
  over a KV cache, never differentiated) looped_swiglu, its blocks in use only. `stack`:
  ((w_gate, w_up, w_down) stacked [R, E, ...], layer index) — the CPU loop then reads the
  experts out of the whole stack (`ffn.looped_swiglu`); `stream`: with the streamed CPU
  kernel (the engine's streamed forward, nn/params.py STREAM_W).
  """
  if cfg.expert_dispatch == "all_to_all" and moe_ep.expert_parallel_size() > 1:
    return functools.partial(moe_ep.ep_grouped_swiglu,   # all-to-all inside shard_map
                             capacity_factor=cfg.moe_capacity_factor)
  kernel = (ffn.gathered_swiglu if n_tokens * cfg.num_experts_per_tok < cfg.n_routed_experts
            else ffn.ragged_swiglu)
  cpu = ffn.blocked_swiglu
  if stack is not None:
    ws, layer = stack
    cpu = lambda x, ids, wts, *_: ffn.looped_swiglu(x, ids, wts, *ws, layer=layer, stream=stream)
  elif cached:
    cpu = functools.partial(ffn.looped_swiglu, stream=stream)
  return functools.partial(ffn.routed_swiglu, kernel, cpu=cpu)


class MoE(nn.Module):
  """Routed experts + shared expert. Returns (y [b,t,d], expert load fraction f32 [E],
  routed expert ids int32 [b, t, K]); `replay_btk`: experts to use instead (`route`);
  `cached`: the engine's forward over a KV cache; `stack`: this layer's experts as the
  whole scanned stack and the layer's index in it (`select_dispatch`).

  The routed experts run through `select_dispatch(cfg, b*t)`: gathered for a few
  tokens (n*K < E), grouped `ragged_dot` otherwise (blocked on XLA:CPU), and the
  expert-parallel all-to-all path whenever it is active, regardless of the token count.
  """
  cfg: "ModelConfig"  # noqa: F821

  @nn.compact
  def __call__(self, x_btd, replay_btk=None, cached: bool = False, stack=None):
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    router = Router(cfg, name="router")
    experts = Experts(cfg, name="experts")
    b, t, _ = x_btd.shape
    x = x_btd.reshape(b * t, d)
    replay = None if replay_btk is None else replay_btk.reshape(b * t, -1)
    ids, weights = router(x, replay)
    streamed = "experts" in self.variables.get(P.STREAM_W, {})   # the engine's, per its plan
    dispatch = select_dispatch(cfg, b * t, cached, stack, cached and streamed)
    # Quantized experts (the engine's INT4 / FP8 weights) stay packed into the kernel, which
    # gathers the experts its tokens use before dequantizing them (nn/ffn.py).
    ws = [w.replace(dtype=jnp.dtype(dt).name) if quant.is_qarray(w) else w.astype(dt)
          for w in experts()]
    if not isinstance(dispatch, functools.partial) or dispatch.func is not ffn.routed_swiglu:
      ws = [quant.materialize(w) for w in ws]          # expert parallel: float shards
    y, counts = dispatch(x.astype(dt), ids, weights, *ws)
    y = y.reshape(b, t, d)
    if cfg.n_shared_experts:
      y = y + ffn.MLP(cfg, i * cfg.n_shared_experts, name="shared")(x_btd)
    load = counts.astype(jnp.float32) / (b * t * cfg.num_experts_per_tok)
    return y, load, ids.reshape(b, t, -1)


class Router(nn.Module):
  """Router weights [d, E] and the e_score_correction_bias [E] (no gradient)."""
  cfg: "ModelConfig"  # noqa: F821

  @nn.compact
  def __call__(self, x_nd, replay_nk=None):
    cfg = self.cfg
    kernel = P.param(self, "kernel", P.dense_init(cfg), (cfg.hidden_size, cfg.n_routed_experts),
                     ("embed", "router_experts"), "float32")
    bias = P.param(self, "e_score_correction_bias", nn.initializers.zeros,
                   (cfg.n_routed_experts,), ("router_experts",), "float32")
    streamed = self.has_variable(P.STREAM_W, "kernel")   # the engine's streamed forward
    return route(cfg, x_nd, kernel, bias, replay_nk,
                 functools.partial(P.dense, self, "kernel") if streamed else None)


class Experts(nn.Module):
  """Stacked routed-expert weights: w_gate, w_up [E, d, I], w_down [E, I, d] (a quantized
  weight as its `quant.QArray`)."""
  cfg: "ModelConfig"  # noqa: F821

  @nn.compact
  def __call__(self):
    cfg = self.cfg
    e, d, i, pd, init = (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                         cfg.param_dtype, P.dense_init(cfg))
    w_gate = P.param(self, "w_gate", init, (e, d, i), ("expert", "embed", "moe_mlp"), pd,
                     packed=True)
    w_up = P.param(self, "w_up", init, (e, d, i), ("expert", "embed", "moe_mlp"), pd,
                   packed=True)
    w_down = P.param(self, "w_down", init, (e, i, d), ("expert", "moe_mlp", "embed"), pd,
                     packed=True)
    return w_gate, w_up, w_down
