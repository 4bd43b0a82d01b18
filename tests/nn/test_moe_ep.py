"""Expert parallelism: all-to-all dispatch in shard_map == the single-device grouped matmuls.

Runs in a subprocess with 8 fake CPU devices (the device count is fixed at jax import).
"""

import textwrap

import pytest

from tests import fake_devices
from tests import seeding

# Skewed routing (expert 0 hot) of 48 tokens to 8 experts, seeded by the test id.
_SETUP = """
  import jax, jax.numpy as jnp, numpy as np
  from glm5_jax import sharding as shd
  from glm5_jax.nn import ffn, moe_ep
  rng = np.random.default_rng(SEED)
  n, d, i, e, k = 48, 8, 6, 8, 2
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False, p=[.5] + [.5 / 7] * 7)
                              for _ in range(n)]), jnp.int32)      # skewed: expert 0 hot
  wts = jnp.asarray(rng.random((n, k)), jnp.float32)
  w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
       for s in ((e, d, i), (e, d, i), (e, i, d))]
"""

_SCRIPT = textwrap.dedent(_SETUP + """
  loss = lambda f: lambda x, *w: jnp.sum(f(x, ids, wts, *w)[0] ** 2)
  ref, ref_counts = ffn.ragged_swiglu(x, ids, wts, *w)
  ref_g = jax.grad(loss(ffn.ragged_swiglu), range(4))(x, *w)
  for sizes in ({"data": 1, "fsdp": 1, "expert": 8, "tensor": 1},
                {"data": 2, "fsdp": 1, "expert": 2, "tensor": 2}):
    with jax.set_mesh(shd.make_mesh(sizes)):
      assert moe_ep.expert_parallel_size() == sizes["expert"]
      f = jax.jit(moe_ep.ep_grouped_swiglu)
      y, counts = f(x, ids, wts, *w)
      g = jax.jit(jax.grad(loss(moe_ep.ep_grouped_swiglu), range(4)))(x, *w)
      hlo = f.lower(x, ids, wts, *w).compile().as_text()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(counts, ref_counts)
    for a, b in zip(g, ref_g):   # float32 sums in another order: atol relative to the scale
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))
    assert "all-to-all" in hlo
  with jax.set_mesh(shd.make_mesh({"data": 8, "fsdp": 1, "expert": 1, "tensor": 1})):
    assert moe_ep.expert_parallel_size() == 1
  print("OK")
""")


def test_all_to_all_dispatch_equals_grouped_matmuls_with_gradients():
  fake_devices.run_script(_SCRIPT.replace("SEED", str(seeding.seed())), devices=8)


_CAPACITY = textwrap.dedent(_SETUP + """
  # A capacity factor of 1 on the skewed routing drops pairs to the hot shard, and equals
  # the grouped matmuls with the dropped pairs' weights zeroed; its buffers are smaller.
  assert moe_ep.capacity(6, k, 8, 8.0) == 6 * k                    # c >= ep: dropless
  kept = moe_ep.kept_pairs(ids, e, 4, 8, 1.0)
  assert 0.5 < float(kept.mean()) < 1.0, kept.mean()
  with jax.set_mesh(shd.make_mesh({"data": 2, "fsdp": 1, "expert": 4, "tensor": 1})):
    f = lambda c: lambda x, *w: moe_ep.ep_grouped_swiglu(x, ids, wts, *w, capacity_factor=c)
    ref_f = lambda x, *w: ffn.ragged_swiglu(x, ids, jnp.where(kept, wts, 0), *w)
    fwd = jax.jit(f(1.0))
    np.testing.assert_allclose(fwd(x, *w)[0], ref_f(x, *w)[0], rtol=1e-5, atol=1e-5)
    g_c = jax.jit(jax.grad(lambda x, *w: jnp.sum(f(1.0)(x, *w)[0] ** 2), range(4)))(x, *w)
    ref_gc = jax.grad(lambda x, *w: jnp.sum(ref_f(x, *w)[0] ** 2), range(4))(x, *w)
    for a, b in zip(g_c, ref_gc):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))
    temp = lambda fn: fn.lower(x, *w).compile().memory_analysis().temp_size_in_bytes
    assert temp(fwd) < temp(jax.jit(f(0.0))), (temp(fwd), temp(jax.jit(f(0.0))))
  print("OK")
""")


@pytest.mark.slow
def test_capacity_factor_drops_overflow_pairs_and_shrinks_the_buffers():
  fake_devices.run_script(_CAPACITY.replace("SEED", str(seeding.seed())), devices=8)
