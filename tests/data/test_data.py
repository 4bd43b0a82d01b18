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


def test_binary_and_non_utf8_files_are_skipped_and_named(tmp_path, rng, caplog):
  src = tmp_path / "src"
  src.mkdir()
  texts = {f"t{i}.py": "".join(chr(int(c)) for c in rng.integers(97, 123, 50)) + "é"
           for i in range(12)}
  for name, text in texts.items():
    (src / name).write_text(text, encoding="utf-8")
  blob = bytes(rng.integers(1, 256, 64, dtype=np.uint8))
  (src / "blob.py").write_bytes(b"ab" + b"\0" + blob)              # binary: a NUL at 2
  (src / "latin1.py").write_bytes("café au lait".encode("latin-1"))  # 0xe9 then ' '
  with caplog.at_level("WARNING"):
    meta = corpus.prepare(str(src), str(tmp_path / "out"), val_fraction=0.3, num_shards=2)
  assert meta["skipped"] == [
      {"path": "blob.py", "why": "binary (a NUL byte at offset 2)"},
      {"path": "latin1.py", "why": "not UTF-8 (invalid continuation byte at offset 3)"}]
  for name in ("blob.py", "latin1.py"):
    assert any(name in r.getMessage() for r in caplog.records), caplog.text
  docs = meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"]
  assert docs == len(texts)
  got = sum(meta["splits"][s]["bytes"] for s in ("train", "validation"))
  assert got == sum(len(t.encode()) for t in texts.values())     # only the text files' bytes


@pytest.mark.parametrize("field,value,allowed", [
    ("val_fraction", 0.0, r"a number in \(0, 1\)"), ("val_fraction", 1.0, r"\(0, 1\)"),
    ("val_fraction", -0.1, r"\(0, 1\)"), ("num_shards", 0, r"\[1, 4096\]"),
    ("num_shards", 10**6, r"\[1, 4096\]"), ("max_files", -1, r"\[0, ")])
def test_split_fields_out_of_range_are_named(tmp_path, text_dir, field, value, allowed):
  kw = {"val_fraction": 0.2, "num_shards": 2, "max_files": 0, field: value}
  with pytest.raises(ValueError, match=rf"^{field}={value!r}: expected .*{allowed}"):
    corpus.prepare(text_dir, str(tmp_path / "o"), **kw)
  assert not (tmp_path / "o").exists()                      # refused before writing


def test_a_split_with_no_document_is_refused_and_nothing_is_left(tmp_path, text_dir):
  out = tmp_path / "o"
  with pytest.raises(ValueError, match=r"validation split .* would hold no document \(train "
                     r"2, validation 0 of 2 files"):
    corpus.prepare(text_dir, str(out), val_fraction=1e-9, num_shards=2, max_files=2)
  assert not list(out.iterdir())                            # no shard, no meta.json


def test_prepare_data_cli_names_the_flag(tmp_path, text_dir):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  for flag, want in (("--num_shards=0", "error: --num_shards=0: expected an integer in [1, "),
                     ("--val_fraction=1.0", "error: --val_fraction=1.0: expected a number in")):
    p = subprocess.run([sys.executable, "-m", "experiments.prepare_data", f"--src={text_dir}",
                        f"--out={tmp_path / 'o'}", flag], capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 1 and want in p.stderr, p.stderr[-2000:]


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
