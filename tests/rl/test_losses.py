"""RL losses (glm5_jax/policy_losses.py) against float64 numpy loops: values, metrics, gradients,
bands, sign asymmetry, clamping, 1 vs 8 devices, group advantages.

Gradients are taken by jax in float64 (inside `jax.enable_x64`) and compared with central
finite differences of the numpy loss (h = 1e-6: truncation ~h^2 and round-off ~1e-16/h, so
about 1e-9 absolute on O(1) gradients); where the formula has a stop-gradient weight (direct
IS, CISPO) the numpy gradient is the hand-derived -w A / N.
"""

import math
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import policy_losses as rl
from tests import fake_devices

EPS_LOW, EPS_HIGH, BETA, CAP = 0.2, 0.28, 2.0, 2.0


@pytest.fixture
def rng(request):
  """A numpy Generator seeded from the test's name, so a failure replays."""
  return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def _batch(rng, b=5, t=7, per_token_adv=False):
  """Random log-probs with ratios on both sides of every band; sequence 1 has no mask token."""
  logp = -rng.exponential(1.0, (b, t))
  old = logp + rng.normal(0.0, 0.3, (b, t))          # r = pi/pi_old spans the PPO clip range
  roll = old + rng.normal(0.0, 0.6, (b, t))          # rho spans the IcePop band [0.5, 2]
  adv = rng.normal(size=(b, t) if per_token_adv else (b,))
  mask = rng.random((b, t)) < 0.7
  mask[1] = False
  mask[:, 0] = mask[:, 0] | (np.arange(b) != 1)      # every other sequence has a token
  return logp, old, roll, adv, mask.astype(np.float64)


# --------------------------------------------------------------------------------------
# Independent float64 references (loops over tokens)
# --------------------------------------------------------------------------------------

def _clip(x, lo, hi):
  return min(max(x, lo), hi)


def _adv(adv, i, j):
  return adv[i] if adv.ndim == 1 else adv[i, j]


def _tokens(mask):
  return [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]


def _np_metrics(r, mask):
  rs = [r[i, j] for i, j in _tokens(mask)]
  return {"ratio_min": min(rs), "ratio_mean": sum(rs) / len(rs), "ratio_max": max(rs),
          "tokens": len(rs), "seqs": sum(1 for row in mask if row.any())}


def _np_k3(x):
  return math.exp(-x) - 1 + x


def _np_grpo(weight, logp, old, roll, adv, mask):
  """(loss, metrics, weight flags) of -mean_seq mean_tok w(rho) min(r A, clip(r) A)."""
  seq_means, clipped, flagged, kl = [], [], [], []
  r = np.exp(logp - old)
  for i in range(mask.shape[0]):
    terms = []
    for j in range(mask.shape[1]):
      if not mask[i, j]:
        continue
      a, rho = _adv(adv, i, j), math.exp(old[i, j] - roll[i, j])
      w, flag = weight(rho)
      unclipped, clip_term = r[i, j] * a, _clip(r[i, j], 1 - EPS_LOW, 1 + EPS_HIGH) * a
      terms.append(w * min(unclipped, clip_term))
      clipped.append(clip_term < unclipped)
      flagged.append(flag)
      kl.append(_np_k3(roll[i, j] - old[i, j]))
    if terms:
      seq_means.append(sum(terms) / len(terms))
  metrics = {**_np_metrics(r, mask), "clip_frac": np.mean(clipped), "mismatch_kl": np.mean(kl)}
  return -sum(seq_means) / len(seq_means), metrics, np.mean(flagged)


def _np_icepop(logp, old, roll, adv, mask):
  pop = lambda rho: (rho, False) if 1 / BETA <= rho <= BETA else (0.0, True)
  loss, metrics, frac = _np_grpo(pop, logp, old, roll, adv, mask)
  return loss, {**metrics, "icepop_masked_frac": frac}


def _np_tis(logp, old, roll, adv, mask):
  loss, metrics, frac = _np_grpo(lambda rho: (min(rho, CAP), rho > CAP), logp, old, roll, adv,
                                 mask)
  return loss, {**metrics, "tis_trunc_frac": frac}


