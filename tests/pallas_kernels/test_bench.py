"""The kernel benchmark's on-device checks, run small on CPU (kernels in the interpreter)."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_kernels
from experiments import kernel_ops


def test_selection_mismatch_compares_sets_not_order():
  want = jnp.asarray([[[3, 1, 2, -1], [0, 1, 2, 3]]], jnp.int32)
  permuted = jnp.asarray([[[1, 2, 3, -1], [3, 2, 1, 0]]], jnp.int32)
  assert bench_kernels.mismatch("indexer", permuted, want) == {"vs": 0.0, "vs_rows_differ": 0.0}
  one_off = jnp.asarray([[[3, 1, 2, -1], [0, 1, 2, 5]]], jnp.int32)
  got = bench_kernels.mismatch("indexer", one_off, want, prefix="vs_xla")
  np.testing.assert_allclose(got["vs_xla"], 1 / 7)          # 7 valid entries, 1 missing
  np.testing.assert_allclose(got["vs_xla_rows_differ"], 1 / 2)


def test_attention_mismatch_is_normwise():
  want = (jnp.asarray([1.0, -4.0, jnp.inf]), jnp.asarray([2.0, 2.0]))
  got = (jnp.asarray([1.5, -4.0, 0.0]), jnp.asarray([2.0, 2.2]))
  # max over outputs of max|a - b| / max|b| on b's finite entries: 0.5 / 4 and 0.2 / 2.
  np.testing.assert_allclose(bench_kernels.mismatch("sparse_fwd", got, want)["vs"], 0.125,
                             rtol=1e-6)


@pytest.mark.slow  # CI time budget
def test_bench_checks_both_impls_against_float32():
  rows = bench_kernels.bench(kernel_ops.SHAPES["tiny"], [32], ["indexer", "sparse_fwd_bwd"],
                             ["pallas", "xla"], 1, jnp.bfloat16, 1, 1.0, 1.0, 16, "gpu")
  assert [(r["op"], r["impl"]) for r in rows] == [
      ("indexer", "pallas"), ("indexer", "xla"), ("sparse_fwd_bwd", "pallas"),
      ("sparse_fwd_bwd", "xla")]
  for r in rows:
    assert "error" not in r, r
    assert r["vs_f32"] < (1e-3 if r["op"] == "indexer" else 2e-2), r
  assert all(r["rerun"] for r in rows if r["impl"] == "pallas")
  assert "vs_xla" in rows[0] and "vs_xla" in rows[2]
  lines = bench_kernels.table(rows).splitlines()
  assert "vs f32" in lines[0] and len(lines) == 2 + len(rows)
