"""Bad inputs a new user meets get one clear error naming the file or field: data
directories reused with other sources, corrupt shards, a corrupt tokenizer.json.

(The DSA top-k clamp is in nn/test_indexer.py, the sampling fields in inference/test_sampling.py,
the engine's malformed requests in inference/test_engine.py.)
"""

import json
import logging
import os
import re
import shutil

import pytest

from glm5_jax.data import corpus
from glm5_jax.data import pipeline
from glm5_jax.data import tokenizers


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("texts")
  for i in range(12):
    (d / f"f{i:02d}.py").write_text(f"def f{i}(x):\n  return x * {i}\n" * (i + 3))
  (d / "notes.txt").write_text("plain text, not python\n" * 4)
  return str(d)


@pytest.fixture(scope="module")
def prepared(text_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("data"))
  corpus.ensure(out, source_dir=text_dir, val_fraction=0.25, num_shards=2)
  return out


def _copy(src, tmp_path) -> str:
  dst = str(tmp_path / "copy")
  shutil.copytree(src, dst)
  return dst


def test_ensure_prepares_once_then_returns_the_same_meta(prepared, text_dir):
  meta = corpus.load_meta(prepared)
  assert meta["prepared_from"]["source_dir"] == os.path.abspath(text_dir)
  assert sum(v["records"] for v in meta["shards"].values()) == 12
  assert corpus.ensure(prepared, source_dir=text_dir, val_fraction=0.25, num_shards=2) == meta
  # A subset (max_files) or another split fraction is recorded, not refused.
  assert corpus.ensure(prepared, source_dir=text_dir + "/", max_files=3) == meta


@pytest.mark.parametrize("field, value", [("pattern", "*.txt"), ("tokenizer", "/x/tokenizer.json"),
                                          ("source_dir", "/elsewhere")])
def test_ensure_refuses_a_dir_prepared_from_other_sources(prepared, text_dir, field, value):
  kw = {**dict(source_dir=text_dir, val_fraction=0.25, num_shards=2), field: value}
  recorded = corpus.load_meta(prepared)["prepared_from"][field]
  with pytest.raises(ValueError, match=(
      rf"prepared with data\.{field}={re.escape(repr(recorded))}, but the config now gives "
      rf"data\.{field}=.*"
      r"use a new data\.dir or delete this one")):
    corpus.ensure(prepared, **kw)


def test_a_dir_prepared_before_the_record_is_accepted_with_one_warning(prepared, text_dir,
                                                                       tmp_path, caplog):
  d = _copy(prepared, tmp_path)
  meta = corpus.load_meta(d)
  del meta["prepared_from"]
  with open(os.path.join(d, corpus.META), "w") as f:
    json.dump(meta, f)
  with caplog.at_level(logging.WARNING):
    got = corpus.ensure(d, source_dir="/elsewhere", pattern="*.txt")
  assert got == meta
  assert len([r for r in caplog.records if "records no sources" in r.getMessage()]) == 1


def test_a_dir_prepared_before_non_text_files_were_skipped_is_used_with_a_warning(
    prepared, text_dir, tmp_path, caplog):
  d = _copy(prepared, tmp_path)
  meta = corpus.load_meta(d)
  assert meta["skipped"] == []
  del meta["skipped"]
  with open(os.path.join(d, corpus.META), "w") as f:
    json.dump(meta, f)
  with caplog.at_level(logging.WARNING):
    assert corpus.ensure(d, source_dir=text_dir) == meta
  assert any("before binary and non-UTF-8 files were skipped" in r.getMessage()
             for r in caplog.records), caplog.text


@pytest.mark.parametrize("values,bad", [(["1", "x2"], r"\[1\]='x2'"), (["-3"], r"\[0\]='-3'"),
                                        (["4", "1.5", "7"], r"\[1\]='1.5'")])
def test_sample_prompt_ids_that_are_not_token_ids_are_named(values, bad):
  from experiments import sample  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=rf"^--prompt_ids{bad}: expected an integer >= 0"):
    sample.parse_prompt_ids(values)
  assert sample.parse_prompt_ids(["0", " 12"]) == [0, 12]