def _np_dis(logp, roll, adv, mask):
  """(loss, metrics, surrogate) with surrogate = -sum 1[band] r A / N (same gradient)."""
  num = surrogate = 0.0
  out, kl = [], []
  r = np.exp(logp - roll)
  for i, j in _tokens(mask):
    inside = 1 - EPS_LOW < r[i, j] < 1 + EPS_HIGH
    f = r[i, j] if inside else 0.0
    num += f * _adv(adv, i, j) * logp[i, j]
    surrogate += inside * r[i, j] * _adv(adv, i, j)
    out.append(not inside)
    kl.append(_np_k3(roll[i, j] - logp[i, j]))
  n = mask.sum()
  metrics = {**_np_metrics(r, mask), "is_masked_frac": np.mean(out), "mismatch_kl": np.mean(kl)}
  return -num / n, metrics, -surrogate / n


def _np_cispo(logp, old, adv, mask, eps_low):
  """(loss, metrics, d loss / d logp with the weight held constant)."""
  num, clipped, grad = 0.0, [], np.zeros_like(logp)
  r = np.exp(logp - old)
  n = mask.sum()
  for i, j in _tokens(mask):
    w = _clip(r[i, j], 1 - eps_low, 1 + EPS_HIGH)
    num += w * _adv(adv, i, j) * logp[i, j]
    clipped.append(w != r[i, j])
    grad[i, j] = -w * _adv(adv, i, j) / n
  return -num / n, {**_np_metrics(r, mask), "clip_frac": np.mean(clipped)}, grad


def _finite_diff(f, x, h=1e-6):
  g = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    e = np.zeros_like(x)
    e[idx] = h
    g[idx] = (f(x + e) - f(x - e)) / (2 * h)
  return g


def _check_metrics(got, want):
  assert set(got) == set(want)
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-12, atol=1e-12, err_msg=k)


# --------------------------------------------------------------------------------------
# Values, metrics and gradients against the references
# --------------------------------------------------------------------------------------

_GRPO_CASES = {"icepop": (rl.icepop_grpo_loss, _np_icepop, "icepop_masked_frac"),
               "tis": (rl.tis_grpo_loss, _np_tis, "tis_trunc_frac")}


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("name", list(_GRPO_CASES))
def test_grpo_losses_match_numpy_values_metrics_and_gradients(rng, x64, name, per_token_adv):
  fn, np_fn, frac = _GRPO_CASES[name]
  logp, old, roll, adv, mask = _batch(rng, per_token_adv=per_token_adv)
  loss, metrics = fn(logp, old, roll, adv, mask)
  want, want_metrics = np_fn(logp, old, roll, adv, mask)
  np.testing.assert_allclose(loss, want, rtol=1e-12)
  _check_metrics(metrics, want_metrics)
  assert 0 < want_metrics["clip_frac"] < 1 and 0 < want_metrics[frac] < 1   # every branch hit
  grads = jax.grad(lambda *a: fn(*a, adv, mask)[0], (0, 1, 2))(logp, old, roll)
  np.testing.assert_allclose(grads[0], _finite_diff(lambda x: np_fn(x, old, roll, adv, mask)[0],
                                                    logp), atol=1e-8)
  assert np.all(np.asarray(grads[0])[mask == 0] == 0)
  np.testing.assert_array_equal(grads[1], 0)      # old and rollout log-probs: no gradient
  np.testing.assert_array_equal(grads[2], 0)
  np.testing.assert_array_equal(jax.grad(lambda a: fn(logp, old, roll, a, mask)[0])(adv), 0)


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_double_sided_is_matches_numpy_and_the_band_masked_surrogate_gradient(rng, x64,
                                                                               per_token_adv):
  logp, _, roll, adv, mask = _batch(rng, per_token_adv=per_token_adv)
  loss, metrics = rl.double_sided_is_loss(logp, roll, adv, mask)
  want, want_metrics, _ = _np_dis(logp, roll, adv, mask)
  np.testing.assert_allclose(loss, want, rtol=1e-12)
  _check_metrics(metrics, want_metrics)
  assert 0 < want_metrics["is_masked_frac"] < 1
  g, g_roll = jax.grad(lambda *a: rl.double_sided_is_loss(*a, adv, mask)[0], (0, 1))(logp, roll)
  surrogate = lambda x: _np_dis(x, roll, adv, mask)[2]    # -sum 1[band] r A mask / sum mask
  np.testing.assert_allclose(g, _finite_diff(surrogate, logp), atol=1e-8)
  np.testing.assert_array_equal(g_roll, 0)


