"""Sampling distributions and the speculative acceptance rule, on hand-made logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.inference import SamplingParams
from glm5_jax.inference import sampling


def _q(logits, temperature=1.0, top_k=0, top_p=1.0):
  logits = jnp.asarray([logits], jnp.float32)
  f = sampling.sampling_logprobs
  return np.exp(np.asarray(f(logits, jnp.asarray([temperature], jnp.float32),
                             jnp.asarray([top_k]), jnp.asarray([top_p], jnp.float32))[0]))


def test_temperature_divides_the_logits():
  logits = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
  want = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
  np.testing.assert_allclose(_q(logits, 0.5), want, rtol=1e-6)


def test_top_k_keeps_the_k_most_likely_tokens():
  q = _q(np.log([0.1, 0.4, 0.2, 0.3]), top_k=2)
  np.testing.assert_allclose(q, [0, 4 / 7, 0, 3 / 7], rtol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p():
  # sorted: 0.4, 0.3, 0.2, 0.1 -> cumulative 0.4, 0.7, 0.9: top_p 0.7 keeps two, 0.71 three.
  probs = np.log([0.1, 0.4, 0.2, 0.3])
  np.testing.assert_allclose(_q(probs, top_p=0.65), [0, 4 / 7, 0, 3 / 7], rtol=1e-5)
  np.testing.assert_allclose(_q(probs, top_p=0.71), [0, 4 / 9, 2 / 9, 3 / 9], rtol=1e-5)
  np.testing.assert_allclose(_q(probs, top_p=0.01), [0, 1, 0, 0], rtol=1e-6)


def test_greedy_is_the_argmax_with_ties_to_the_lower_id():
  np.testing.assert_array_equal(_q([0.0, 2.0, 2.0, 1.0], temperature=0.0), [0, 1, 0, 0])


def test_greedy_equals_numpy_argmax_with_ties_infinities_and_nan(rng):
  """`greedy`'s two reductions against NumPy's argmax (first maximum; a NaN, the first one,
  ranks highest), row by row, jitted."""
  x = rng.integers(-3, 3, size=(9, 40)).astype(np.float32)          # many ties
  x[1] = -np.inf
  x[2, [5, 17]] = np.inf
  x[3, [7, 30]] = np.nan
  x[4, 0] = np.nan
  x[5] = 0.0
  x[5, 39] = -0.0
  x[6] = rng.normal(size=40).astype(np.float32)
  x[7, [3, 4]] = np.finfo(np.float32).max
  got = np.asarray(jax.jit(sampling.greedy)(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.argmax(x, -1))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), -1)))


def test_raw_logprobs_ignore_the_sampling_processors():
  logits = jnp.asarray([[1.0, 2.0, 3.0]])
  lp = sampling.raw_logprobs(logits, jnp.asarray([0]))
  np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[:, 0], rtol=1e-6)


def test_speculative_acceptance_reproduces_the_target_distribution():
  """Output token after one draft, over 200k keys: equals p (TV < 0.01).

  With 200k samples over 4 tokens the total variation of the empirical
  distribution is ~0.002; 0.01 is five times that. Keeping the draft
  unconditionally would give q, at TV 0.4 from p.
  """
  p = np.array([0.5, 0.3, 0.15, 0.05])
  q = np.array([0.1, 0.2, 0.3, 0.4])
  n = 200_000
  keys = jax.random.split(jax.random.PRNGKey(0), n + 1)
  drafts = jax.vmap(lambda k: jax.random.categorical(k, jnp.log(q)))(keys[:n])[:, None]
  logq = jnp.broadcast_to(jnp.log(q), (n, 1, 4)).astype(jnp.float32)
  logp = jnp.broadcast_to(jnp.log(p), (n, 2, 4)).astype(jnp.float32)
  subkeys = jax.random.split(keys[n], n)
  n_acc, y = jax.jit(sampling.speculative_accept)(subkeys, drafts.astype(jnp.int32), logq, logp)
  first = np.where(np.asarray(n_acc) == 1, np.asarray(drafts[:, 0]), np.asarray(y))
  emp = np.bincount(first, minlength=4) / n
  assert 0.5 * np.abs(emp - p).sum() < 0.01
  # Acceptance rate is sum_x min(p, q) = 0.1 + 0.2 + 0.15 + 0.05 = 0.5.
  assert abs(float(np.mean(n_acc)) - 0.5) < 0.01


def test_greedy_acceptance_keeps_matching_drafts_and_corrects_the_first_mismatch():
  onehot = lambda i: np.log(np.eye(4)[i] + 1e-30).astype(np.float32)
  logq = jnp.asarray([[onehot(1), onehot(2), onehot(3)]])
  logp = jnp.asarray([[onehot(1), onehot(2), onehot(0), onehot(3)]])
  n_acc, y = sampling.speculative_accept(jax.random.PRNGKey(0)[None], jnp.asarray([[1, 2, 3]]),
                                         logq, logp)
  assert int(n_acc[0]) == 2 and int(y[0]) == 0


@pytest.mark.parametrize("kw, field", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_p=1.5), "top_p"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="0.7"), "temperature"), (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=4.0), "max_new_tokens"), (dict(top_k=True), "top_k"),
    (dict(top_p=float("nan")), "top_p"), (dict(seed=False), "seed"),
    (dict(stop_token_ids=[5, True]), r"stop_token_ids\[1\]"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids\[0\]"),
    (dict(stop_token_ids=[2.5]), r"stop_token_ids\[0\]"),
    (dict(stop_token_ids=7), "stop_token_ids")])
def test_sampling_params_name_the_bad_field(kw, field):
  with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
    SamplingParams(**kw)


def test_sampling_params_take_numpy_scalars_and_any_iterable_of_stop_ids():
  sp = SamplingParams(max_new_tokens=np.int32(3), temperature=np.float32(0.5),
                      stop_token_ids=np.asarray([4, 7]), seed=np.int64(2))
  assert sp.stop_token_ids == (4, 7) and all(type(t) is int for t in sp.stop_token_ids)


def test_greedy_is_the_token_sample_draws_from_a_greedy_distribution(rng):
  logits = jnp.asarray(rng.normal(size=(3, 50)), jnp.float32).at[1, :2].set(9.0)   # a tie
  b = logits.shape[0]
  logq = sampling.sampling_logprobs(logits, jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b))
  keys = sampling.row_keys(jnp.arange(b), jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32))
  np.testing.assert_array_equal(sampling.greedy(logits), sampling.sample(keys, logq))
  np.testing.assert_array_equal(sampling.greedy(logits), np.argmax(np.asarray(logits), -1))
  assert int(sampling.greedy(logits)[1]) == 0                                   # lower id


@pytest.mark.parametrize("d", [1, 3])
def test_greedy_accept_equals_speculative_accept_on_one_hot_distributions(rng, d):
  """The engine's all-greedy round against the general rule on the one-hot distributions
  that temperature 0 gives, over drafts that match the target's argmax for a random
  prefix (ties included: two tokens share the top logit in some rows)."""
  b, v = 64, 6
  logits = jnp.asarray(rng.integers(0, 3, size=(b, d + 1, v)), jnp.float32)   # many ties
  target = np.argmax(np.asarray(logits), -1)
  drafts = np.where(rng.random((b, d)) < 0.7, target[:, :d], rng.integers(0, v, (b, d)))
  zeros = lambda n: jnp.zeros(n)
  onehot = lambda x, n: jax.jit(sampling.sampling_logprobs)(x.reshape(n, v), zeros(n),
                                                            jnp.zeros(n, jnp.int32), jnp.ones(n))
  logq = jnp.log(jax.nn.one_hot(drafts, v)).reshape(b, d, v)
  logp = onehot(logits, b * (d + 1)).reshape(b, d + 1, v)
  keys = jax.random.split(jax.random.PRNGKey(0), b)
  want_n, want_y = jax.jit(sampling.speculative_accept)(keys, jnp.asarray(drafts, jnp.int32),
                                                       logq, logp)
  got_n, got_y = jax.jit(sampling.greedy_accept)(jnp.asarray(drafts, jnp.int32), logits)
  np.testing.assert_array_equal(got_n, want_n)
  np.testing.assert_array_equal(got_y, want_y)
  assert 0 < int(np.sum(np.asarray(got_n) == d)) < b                  # all kept and cut rows
