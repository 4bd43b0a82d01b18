"""Mid-training stages and the long-context evaluation: passkey documents, loss by position
and by window, the eval end to end."""

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import pretrain as pretrain_config
from experiments import long_context_report
from glm5_jax.data import corpus
from glm5_jax.data import passkey
from glm5_jax.data import pipeline
from glm5_jax.data import tokenizers
from glm5_jax.evals import long_context

TOK = tokenizers.ByteTokenizer()


@pytest.fixture
def rng(request):
  """A numpy Generator seeded from the test's name (replayable from it)."""
  return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def test_midtrain_contexts_grow_and_start_from_a_workdir():
  full = [pretrain_config.get_config(f"model=glm5,stage=midtrain,context={x}")
          for x in ("32k", "128k", "200k")]
  local = [pretrain_config.get_config(f"stage=midtrain,context={x},runlocal=True")
           for x in ("32k", "128k", "200k")]
  assert [c.seq_len for c in full] == [32_768, 131_072, 202_752]
  assert all(0.8e6 <= c.seq_len * c.batch_size <= 1.1e6 for c in full)
  assert [c.seq_len for c in local] == [1024, 2048, 4096]
  assert local[-1].seq_len <= local[-1].model.max_position_embeddings
  with pytest.raises(ValueError, match="context='64k'"):
    pretrain_config.get_config("stage=midtrain,context=64k")
  with pytest.raises(ValueError, match="stage=midtrain"):
    pretrain_config.get_config("stage=pretrain,context=32k")


def _python_lines(rng, n_lines: int, tag: str) -> str:
  return "".join(f"{tag}_{i} = f({int(rng.integers(0, 10 ** int(rng.integers(1, 6))))})\n"
                 for i in range(n_lines))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """A byte corpus of 24 files; each file's lines carry its own tag (`tNN_i = ...`)."""
  src = tmp_path_factory.mktemp("src")
  rng = np.random.default_rng(7)
  for i in range(24):
    (src / f"m{i:02d}.py").write_text(_python_lines(rng, int(rng.integers(10, 40)), f"t{i:02d}"))
  out = str(tmp_path_factory.mktemp("data"))
  corpus.prepare(str(src), out, val_fraction=0.4, num_shards=2)
  return out


@pytest.fixture
def filler(rng):
  return passkey.filler_from_ids(TOK.encode(_python_lines(rng, 400, "x")), TOK)


def test_document_has_exact_length_and_ends_with_the_passkey(filler, rng):
  for length in (64, 100, 257, 1000):
    for depth in (0.0, 0.3, 1.0):
      doc = passkey.make_document(filler, TOK, rng, length=length, depth=depth)
      assert doc.tokens.shape == (length,) and doc.tokens.dtype == np.int32
      assert TOK.decode(doc.tokens[doc.answer_start:]) == doc.passkey
      assert TOK.decode(doc.tokens).endswith(passkey.QUERY + doc.passkey)
      assert len(doc.passkey) == 5 and doc.passkey[0] != "0"


def test_needle_sits_at_the_requested_depth(filler, rng):
  length = 2000
  longest_line = max(np.diff(filler.line_ends))
  for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
    doc = passkey.make_document(filler, TOK, rng, length=length, depth=depth)
    needle = TOK.encode(passkey.NEEDLE.format(doc.passkey))
    n_fill = length - len(needle) - len(TOK.encode(passkey.QUERY)) - len(doc.passkey)
    got = doc.tokens[doc.needle_start:doc.needle_start + len(needle)]
    np.testing.assert_array_equal(got, needle)
    assert abs(doc.needle_start - depth * n_fill) <= longest_line
    assert doc.needle_start == 0 or doc.tokens[doc.needle_start - 1] == ord("\n")
  assert passkey.make_document(filler, TOK, rng, length=length, depth=0.0).needle_start == 0


def test_too_short_a_document_is_refused(filler, rng):
  with pytest.raises(ValueError, match="at least"):
    passkey.make_document(filler, TOK, rng, length=20, depth=0.5)


def test_streams_are_replayable_per_index_and_disjoint_across_splits(filler):
  kw = dict(seed=3, length=128)
  a = [passkey.document(filler, TOK, split="validation", index=i, **kw) for i in range(20)]
  again = passkey.document(filler, TOK, split="validation", index=7, **kw)
  np.testing.assert_array_equal(again.tokens, a[7].tokens)
  b = [passkey.document(filler, TOK, split="train", index=i, **kw) for i in range(20)]
  c = [passkey.document(filler, TOK, split="validation", index=i, seed=4, length=128)
       for i in range(20)]
  for other in (b, c):        # 5 random digits: a chance match in 20 pairs is ~2e-4
    assert sum(x.passkey == y.passkey for x, y in zip(a, other)) <= 1


def test_filler_comes_from_its_own_split(data_dir):
  tags = {}
  for split in ("train", "validation"):
    text = TOK.decode(passkey.filler_from_corpus(data_dir, split).tokens)
    tags[split] = {line.split("_")[0] for line in text.splitlines()}
  assert tags["train"] and tags["validation"] and not tags["train"] & tags["validation"]


