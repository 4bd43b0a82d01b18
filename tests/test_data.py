"""Data: corpus preparation, packing with segment ids, checkpointable iterators, doc isolation."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import nn as gnn
from glm5_jax.data import corpus, pipeline, tokenizers


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("texts")
  rng = np.random.default_rng(0)
  for i in range(40):
    n = int(rng.integers(20, 400))
    (d / f"f{i:02d}.py").write_text("".join(chr(int(c)) for c in rng.integers(97, 123, n)))
  return str(d)


@pytest.fixture(scope="module")
def data_dir(text_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("data"))
  corpus.prepare(text_dir, out, val_fraction=0.2, num_shards=2)
  return out


def test_prepare_splits_and_counts(data_dir):
  meta = corpus.load_meta(data_dir)
  tr, va = meta["splits"]["train"], meta["splits"]["validation"]
  assert tr["documents"] + va["documents"] == 40 and va["documents"] > 0
  assert tr["tokens"] == tr["bytes"]                       # byte tokenizer
  assert 0 < meta["train_unigram_entropy_bits_per_token"] <= np.log2(26) + 1e-9


def test_packing_segments_positions_and_resume(data_dir):
  ds = pipeline.packed_dataset(data_dir, "train", seq_len=64, batch_per_process=3, seed=1)
  it = iter(ds)
  b = next(it)
  assert b["tokens"].shape == b["segment_ids"].shape == b["positions"].shape == (3, 64)
  for seg, pos in zip(b["segment_ids"], b["positions"]):
    for s in set(seg.tolist()) - {0}:
      p = pos[seg == s]
      np.testing.assert_array_equal(p, np.arange(p[0], p[0] + len(p)))
  state = it.get_state()
  want = [next(it)["tokens"] for _ in range(3)]
  it2 = iter(ds)
  it2.set_state(state)
  for w in want:
    np.testing.assert_array_equal(next(it2)["tokens"], w)


def test_processes_get_disjoint_documents(data_dir):
  a = pipeline.packed_dataset(data_dir, "train", seq_len=32, batch_per_process=1, seed=0,
                              process_index=0, process_count=2, shuffle=False, repeat=False,
                              shard="documents")
  b = pipeline.packed_dataset(data_dir, "train", seq_len=32, batch_per_process=1, seed=0,
                              process_index=1, process_count=2, shuffle=False, repeat=False,
                              shard="documents")
  ta = np.concatenate([x["tokens"].ravel() for x in a])
  tb = np.concatenate([x["tokens"].ravel() for x in b])
  assert len(ta) and len(tb) and not np.array_equal(ta[:32], tb[:32])


def test_row_sharding_splits_one_global_batch(data_dir):
  kw = dict(seq_len=32, seed=3)
  whole = next(iter(pipeline.packed_dataset(data_dir, "train", batch_per_process=4, **kw)))
  parts = [next(iter(pipeline.packed_dataset(data_dir, "train", batch_per_process=2,
                                             process_index=i, process_count=2, **kw)))
           for i in range(2)]
  np.testing.assert_array_equal(np.concatenate([p["tokens"] for p in parts]), whole["tokens"])


def test_errors_name_the_problem(tmp_path, text_dir):
  with pytest.raises(FileNotFoundError, match="has no train shards"):
    corpus.shard_paths(str(tmp_path), "train")
  with pytest.raises(FileNotFoundError, match="is not a directory"):
    corpus.prepare(str(tmp_path / "missing"), str(tmp_path / "o"))
  with pytest.raises(FileNotFoundError, match="holds no files"):
    corpus.prepare(str(tmp_path), str(tmp_path / "o"))
  with pytest.raises(ValueError, match="data.tokenizer='gpt2'"):
    tokenizers.get_tokenizer("gpt2")


def test_byte_tokenizer_round_trip():
  tok = tokenizers.ByteTokenizer()
  assert tok.decode(tok.encode("déjà vu")) == "déjà vu"


@pytest.mark.parametrize("attention_type", [         # slow (CI time budget; packed rows
    pytest.param("sparse", marks=pytest.mark.slow),    # are also checked by test_attention,
    pytest.param("dense", marks=pytest.mark.slow)])    # test_kernels_model, test_layer_stack)
def test_packed_documents_do_not_see_each_other(tiny_cfg, tiny_params, rng, attention_type):
  cfg = tiny_cfg.replace(attention_type=attention_type, index_topk=4)
  model = gnn.GLM5(cfg)
  a, b = rng.integers(0, 256, 7), rng.integers(0, 256, 9)
  packed = jnp.asarray(np.concatenate([a, b])[None], jnp.int32)
  seg = jnp.asarray([[1] * 7 + [2] * 9])
  pos = jnp.asarray([list(range(7)) + list(range(9))])
  out = model.apply({"params": tiny_params}, packed, pos, seg, mtp=False).logits
  alone_a = model.apply({"params": tiny_params}, jnp.asarray(a[None]), mtp=False).logits
  alone_b = model.apply({"params": tiny_params}, jnp.asarray(b[None]), mtp=False).logits
  np.testing.assert_allclose(out[0, :7], alone_a[0], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out[0, 7:], alone_b[0], rtol=1e-4, atol=1e-5)