@pytest.mark.parametrize("eps_low", [0.2, 1.0])
def test_cispo_matches_numpy_and_keeps_the_gradient_of_clipped_tokens(rng, x64, eps_low):
  logp, old, _, adv, mask = _batch(rng, per_token_adv=True)
  old = logp + rng.normal(0.0, 0.5, logp.shape)      # some ratios below 0.8, some above 1.28
  loss, metrics = rl.cispo_loss(logp, old, adv, mask, eps_low=eps_low)
  want, want_metrics, want_grad = _np_cispo(logp, old, adv, mask, eps_low)
  np.testing.assert_allclose(loss, want, rtol=1e-12)
  _check_metrics(metrics, want_metrics)
  assert 0 < want_metrics["clip_frac"] < 1
  g, g_old = jax.grad(lambda *a: rl.cispo_loss(*a, adv, mask, eps_low=eps_low)[0], (0, 1))(
      logp, old)
  np.testing.assert_allclose(g, want_grad, rtol=1e-12, atol=1e-15)
  np.testing.assert_array_equal(g_old, 0)


def test_values_outside_the_mask_never_reach_the_loss_or_gradient(rng):
  logp, old, roll, adv, mask = (np.asarray(x, np.float32) for x in _batch(rng, per_token_adv=True))
  off = mask == 0
  junk = lambda x: np.where(off, rng.choice([np.nan, np.inf, -np.inf, 1e30], x.shape), x)
  cases = {"icepop": (rl.icepop_grpo_loss, (logp, old, roll)),
           "tis": (rl.tis_grpo_loss, (logp, old, roll)),
           "dis": (rl.double_sided_is_loss, (logp, roll)),
           "cispo": (rl.cispo_loss, (logp, old))}
  for name, (fn, lps) in cases.items():
    f = lambda x, *rest: fn(x, *rest)[0]
    clean = f(*lps, adv, mask), jax.grad(f)(*lps, adv, mask)
    dirty = f(*map(junk, lps), junk(adv), mask), jax.grad(f)(*map(junk, lps), junk(adv), mask)
    np.testing.assert_array_equal(dirty[0], clean[0], err_msg=name)
    np.testing.assert_array_equal(dirty[1], clean[1], err_msg=name)


def test_all_masked_batch_gives_zero_loss_and_gradient_without_nan(rng):
  logp, old, roll, adv, _ = _batch(rng)
  mask = np.zeros_like(logp)
  for fn, lps in ((rl.icepop_grpo_loss, (logp, old, roll)), (rl.tis_grpo_loss, (logp, old, roll)),
                  (rl.double_sided_is_loss, (logp, roll)), (rl.cispo_loss, (logp, old))):
    loss, metrics = fn(*lps, adv, mask)
    assert float(loss) == 0 and all(float(v) == 0 for v in metrics.values()), fn.__name__
    np.testing.assert_array_equal(jax.grad(lambda x: fn(x, *lps[1:], adv, mask)[0])(logp), 0)


# --------------------------------------------------------------------------------------
# Behaviours of the formulas
# --------------------------------------------------------------------------------------

