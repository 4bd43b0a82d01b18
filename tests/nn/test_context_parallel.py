"""Context parallelism (glm5_jax/nn/context_parallel.py): sequences split over `context`.

Losses and gradients on 8 fake devices equal one device's (1e-5), for the dense stages
(pretrain: dense attention, expanded and absorbed, LM + MTP losses; dsa_warmup: the dense indexer KL) and a sparse
one (dsa_sparse: top-k attention, LM + MTP + sparse KL), with `context=8` and with `data=2, context=2, expert=2`; the HLO
all-gathers MLA's latent rows and never per-head keys or values.
"""

import textwrap

import numpy as np
import pytest

from glm5_jax.nn import context_parallel as cp
from tests import fake_devices


def test_zigzag_order_balances_causal_work():
  order = cp.zigzag_order(32, 4)
  assert sorted(order.tolist()) == list(range(32))
  per_device = order.reshape(4, 8)                 # contiguous shards of the permuted row
  np.testing.assert_array_equal(per_device[0], [0, 1, 2, 3, 28, 29, 30, 31])
  work = (per_device + 1).sum(axis=1)             # keys seen under causal attention
  assert work.min() == work.max()


def test_zigzag_order_rejects_an_indivisible_length():
  with pytest.raises(ValueError, match="divisible by 2 \\* mesh.context = 8"):
    cp.zigzag_order(36, 4)


_SCRIPT = textwrap.dedent("""
  import re, zlib
  import jax, jax.numpy as jnp, numpy as np
  jax.config.update("jax_default_matmul_precision", "highest")
  from glm5_jax import config as config_lib, nn as gnn, sharding as shd
  from glm5_jax.train import step as step_lib

  rng = np.random.default_rng(zlib.crc32(b"test_context_parallel"))
  b, t = 4, 32
  tokens = jnp.asarray(rng.integers(0, 384, (b, t)), jnp.int32)
  seg = jnp.asarray(np.repeat([[1, 1, 2, 3], [1, 2, 2, 2], [1, 1, 1, 1], [1, 2, 3, 4]], 8, axis=1), jnp.int32)
  starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1, axis=1) != 0,
                                          np.arange(t), 0), axis=1)
  batch = {"tokens": tokens, "segment_ids": seg,
           "positions": jnp.asarray(np.arange(t) - starts, jnp.int32)}

  def run(cfg, stage, params, mesh=None):
    f = jax.value_and_grad(lambda p, bt: step_lib.loss_fn(p, bt, cfg=cfg, stage=stage,
                                                          loss_chunk=16), has_aux=True)
    if mesh is None:
      (_, (parts, _)), grads = jax.jit(f)(params, batch)
      return parts, grads, None
    with jax.set_mesh(mesh):
      _, specs = gnn.abstract_params(cfg)
      p_sh = shd.param_shardings(specs, mesh)
      fn = jax.jit(f, in_shardings=(p_sh, shd.batch_sharding(mesh)))
      placed = jax.device_put(params, p_sh)
      (_, (parts, _)), grads = fn(placed, batch)
      hlo = fn.lower(placed, batch).compile().as_text()
    return parts, grads, hlo

  def gathers(hlo):
    return re.findall(r"= (\\w+\\[[\\d,]*\\])[^=]*? all-gather(?:-start)?\\(", hlo)

  dense = dict(attention_type="dense")
  absorbed = dict(dense, dense_attention_form="absorbed")
  for stage, over in (("pretrain", dense), ("pretrain", absorbed), ("dsa_warmup", dense),
                      ("dsa_sparse", {})):
    # Blocks of 8 queries and keys: every query-blocked loop walks several blocks per shard.
    cfg = config_lib.get_preset("tiny", num_hidden_layers=2, attention_chunk_size=8, **over)
    params = gnn.init_params(cfg, 0)
    want, want_g, _ = run(cfg, stage, params)
    for sizes in ({"context": 8}, {"data": 2, "context": 2, "expert": 2}):
      got, got_g, hlo = run(cfg, stage, params, shd.make_mesh(sizes))
      for k in ("loss", "ce", "mtp", "indexer_kl"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{stage} {over} {sizes} {k}")
      flat = jax.tree_util.tree_flatten_with_path(want_g)[0]
      for (path, w), g in zip(flat, jax.tree.leaves(got_g)):
        scale = max(float(np.max(np.abs(w))), 1e-6)
        err = float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
        assert err <= 1e-5 * scale + 1e-7, (stage, over, sizes, jax.tree_util.keystr(path), err, scale)
      shapes = gathers(hlo)
      latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
      assert any(s.endswith(f",{t},{latent}]") for s in shapes), (stage, sizes, shapes)
      heads = cfg.num_attention_heads
      per_head = [s for s in shapes if re.search(rf",{t},{heads},\\d+\\]$", s)]
      assert not per_head, (stage, sizes, per_head)
      print(stage, over, sizes, "all-gathers:", sorted(set(shapes)))
  print("OK")
""")


@pytest.mark.slow
def test_context_parallel_losses_and_gradients_equal_one_device():
  fake_devices.run_script(_SCRIPT, devices=8, timeout=1200)
