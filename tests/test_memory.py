"""glm5_jax/memory.py: the peak RSS growth of a block against bytes it is known to touch."""

import numpy as np

from glm5_jax import memory

MIB = 2**20


def test_peak_sees_a_buffer_freed_inside_the_block():
  with memory.Peak() as p:
    a = np.ones(128 * MIB, np.uint8)         # every page touched
    del a
  assert 120 * MIB <= p.growth <= 160 * MIB, p.growth / MIB   # (other pages come and go)
  assert p.end_growth < 16 * MIB, p.end_growth / MIB


def test_peak_of_a_block_that_allocates_nothing_is_small():
  keep = np.ones(64 * MIB, np.uint8)         # allocated before: not growth
  with memory.Peak() as p:
    keep[::4096] += 1
  assert p.growth < 16 * MIB, p.growth / MIB
