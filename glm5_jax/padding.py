"""Padding an axis up to a multiple of a block size (chunked losses, log-probs, attention).

Chunked computations (`losses.chunked_cross_entropy`, `policy.token_logprobs`) split the
sequence axis into equal chunks; the last chunk is filled with `value` and its entries carry
no weight.
"""

from __future__ import annotations

import jax.numpy as jnp


def pad_to_multiple(x, multiple: int, *, axis: int = 1, value=0):
  """`x` padded at the end of `axis` with `value` to the next multiple of `multiple` (`x`
  itself when it already is one)."""
  pad = (-x.shape[axis]) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)