def test_truncated_shard_is_named_before_any_reader_opens_it(prepared, tmp_path):
  d = _copy(prepared, tmp_path)
  shard = corpus.shard_paths(d, "train")[0]
  size = os.path.getsize(shard)
  with open(shard, "r+b") as f:
    f.truncate(size // 2)
  msg = rf"data shard '{shard}' is {size // 2} bytes, but {size} were written"
  with pytest.raises(ValueError, match=msg):
    pipeline.packed_dataset(d, "train", seq_len=16, batch_per_process=1, seed=0)
  corpus.shard_paths(d, "validation")                        # the other split is intact


@pytest.mark.parametrize("damage", ["truncate", "overwrite"])
def test_unrecorded_corrupt_shard_is_named(prepared, tmp_path, damage):
  """A shard meta.json does not list (an older directory) is opened once, errors caught."""
  d = _copy(prepared, tmp_path)
  meta = corpus.load_meta(d)
  del meta["shards"]
  with open(os.path.join(d, corpus.META), "w") as f:
    json.dump(meta, f)
  shard = corpus.shard_paths(d, "validation")[-1]
  with open(shard, "r+b") as f:
    if damage == "truncate":
      f.truncate(os.path.getsize(shard) - 100)
    else:
      f.seek(-2**16 + 24, os.SEEK_END)           # the postscript: the last 64 KiB block's start
      f.write(b"\x13" * 64)
  with pytest.raises(ValueError, match=rf"data shard '{shard}' is not a readable ArrayRecord"):
    corpus.shard_paths(d, "validation")


def test_overwrite_inside_a_shard_is_named_when_read(prepared, tmp_path):
  """Same size, same record count: ArrayRecord's chunk hashes catch it at read time, and
  the error names the shard and the record (theirs names a byte offset only)."""
  d = _copy(prepared, tmp_path)
  shard = corpus.shard_paths(d, "train")[0]
  with open(shard, "r+b") as f:
    f.seek(256)                     # inside the first data chunk (the rest of a small shard
    f.write(b"\x55" * 64)           # is padding to ArrayRecord's 64 KiB blocks)
  corpus.shard_paths(d, "train")                   # size and count still match the record
  ds = pipeline.packed_dataset(d, "train", seq_len=16, batch_per_process=1, seed=0,
                               shuffle=False, repeat=False)
  with pytest.raises(ValueError, match=rf"data shard '{shard}', record \d+: .*hash mismatch"):
    for _ in ds:
      pass


def test_shard_with_other_records_is_named(prepared, tmp_path):
  d = _copy(prepared, tmp_path)
  meta = corpus.load_meta(d)
  name = sorted(meta["shards"])[0]
  meta["shards"][name]["records"] += 1
  with open(os.path.join(d, corpus.META), "w") as f:
    json.dump(meta, f)
  with pytest.raises(ValueError, match=rf"{name}' holds \d+ records, expected \d+"):
    corpus.shard_paths(d, name.split("-")[0])


def test_corrupt_meta_json_is_named(prepared, tmp_path):
  d = _copy(prepared, tmp_path)
  with open(os.path.join(d, corpus.META), "w") as f:
    f.write('{"splits": ')
  with pytest.raises(ValueError, match=r"meta\.json is not valid JSON"):
    corpus.load_meta(d)


@pytest.mark.parametrize("content", [b'{"model": ', b"\x00\xffgarbage",
                                     b'{"version": "1.0", "model": 5}'])
def test_garbage_tokenizer_json_is_named(tmp_path, content):
  path = tmp_path / "tokenizer.json"
  path.write_bytes(content)
  with pytest.raises(ValueError, match=rf"data.tokenizer='{path}' is not a valid Hugging Face"):
    tokenizers.get_tokenizer(str(path))


def test_missing_tokenizer_json_is_named(tmp_path):
  path = str(tmp_path / "nowhere" / "tokenizer.json")
  with pytest.raises(FileNotFoundError, match=rf"data.tokenizer='{path}': no such file"):
    tokenizers.get_tokenizer(path)