def test_on_policy_icepop_is_plain_grpo_clip_and_all_losses_share_one_gradient(rng, x64):
  b, t = 4, 6
  logp = -rng.exponential(1.0, (b, t))
  adv = rng.normal(size=b)
  full = np.ones((b, t))
  _, _, _, _, mask = _batch(rng, b, t)
  # Plain GRPO-clip at r = 1: -mean_seq mean_tok A_i; gradient -A_i / (n_seqs * n_i).
  n_i = mask.sum(-1)
  has = n_i > 0
  want = -np.sum(adv[has]) / has.sum()
  want_grad = -(adv / np.maximum(n_i, 1) / has.sum())[:, None] * mask
  loss, metrics = rl.icepop_grpo_loss(logp, logp, logp, adv, mask)
  np.testing.assert_allclose(loss, want, rtol=1e-12)
  for k in ("clip_frac", "icepop_masked_frac", "mismatch_kl"):
    assert metrics[k] == 0, k
  assert metrics["ratio_min"] == metrics["ratio_max"] == 1
  g = jax.grad(lambda x: rl.icepop_grpo_loss(x, logp, logp, adv, mask)[0])(logp)
  np.testing.assert_allclose(g, want_grad, rtol=1e-12)
  # With equal-length sequences the sequence and token means agree: A grad(logp) for all.
  grads = [jax.grad(lambda x: rl.icepop_grpo_loss(x, logp, logp, adv, full)[0])(logp),
           jax.grad(lambda x: rl.tis_grpo_loss(x, logp, logp, adv, full)[0])(logp),
           jax.grad(lambda x: rl.double_sided_is_loss(x, logp, adv, full)[0])(logp),
           jax.grad(lambda x: rl.cispo_loss(x, logp, adv, full)[0])(logp)]
  for g in grads:
    np.testing.assert_allclose(g, np.broadcast_to(-adv[:, None] / (b * t), (b, t)), rtol=1e-12)


def test_icepop_token_outside_the_band_adds_nothing_but_stays_in_the_denominator():
  # Token 0: on-policy (rho = r = 1), A = 1 -> term 1. Token 1: rho = 3 > beta -> popped.
  logp = jnp.log(jnp.array([[0.5, 0.3]]))
  roll = logp - jnp.array([[0.0, math.log(3.0)]])
  adv = jnp.array([1.0])
  mask = jnp.ones((1, 2))
  f = lambda lp, a: rl.icepop_grpo_loss(lp, logp, roll, a, mask)[0]
  np.testing.assert_allclose(f(logp, adv), -0.5, rtol=1e-6)      # -(1 + 0) / 2
  g = jax.grad(f)(logp, adv)
  assert float(g[0, 1]) == 0 and float(g[0, 0]) != 0
  moved = logp.at[0, 1].add(0.1)                                  # value unchanged too
  assert float(f(moved, adv)) == float(f(logp, adv))


