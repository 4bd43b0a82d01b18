"""glm5_jax/timing.py: the compile-seconds counter the RL loop reports per update."""

import jax
import jax.numpy as jnp

from glm5_jax import timing


def test_compile_seconds_counts_new_compilations_not_cached_calls():
  a7, b7, a9 = jnp.ones(7), jnp.zeros(7), jnp.ones(9)   # made before counting
  timing.compile_seconds()
  s0, n0 = timing.compile_seconds()
  f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + x.sum())
  f(a7).block_until_ready()                          # a new shape: one compilation
  s1, n1 = timing.compile_seconds()
  assert n1 == n0 + 1 and s1 > s0
  f(b7).block_until_ready()                          # cached: nothing compiles
  assert timing.compile_seconds() == (s1, n1)
  f(a9).block_until_ready()                          # another shape
  assert timing.compile_seconds()[1] == n1 + 1
