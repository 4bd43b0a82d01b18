"""MTP speculative decoding: greedy = plain greedy, sampled = the target distribution.

Model: the tiny preset with a 16-token vocabulary and initializer_range 0.2,
so that the random model's next-token distributions are peaked enough that
the MTP draft is accepted part of the time (about 30-70 % per draft) and
rejected otherwise: both branches of the acceptance rule run. The reference
is the trainer's full-sequence forward (plain greedy decoding is tested
against it in test_inference_engine.py).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams

MAX_LEN, V, BATCH = 48, 16, 64


@pytest.fixture(scope="module")
def cfg():
  return config_lib.get_preset("tiny", vocab_size=V, initializer_range=0.2)


@pytest.fixture(scope="module")
def params(cfg):
  return gnn.init_params(cfg, 0)


@pytest.fixture(scope="module")
def engine(cfg, params):
  return Engine(cfg, params, max_batch=BATCH, max_len=MAX_LEN, prefill_chunk=16,
                speculative=True, rounds_per_sync=2)     # catch-up folded across rounds


@pytest.fixture(scope="module")
def target_logp(cfg, params):
  """seqs -> log-probs [n, MAX_LEN, V] of the trainer's forward (right-padded, one compile);
  with mtp=True also the first MTP step's log-probs (the first draft's distribution)."""
  model = gnn.GLM5(cfg)

  @jax.jit
  def fwd(p, t):
    out = model.apply({"params": p}, t)
    return jax.nn.log_softmax(out.logits), jax.nn.log_softmax(out.mtp_logits[0])

  def run(seqs, mtp=False):
    tokens = np.zeros((len(seqs), MAX_LEN), np.int32)
    for i, s in enumerate(seqs):
      tokens[i, :len(s)] = s
    logp, draft_logp = (np.asarray(x) for x in fwd(params, jnp.asarray(tokens)))
    return (logp, draft_logp) if mtp else logp
  return run


@pytest.mark.slow
def test_greedy_speculative_emits_the_plain_greedy_tokens(engine, target_logp, rng):
  prompts = [rng.integers(0, V, n).tolist() for n in (3, 11, 20)]
  outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
  logp = target_logp([p + o.token_ids for p, o in zip(prompts, outs)])
  for i, (p, o) in enumerate(zip(prompts, outs)):
    positions = np.arange(len(p) - 1, len(p) - 1 + len(o.token_ids))
    assert len(o.token_ids) == 24
    assert o.token_ids == np.argmax(logp[i, positions], -1).tolist()      # plain greedy
    np.testing.assert_allclose(o.logprobs, logp[i, positions, o.token_ids], atol=1e-4)
  assert sum(o.num_accepted for o in outs) > 0, "no draft accepted: acceptance path untested"
  assert all(1.0 <= o.acceptance_length <= 4.0 for o in outs)


@pytest.mark.slow
def test_a_speculative_request_alone_equals_the_same_request_in_a_batch(engine, rng):
  """Alone, a request verifies its D + 1 tokens in one lane and drafts in the padded
  batch-invariant lanes; next to others it shares both calls. Tokens, log-probs and
  acceptance are the same bits (sampled, so a draft that moved could change a token)."""
  prompt = rng.integers(0, V, 7).tolist()
  others = [rng.integers(0, V, n).tolist() for n in (4, 13)]
  sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
  alone = engine.generate([prompt], sp)[0]
  batched = engine.generate([prompt] + others, sp)[0]
  assert alone.token_ids == batched.token_ids
  np.testing.assert_array_equal(alone.logprobs, batched.logprobs)
  assert (alone.num_rounds, alone.num_accepted) == (batched.num_rounds, batched.num_accepted)


@pytest.mark.slow
def test_speculative_session_turns_match_the_trainer(engine, target_logp, rng):
  sid = engine.new_session()
  turn1, turn2 = rng.integers(0, V, 9).tolist(), rng.integers(0, V, 5).tolist()
  out1 = engine.generate([turn1], SamplingParams(max_new_tokens=9, seed=1), session_id=sid)[0]
  out2 = engine.generate([turn2], SamplingParams(max_new_tokens=9, seed=2), session_id=sid)[0]
  conv = engine.session_tokens(sid)
  assert conv == turn1 + out1.token_ids + turn2 + out2.token_ids
  logp = target_logp([conv])[0]
  start2 = len(turn1) + len(out1.token_ids) + len(turn2)
  for start, out in ((len(turn1), out1), (start2, out2)):
    positions = np.arange(start - 1, start - 1 + len(out.token_ids))
    np.testing.assert_allclose(out.logprobs, logp[positions, out.token_ids], atol=1e-4)
  engine.end_session(sid)


@pytest.mark.slow
def test_sampled_speculative_tokens_follow_the_target_distribution(engine, target_logp):
  """Chi-square goodness of fit of (t1, t2, t3) marginals, 2048 samples, fixed seeds.

  t1 comes from the prompt's logits; t2 and t3 are drafts accepted or
  replaced by the residual rule. Exact target marginals from the trainer's
  forward over all 16 x 16 continuations. Tolerance: the chi-square statistic
  (15 degrees of freedom, expected counts pooled below 5) must stay below the
  0.999 quantile, 37.7. The test can fail: for an engine that kept every draft,
  t2 would follow the MTP head's distribution, whose expected counts are
  checked to lie far outside that tolerance.
  """
  prompt = [3, 1, 4, 1, 5]
  sp = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=s) for s in range(2048 // BATCH)]
  samples, accepted, drafted = [], 0, 0
  for s in sp:
    outs = engine.generate([prompt] * BATCH, s)
    samples += [o.token_ids for o in outs]
    accepted += sum(o.num_accepted for o in outs)
    drafted += sum(o.num_rounds for o in outs)
  samples = np.asarray(samples)                                         # [2048, 3]
  assert 0.1 < accepted / drafted < 0.9                                 # both branches ran

  seqs = [prompt + [a, b] for a, b in itertools.product(range(V), repeat=2)]
  logp, draft_logp = target_logp(seqs, mtp=True)                       # [256, MAX_LEN, V]
  n = len(prompt)
  p1 = np.exp(logp[0, n - 1])
  p2_given_1 = np.exp(logp[::V, n])                                     # [t1, t2]
  p3_given_12 = np.exp(logp[:, n + 1]).reshape(V, V, V)                 # [t1, t2, t3]
  joint12 = p1[:, None] * p2_given_1
  marginals = [p1, joint12.sum(0), (joint12[..., None] * p3_given_12).sum((0, 1))]
  for j, want in enumerate(marginals):
    counts = np.bincount(samples[:, j], minlength=V)
    chi2 = _chi2(counts, want * len(samples))
    assert chi2 < 37.7, (j, chi2, counts, (want * len(samples)).round(1))
  # Draft 1 = MTP step 1 at the last prompt position, given t1.
  draft2 = (p1[:, None] * np.exp(draft_logp[::V, n - 1])).sum(0)
  assert _chi2(draft2 * len(samples), marginals[1] * len(samples)) > 10 * 37.7


def _chi2(observed, expected):
  """Pearson chi-square, cells with expected count < 5 pooled into one."""
  keep = expected >= 5
  obs = np.append(observed[keep], observed[~keep].sum())
  exp = np.append(expected[keep], expected[~keep].sum())
  return float(np.sum((obs - exp) ** 2 / np.maximum(exp, 1e-9)))