def test_ppo_clip_bites_only_against_the_advantage_sign():
  # r = 1.5 and r = 0.5 with A = +1 and A = -1; rho = 1 (old == rollout).
  r = jnp.array([[1.5, 1.5, 0.5, 0.5]])
  adv = jnp.array([[1.0, -1.0, 1.0, -1.0]])
  old = jnp.log(jnp.full((1, 4), 0.4))
  logp = old + jnp.log(r)
  mask = jnp.ones((1, 4))
  for fn in (rl.icepop_grpo_loss, rl.tis_grpo_loss):
    loss, metrics = fn(logp, old, old, adv, mask)
    g = jax.grad(lambda x: fn(x, old, old, adv, mask)[0])(logp)
    # Clip active for (A>0, r>1+eps_high) and (A<0, r<1-eps_low): zero gradient there.
    np.testing.assert_allclose(g, [[0.0, 1.5 / 4, -0.5 / 4, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac"], 0.5)
  g = jax.grad(lambda x: rl.cispo_loss(x, old, adv, mask)[0])(logp)
  np.testing.assert_allclose(g, [[-1.28 / 4, 1.28 / 4, -0.5 / 4, 0.5 / 4]], rtol=1e-6)


def test_icepop_and_is_bands_bite_for_both_advantage_signs():
  adv = jnp.array([[1.0, -1.0, 1.0, -1.0, 1.0]])
  mask = jnp.ones((1, 5))
  logp = jnp.log(jnp.full((1, 5), 0.4))
  # IcePop: rho = 3, 3, 0.3, 0.3 (outside [0.5, 2]) and 1.5 (inside); r = 1 everywhere.
  roll = logp - jnp.log(jnp.array([[3.0, 3.0, 0.3, 0.3, 1.5]]))
  g = jax.grad(lambda x: rl.icepop_grpo_loss(x, logp, roll, adv, mask)[0])(logp)
  np.testing.assert_allclose(g, [[0, 0, 0, 0, -1.5 / 5]], rtol=1e-6)
  # Direct IS: r = 1.5, 1.5, 0.5, 0.5 (outside (0.8, 1.28)) and 1.1 (inside).
  roll = logp - jnp.log(jnp.array([[1.5, 1.5, 0.5, 0.5, 1.1]]))
  loss, metrics = rl.double_sided_is_loss(logp, roll, adv, mask)
  g = jax.grad(lambda x: rl.double_sided_is_loss(x, roll, adv, mask)[0])(logp)
  np.testing.assert_allclose(g, [[0, 0, 0, 0, -1.1 / 5]], rtol=1e-6)
  np.testing.assert_allclose(metrics["is_masked_frac"], 0.8)
  np.testing.assert_allclose(loss, -1.1 * math.log(0.4) / 5, rtol=1e-6)   # denominator 5


def test_extreme_log_ratios_are_clamped_to_finite_values_and_gradients():
  big = 1000.0
  s_r, s_rho = jnp.array([1.0, -1.0, 1.0, -1.0]), jnp.array([1.0, 1.0, -1.0, -1.0])
  logp = jnp.log(jnp.full((2, 4), 0.3))
  old = logp - big * s_r                               # log r = +-1000
  roll = old - big * s_rho                             # log rho = +-1000
  adv = jnp.array([1.0, -1.0])                         # both signs against every ratio
  mask = jnp.ones((2, 4))
  cases = ((rl.icepop_grpo_loss, (old, roll)), (rl.tis_grpo_loss, (old, roll)),
           (rl.double_sided_is_loss, (old,)), (rl.double_sided_is_loss, (roll,)),
           (rl.cispo_loss, (old,)))
  for fn, rest in cases:
    f = lambda x: fn(x, *rest, adv, mask)
    loss, metrics = f(logp)
    g = jax.grad(lambda x: f(x)[0])(logp)
    assert np.isfinite(loss) and np.all(np.isfinite(g)), fn.__name__
    assert all(np.isfinite(v) for v in metrics.values()), (fn.__name__, metrics)
    assert float(metrics["ratio_max"]) <= math.exp(rl.LOG_RATIO_CLAMP) * (1 + 1e-6)


_SHARDED_SCRIPT = textwrap.dedent("""
  import zlib
  import jax, jax.numpy as jnp, numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from glm5_jax import policy_losses as rl
  assert jax.device_count() == 8
  rng = np.random.default_rng(zlib.crc32(b"test_losses_are_the_same_on_1_and_8_devices"))
  b, t = 16, 6
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  logp = -rng.exponential(1.0, (b, t))
  old, adv = logp + rng.normal(0, 0.3, (b, t)), rng.normal(size=b)
  roll = old + rng.normal(0, 0.6, (b, t))
  mask = (rng.random((b, t)) < 0.7).astype(np.float32)
  mask[3] = 0
  args = {"icepop": (rl.icepop_grpo_loss, (logp, old, roll, adv, mask)),
          "tis": (rl.tis_grpo_loss, (logp, old, roll, adv, mask)),
          "dis": (rl.double_sided_is_loss, (logp, roll, adv, mask)),
          "cispo": (rl.cispo_loss, (logp, old, adv, mask))}
  mesh = jax.make_mesh((8,), ("data",))
  for name, (fn, xs) in args.items():
    run = jax.jit(jax.value_and_grad(fn, has_aux=True))
    one = run(*(jax.device_put(f32(x), jax.devices()[0]) for x in xs))
    sharded = [jax.device_put(f32(x), NamedSharding(mesh, P("data", *[None] * (x.ndim - 1))))
               for x in xs]
    assert len(sharded[0].sharding.device_set) == 8
    eight = run(*sharded)
    # float32 sums in another order across shards: a few ulp.
    for a, r in zip(jax.tree.leaves(eight), jax.tree.leaves(one)):
      np.testing.assert_allclose(a, r, rtol=2e-6, atol=1e-7, err_msg=name)
  print("OK")
""")


def test_losses_are_the_same_on_1_and_8_devices():
  fake_devices.run_script(_SHARDED_SCRIPT, devices=8, timeout=300)


# --------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------

def _np_group_advantages(rewards, normalize_std, eps):
  out = np.zeros(rewards.shape)
  for g, row in enumerate(rewards):
    n = len(row)
    mean = sum(row) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in row) / (n - 1)) if n > 1 else 0.0
    for i, x in enumerate(row):
      out[g, i] = (x - mean) / (std + eps) if normalize_std else x - mean
  return out


@pytest.mark.parametrize("normalize_std", [False, True])
def test_group_advantages_match_numpy(rng, x64, normalize_std):
  rewards = rng.normal(size=(3, 5))
  rewards[1] = rng.integers(0, 2, 5)                  # binary rewards, as from a verifier
  rewards[2] = 1.0                                    # all equal: advantage 0, no NaN
  got = rl.group_advantages(rewards, normalize_std=normalize_std, eps=1e-6)
  np.testing.assert_allclose(got, _np_group_advantages(rewards, normalize_std, 1e-6),
                             rtol=1e-12, atol=1e-15)


def test_group_advantages_of_a_group_of_one_are_zero():
  np.testing.assert_array_equal(rl.group_advantages(jnp.array([[3], [1]]), normalize_std=True),
                                [[0.0], [0.0]])


def test_opd_advantages_are_the_detached_log_ratio(rng):
  teacher = jnp.asarray(-rng.exponential(1.0, (2, 5)), jnp.float32)
  student = jnp.asarray(-rng.exponential(1.0, (2, 5)), jnp.float32)
  np.testing.assert_array_equal(rl.opd_advantages(teacher, student), teacher - student)
  g = jax.grad(lambda t, s: jnp.sum(rl.opd_advantages(t, s)), (0, 1))(teacher, student)
  np.testing.assert_array_equal(g[0], 0)
  np.testing.assert_array_equal(g[1], 0)


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------

_Z = np.zeros((2, 3), np.float32)


@pytest.mark.parametrize("call, error, words", [
    (lambda: rl.icepop_grpo_loss(_Z, _Z, _Z, np.zeros(3), _Z), ValueError, "advantages"),
    (lambda: rl.icepop_grpo_loss(_Z, _Z, _Z[:1], np.zeros(2), _Z), ValueError, "rollout_logp"),
    (lambda: rl.double_sided_is_loss(_Z, _Z, np.zeros(2), _Z[:, :2]), ValueError, "mask"),
    (lambda: rl.cispo_loss(_Z[0], _Z[0], np.zeros(3), _Z[0]), ValueError, "logp"),
    (lambda: rl.icepop_grpo_loss(_Z, _Z, _Z, np.zeros(2), _Z, beta=0.5), ValueError, "beta"),
    (lambda: rl.tis_grpo_loss(_Z, _Z, _Z, np.zeros(2), _Z, cap=0), ValueError, "cap"),
    (lambda: rl.cispo_loss(_Z, _Z, np.zeros(2), _Z, eps_high=-0.1), ValueError, "eps_high"),
    (lambda: rl.cispo_loss(_Z.astype(np.int32), _Z, np.zeros(2), _Z), TypeError, "logp"),
    (lambda: rl.group_advantages(np.zeros(4)), ValueError, "rewards"),
    (lambda: rl.opd_advantages(_Z, _Z[:1]), ValueError, "teacher_logp"),
])
def test_bad_input_names_the_argument(call, error, words):
  with pytest.raises(error, match=words):
    call()


def test_group_advantages_ignore_invalid_samples(x64):
  rewards = np.array([[1.0, 0.0, 5.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
  valid = np.array([[1, 1, 0, 1], [1, 1, 1, 1]])
  got = np.asarray(rl.group_advantages(rewards, valid=valid, normalize_std=True, eps=0.0))
  kept = np.array([1.0, 0.0, 1.0])
  want0 = (kept - kept.mean()) / kept.std(ddof=1)
  np.testing.assert_allclose(got[0], [want0[0], want0[1], 0.0, want0[2]], rtol=1e-12)
  np.testing.assert_allclose(got[1], _np_group_advantages(rewards[1:], True, 0.0)[0],
                             rtol=1e-12)