def test_mixed_corpus_adds_whole_passkey_rows(data_dir, tmp_path):
  out = str(tmp_path / "mixed")
  meta = passkey.write_mixed_corpus(data_dir, out, length=96, fraction=0.5, seed=1)
  base = corpus.load_meta(data_dir)
  n = meta["passkey"]["documents"]
  assert n == int(np.ceil(base["splits"]["train"]["tokens"] / 96))
  assert meta["splits"]["train"]["tokens"] == base["splits"]["train"]["tokens"] + 96 * n
  assert meta["splits"]["validation"] == base["splits"]["validation"]
  assert all(os.path.islink(p) for p in corpus.shard_paths(out, "validation"))
  ds = pipeline.packed_dataset(out, "train", seq_len=96, batch_per_process=4, seed=0)
  rows = [r for b, _ in zip(ds, range(10)) for r in zip(b["tokens"], b["segment_ids"])]
  whole = [t for t, s in rows if TOK.decode(t).endswith(passkey.QUERY + TOK.decode(t[-5:]))]
  assert whole and all(np.all(s == 1) for t, s in rows if b"PASSKEY" in bytes(t.astype(np.uint8)))


def test_bucket_means_match_numpy_from_logits(rng):
  b, t, v = 3, 40, 11
  logits = rng.normal(size=(b, t, v)).astype(np.float32)
  tokens = rng.integers(0, v, (b, t)).astype(np.int32)
  edges = (0, 4, 10, 25, 40)
  means, counts = long_context.bucket_means(
      long_context.token_nll(jnp.asarray(logits), jnp.asarray(tokens)), edges)
  x = logits.astype(np.float64)
  logp = x - x.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  want_nll = np.zeros((b, t))                    # want_nll[:, p]: token p given tokens < p
  for p in range(1, t):
    want_nll[:, p] = -logp[np.arange(b), p - 1, tokens[:, p]]
  for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
    ps = [p for p in range(max(lo, 1), hi)]
    assert counts[i] == b * len(ps)
    np.testing.assert_allclose(means[i], want_nll[:, ps].mean(), rtol=1e-5)  # float32 logits


def test_passkey_accuracy_is_one_for_an_oracle_and_zero_one_token_late(filler):
  def oracle(shift):                    # logits at i: one-hot of token i + shift
    return lambda params, tokens: jax.nn.one_hot(jnp.roll(tokens, -shift, axis=1), 256)
  kw = dict(lengths=(64, 128), depths=(0.0, 0.5, 1.0), per_cell=3)
  right = long_context.passkey_accuracy(oracle(1), None, filler, TOK, **kw)
  assert np.all(np.asarray(right["exact"]) == 1) and np.all(np.asarray(right["digits"]) == 1)
  late = long_context.passkey_accuracy(oracle(0), None, filler, TOK, **kw)
  assert np.all(np.asarray(late["exact"]) == 0)


@pytest.mark.slow  # CI time budget
def test_loss_by_context_scores_the_same_last_tokens(tiny_cfg, tiny_params, rng):
  cfg = tiny_cfg.replace(attention_type="dense")
  fn = long_context.logits_fn(cfg)
  docs = rng.integers(0, 256, (4, 48)).astype(np.int32)
  nll = long_context.nll_fn(cfg, chunk_size=10)   # several chunks: the same nll as the logits'
  got = long_context.loss_by_context(nll, tiny_params, docs, (24, 48), target_len=8,
                                     batch_tokens=96)        # batches of 4 x 24 and 2 x 48
  for w, loss in zip((24, 48), got["loss"]):
    nll = []
    for rows in np.split(docs[:, 48 - w:], 4 * w // 96):
      rows = jnp.asarray(rows)
      nll.append(np.asarray(long_context.token_nll(fn(tiny_params, rows), rows))[:, -8:])
    np.testing.assert_allclose(loss, np.concatenate(nll).mean(), rtol=1e-6)  # float32 means
  with pytest.raises(ValueError, match="target_len"):
    long_context.loss_by_context(nll, tiny_params, docs, (8, 48), target_len=8)


def test_eval_end_to_end_on_a_random_tiny_model(tiny_cfg, tiny_params, data_dir, tmp_path):
  cfg = tiny_cfg.replace(attention_type="dense")
  res = long_context.evaluate(cfg, tiny_params, data_dir, edges=(0, 16, 64), windows=(32, 64),
                              target_len=16, lengths=(64,), depths=(0.0, 1.0), per_cell=2,
                              batch_tokens=256)
  lp, lw, pk = res["loss_by_position"], res["loss_by_context"], res["passkey"]
  assert lw["windows"] == [32, 64] and all(np.isfinite(lw["loss"]))
  assert lp["documents"] > 0 and all(np.isfinite(lp["loss"]))
  assert lp["tokens"] == [15 * lp["documents"], 48 * lp["documents"]]
  assert np.shape(pk["exact"]) == (1, 2) and np.shape(pk["digits"]) == (1, 2)
  assert np.all((np.asarray(pk["exact"]) >= 0) & (np.asarray(pk["digits"]) <= 1))
  results = {"before": res, "after": res}
  table = long_context_report.format_tables(results)
  assert "[16, 64)" in table and "last 16 of each" in table
  assert "passkey exact match, after" in table
  long_context_report.plot(results, str(tmp_path / "lc.png"))
  assert os.path.getsize(tmp_path / "lc.png") > 0
