"""SwiGLU feed-forward computations: the dense block, and the routed experts' two kernels.

The MoE (nn/moe.py, docs/design.md §2.6) routes each of n tokens to K of E experts and runs them
with one of the two kernels below (its `select_dispatch`; the expert-parallel path of
nn/moe_ep.py runs `grouped_swiglu` on each device's local experts). Notation: n tokens,
d hidden, E routed experts, K experts per token, I expert width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.nn import params as P


def swiglu(x, w_gate, w_up, w_down):
  """down(silu(x W_gate) * (x W_up))."""
  return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


class MLP(nn.Module):
  """Dense SwiGLU FFN (layers < first_k_dense_replace, and the shared expert)."""
  cfg: "ModelConfig"  # noqa: F821
  width: int
  axis: str = "mlp"

  @nn.compact
  def __call__(self, x_btd):
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    d, f, init, pd = cfg.hidden_size, self.width, P.dense_init(self.cfg), cfg.param_dtype
    w_gate = P.param(self, "w_gate", init, (d, f), ("embed", self.axis), pd)
    w_up = P.param(self, "w_up", init, (d, f), ("embed", self.axis), pd)
    w_down = P.param(self, "w_down", init, (f, d), (self.axis, "embed"), pd)
    return swiglu(x_btd.astype(dt), w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt))


def grouped_swiglu(x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi, w_down_eid):
  """sum_k weights[n,k] * Expert_{ids[n,k]}(x[n]) via sort + ragged_dot (dropless).

  Returns (y [n, d], tokens per expert int32 [E]).
  """
  n, k = ids_nk.shape
  e = w_gate_edi.shape[0]
  flat_ids = ids_nk.reshape(-1)                                  # [n*K]
  order = jnp.argsort(flat_ids, stable=True)
  token_of = order // k                                          # source token of each row
  xs = x_nd[token_of]                                            # [n*K, d], sorted by expert
  group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
  h = (jax.nn.silu(jax.lax.ragged_dot(xs, w_gate_edi, group_sizes))
       * jax.lax.ragged_dot(xs, w_up_edi, group_sizes))
  ys = jax.lax.ragged_dot(h, w_down_eid, group_sizes)            # [n*K, d]
  ys = ys * weights_nk.reshape(-1)[order][:, None].astype(ys.dtype)
  y = jnp.zeros_like(x_nd).at[token_of].add(ys)
  return y, group_sizes


def gathered_swiglu(x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi, w_down_eid):
  """sum_k weights[n,k] * Expert_{ids[n,k]}(x[n]) via a gather of each token's K experts.

  Same contract as `grouped_swiglu`: returns (y [n, d], tokens per expert int32 [E]).
  Reads n*K expert matrices ([n, K, d, I]); meant for n*K < E (see module docstring).
  """
  e = w_gate_edi.shape[0]
  wg, wu, wd = w_gate_edi[ids_nk], w_up_edi[ids_nk], w_down_eid[ids_nk]    # [n, K, ...]
  h = (jax.nn.silu(jnp.einsum("nd,nkdi->nki", x_nd, wg))
       * jnp.einsum("nd,nkdi->nki", x_nd, wu))
  y_nkd = jnp.einsum("nki,nkid->nkd", h, wd)
  y = jnp.einsum("nkd,nk->nd", y_nkd, weights_nk.astype(y_nkd.dtype))
  counts = jnp.bincount(ids_nk.reshape(-1), length=e).astype(jnp.int32)
  return y, counts
