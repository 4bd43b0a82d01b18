"""SFT data (conversations -> ids + loss masks -> first-fit packed rows) and the SFT loss."""

import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.data import chat
from glm5_jax.data import sft
from glm5_jax.train import step as step_lib


def _rng(name: str):
  return np.random.default_rng(zlib.crc32(name.encode()))


def _conversations(rng, n, max_len=40):
  out = []
  for i in range(n):
    q = "".join(rng.choice(list("abcdefgh"), size=rng.integers(1, max_len)))
    out.append({"id": f"c{i}", "messages": [
        {"role": "user", "content": q},
        {"role": "assistant", "content": q[::-1], "reasoning": None}]})
  return out


def _write(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return str(path)


def test_packing_never_splits_a_conversation_and_drops_overlong_ones(tmp_path):
  convs = _conversations(_rng("test_packing_never_splits"), 120)
  src = _write(tmp_path / "c.jsonl", convs)
  meta = sft.prepare(src, str(tmp_path / "d"), val_fraction=0.0)
  tok = chat.get_chat_tokenizer("bytes")
  rendered = {tuple(chat.render(c, tok).ids.tolist()): chat.render(c, tok) for c in convs}
  seq_len = 64
  n_long = sum(len(k) > seq_len for k in rendered)
  assert 0 < n_long < len(convs)
  assert sft.dropped(str(tmp_path / "d"), "train", seq_len) == n_long
  assert meta["splits"]["train"]["conversations"] == len(convs)
  it = iter(sft.packed_dataset(str(tmp_path / "d"), "train", seq_len=seq_len,
                               batch_per_process=4, seed=0))
  seen = set()
  for _ in range(10):
    b = next(it)
    assert b["tokens"].shape == (4, seq_len)
    for row in range(4):
      seg = b["segment_ids"][row]
      for s in set(seg.tolist()) - {0}:
        where = seg == s
        ids = tuple(b["tokens"][row][where].tolist())
        assert ids in rendered, "a packed segment is not one whole conversation"
        np.testing.assert_array_equal(b["loss_mask"][row][where], rendered[ids].loss_mask)
        np.testing.assert_array_equal(b["positions"][row][where], np.arange(len(ids)))
        seen.add(ids)
  assert all(len(k) <= seq_len for k in seen) and len(seen) > 20


def test_prepared_directory_from_other_sources_is_refused(tmp_path):
  convs = _conversations(_rng("test_prepared_directory_refused"), 10)
  a = _write(tmp_path / "a.jsonl", convs)
  b = _write(tmp_path / "b.jsonl", convs[:5])
  sft.ensure(str(tmp_path / "d"), a)
  assert sft.ensure(str(tmp_path / "d"), a)["splits"]["train"]["conversations"] > 0
  with pytest.raises(ValueError, match="was prepared from"):
    sft.ensure(str(tmp_path / "d"), b)


@pytest.mark.parametrize("line,field", [
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "role"),
    ('[1, 2]', "conversation"),
    ('{"messages": [{"role": "user", "content": "hi"}', "JSON"),
])
def test_malformed_record_names_its_file_and_line(tmp_path, line, field):
  good = json.dumps(_conversations(_rng("test_malformed_record"), 1)[0])
  path = tmp_path / "bad.jsonl"
  path.write_text(good + "\n" + line + "\n")
  with pytest.raises(ValueError, match=rf"bad.jsonl:2.*{field}|{field}.*bad.jsonl:2"):
    sft.prepare(str(path), str(tmp_path / "d"))


def test_sft_loss_is_the_cross_entropy_of_assistant_tokens_only():
  rng = _rng("test_sft_loss_is_the_cross_entropy_of_assistant_tokens_only")
  cfg = config_lib.get_preset("tiny", num_nextn_predict_layers=0)   # no MTP: compiles faster
  params = gnn.init_params(cfg, int(rng.integers(1 << 30)))
  tok = chat.get_chat_tokenizer("bytes")
  rows = [chat.render(c, tok) for c in _conversations(rng, 2, max_len=12)]
  t = 48
  batch = {k: np.zeros((2, t), np.int32) for k in ("tokens", "loss_mask", "segment_ids",
                                                   "positions")}
  for i, r in enumerate(rows):
    n = len(r.ids)
    batch["tokens"][i, :n], batch["loss_mask"][i, :n] = r.ids, r.loss_mask
    batch["segment_ids"][i, :n], batch["positions"][i, :n] = 1, np.arange(n)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  _, (parts, _) = jax.jit(lambda p, b: step_lib.loss_fn(p, b, cfg=cfg, stage="sft",
                                                        loss_chunk=16))(params, batch)
  out = gnn.GLM5(cfg.replace(attention_type="sparse")).apply(
      {"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"])
  logp = np.asarray(jax.nn.log_softmax(out.logits, -1), np.float64)
  nll, n = 0.0, 0
  for i, r in enumerate(rows):
    for pos in range(1, len(r.ids)):
      if r.loss_mask[pos]:                 # the target token is one the assistant produced
        nll -= logp[i, pos - 1, r.ids[pos]]
        n += 1
  assert float(parts["tokens"]) == n
  np.testing.assert_allclose(float(parts["ce"]), nll / n, rtol=1e-5)
