"""`steps.scan_while_active` (a decode loop that stops once no row is active) and
`steps.pad_lanes`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.inference import steps


def _countdown(carry, _):
  """Each active row emits one token and decrements its count; a row is active while its
  count is positive (a request with that many tokens left). The carry counts the steps
  run."""
  n_run, st = carry
  emit = st["active"].astype(jnp.int32)
  left = st["left"] - emit
  st = {"left": left, "active": left > 0}
  return (n_run + 1, st), {"emit": emit, "left": st["left"] * emit}


def _scan_reference(carry, length):
  """Python loop: run a step while any row is active, at most `length` steps."""
  outs, ran = [], 0
  for _ in range(length):
    if not np.any(np.asarray(carry[-1]["active"])):
      break
    carry, out = _countdown(carry, None)
    outs.append(out)
    ran += 1
  return carry, outs, ran


@pytest.mark.parametrize("left, length", [([3, 5], 8), ([3, 5], 4), ([0, 0], 4), ([1, 0], 1)])
def test_scan_while_active_stops_when_no_row_is_active(left, length):
  st = {"left": jnp.asarray(left, jnp.int32), "active": jnp.asarray(left, jnp.int32) > 0}
  carry0 = (jnp.int32(0), st)
  (n_run, st_out), outs = jax.jit(steps.scan_while_active, static_argnums=(0, 2))(
      _countdown, carry0, length)
  (_, want_st), want_outs, ran = _scan_reference(carry0, length)
  assert int(n_run) == ran == min(max(left), length)       # lax.scan would run `length`
  np.testing.assert_array_equal(st_out["left"], want_st["left"])
  np.testing.assert_array_equal(st_out["active"], want_st["active"])
  assert outs["emit"].shape == (length, 2)
  for i, want in enumerate(want_outs):                              # the steps that ran
    np.testing.assert_array_equal(outs["emit"][i], want["emit"])
    np.testing.assert_array_equal(outs["left"][i], want["left"])
  assert not np.any(np.asarray(outs["emit"][ran:]))                  # the rest: zeros


def test_pad_lanes_appends_inert_rows_with_the_value():
  x = np.arange(6, dtype=np.int32).reshape(2, 3)
  got = steps.pad_lanes(jnp.asarray(x), 4, 9)
  np.testing.assert_array_equal(got, np.concatenate([x, np.full((2, 3), 9, np.int32)]))
  np.testing.assert_array_equal(steps.pad_lanes(jnp.asarray(x), 2), x)            # no-op


def test_mirror_idle_copies_the_first_active_lane_into_idle_lanes():
  active = jnp.asarray([False, True, False, True])
  tok = jnp.asarray([7, 8, 9, 10])
  table = jnp.arange(8).reshape(4, 2)
  got_tok, got_table = steps.mirror_idle(active, tok, table)
  np.testing.assert_array_equal(got_tok, [8, 8, 8, 10])
  np.testing.assert_array_equal(got_table, [[2, 3], [2, 3], [2, 3], [6, 7]])
