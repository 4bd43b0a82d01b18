"""Does a model use its context? Held-out loss by position and by window, passkey retrieval.

GLM-5 extends its context in mid-training (paper §2: 32K -> 128K -> 200K); these measures
show whether a mid-trained model reads the longer context:

  loss_by_position   next-token loss on held-out corpus documents (the first `length` tokens
                     of every validation document at least that long, one document per row,
                     no packing), averaged over buckets of the predicted token's position p
                     (= the tokens of context it sees). A model that never trained at long
                     positions gets worse there. Buckets also differ in content (a file's
                     first lines are docstrings and imports), hence:
  loss_by_context    the loss of the same tokens (the last `target_len` of each document's
                     first `length`) read in windows of growing length that end there: what
                     more context is worth, content held fixed.
  passkey_accuracy   documents of glm5_jax/data/passkey.py by (length, depth). Teacher-forced
                     argmax at every answer position: exact match (every digit right; equal to
                     the exact match of greedy decoding, which sees the same prefixes when it is
                     right) and the fraction of digits right.

Notation: b rows, t positions, v vocabulary.
"""

from __future__ import annotations

import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import logprobs
from glm5_jax import nn as gnn
from glm5_jax.data import corpus
from glm5_jax.data import passkey as passkey_lib
from glm5_jax.data import tokenizers

BUCKETS = (0, 256, 512, 1024, 2048, 4096)
WINDOWS = (256, 512, 1024, 2048, 4096)
LENGTHS = (256, 1024, 2048, 4096)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def logits_fn(cfg):
  """jit (params, tokens int32 [b, t]) -> float32 logits [b, t, v] (no MTP)."""
  model = gnn.GLM5(cfg)
  return jax.jit(lambda p, t: model.apply({"params": p}, t, mtp=False).logits)


def token_nll(logits_btv, tokens_bt):
  """nll [b, t-1]: -log p(tokens[:, i+1] | tokens[:, :i+1]), i.e. of the token at i+1."""
  return -logprobs.of_logits(logits_btv[:, :-1], tokens_bt[:, 1:])


def nll_fn(cfg, chunk_size: int = 256):
  """jit (params, tokens int32 [b, t]) -> `token_nll` float32 [b, t-1] (no MTP), from the
  model's final hidden states `chunk_size` positions at a time (`logprobs.chunked`): the
  [b, t, v] logits never exist at once."""
  model = gnn.GLM5(cfg)

  def nll(p, tokens_bt):
    hidden = model.apply({"params": p}, tokens_bt, mtp=False, return_logits=False).hidden
    return -logprobs.chunked(logprobs.of_logits, hidden[:, :-1], p["lm_head"]["kernel"],
                             tokens_bt[:, 1:], chunk_size=chunk_size)
  return jax.jit(nll)


def bucket_means(nll_bn, edges):
  """Mean nll per bucket [edges[i], edges[i+1]) of the predicted token's position.

  nll_bn [b, n] holds the tokens at positions 1..n (`token_nll`). Returns (means, counts),
  float [len(edges) - 1] and int; a bucket with no position is nan.
  """
  nll_bn = np.asarray(nll_bn, np.float64)
  pos = np.arange(1, nll_bn.shape[1] + 1)
  means, counts = [], []
  for lo, hi in zip(edges[:-1], edges[1:]):
    sel = nll_bn[:, (pos >= lo) & (pos < hi)]
    counts.append(int(sel.size))
    means.append(float(sel.mean()) if sel.size else float("nan"))
  return np.asarray(means), np.asarray(counts)


def _batches(rows_bt: np.ndarray, batch: int):
  """Yields (rows padded to `batch` with copies of the last, number of real rows)."""
  for i in range(0, len(rows_bt), batch):
    chunk = rows_bt[i:i + batch]
    n = len(chunk)
    if n < batch:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - n, axis=0)])
    yield chunk, n


def _rows_per_batch(length: int, batch_tokens: int) -> int:
  return max(1, batch_tokens // length)


def heldout_documents(data_dir: str, length: int, max_docs: int = 0) -> np.ndarray:
  """int32 [n, length]: the first `length` tokens of each validation document that long."""
  source = corpus.ShardSource(corpus.shard_paths(data_dir, "validation"))
  docs = []
  for i in range(len(source)):
    ids = np.frombuffer(source[i], np.int32)
    if len(ids) >= length:
      docs.append(ids[:length])
    if max_docs and len(docs) == max_docs:
      break
  if not docs:
    raise ValueError(f"data.dir={data_dir!r}: no validation document has {length} tokens")
  return np.stack(docs)


def loss_by_position(fn, params, docs_bt: np.ndarray, edges=BUCKETS, *,
                     batch_tokens: int = 8192) -> dict:
  """Held-out loss per position bucket of `docs_bt` int32 [n, t] (`heldout_documents`);
  fn: `nll_fn(cfg)`."""
  if edges[-1] > docs_bt.shape[1]:
    raise ValueError(f"buckets end at {edges[-1]} > document length {docs_bt.shape[1]}")
  nll = []
  for rows, n in _batches(docs_bt, _rows_per_batch(docs_bt.shape[1], batch_tokens)):
    nll.append(np.asarray(fn(params, jnp.asarray(rows)))[:n])
  means, counts = bucket_means(np.concatenate(nll), edges)
  return {"edges": list(edges), "loss": means.tolist(), "tokens": counts.tolist(),
          "documents": int(docs_bt.shape[0])}


def loss_by_context(fn, params, docs_bt: np.ndarray, windows=WINDOWS, *, target_len: int = 128,
                    batch_tokens: int = 8192) -> dict:
  """Mean loss of the last `target_len` tokens of each row of `docs_bt` [n, t] (the first t
  tokens of held-out documents), read in windows docs_bt[:, t - w:] (positions from 0) of
  each length w in `windows`; fn: `nll_fn(cfg)`."""
  t = docs_bt.shape[1]
  if not all(target_len < w <= t for w in windows):
    raise ValueError(f"windows={list(windows)}: expected target_len={target_len} < w <= "
                     f"document length {t}")
  loss = []
  for w in windows:
    nll = []
    for rows, n in _batches(docs_bt[:, t - w:], _rows_per_batch(w, batch_tokens)):
      nll.append(np.asarray(fn(params, jnp.asarray(rows)))[:n, -target_len:])
    loss.append(float(np.concatenate(nll).astype(np.float64).mean()))
  return {"windows": list(windows), "loss": loss, "target_len": target_len,
          "documents": int(docs_bt.shape[0])}


def _answer_argmax(fn, params, tokens_bt, answer_len: int):
  """int [b, answer_len]: argmax predictions of the last `answer_len` tokens."""
  logits = np.asarray(fn(params, jnp.asarray(tokens_bt)))
  return logits[:, -answer_len - 1:-1].argmax(-1)


def passkey_accuracy(fn, params, filler, tok, *, lengths=LENGTHS, depths=DEPTHS,
                     per_cell: int = 20, seed: int = 0, n_digits: int = 5,
                     batch_tokens: int = 8192) -> dict:
  """Exact-match and digit accuracy of validation-stream passkey documents per (length, depth).

  Returns {"lengths", "depths", "exact": [len(lengths)][len(depths)], "digits": same,
  "per_cell"}; cell (i, j) holds documents index j * per_cell + k of the stream of length i.
  """
  exact = np.zeros((len(lengths), len(depths)))
  digits = np.zeros_like(exact)
  for i, length in enumerate(lengths):
    t0 = time.perf_counter()
    docs = [passkey_lib.document(filler, tok, split="validation", seed=seed,
                                 index=j * per_cell + k, length=length, depth=d,
                                 n_digits=n_digits)
            for j, d in enumerate(depths) for k in range(per_cell)]
    answer_len = length - docs[0].answer_start
    if any(length - d.answer_start != answer_len for d in docs):
      raise ValueError("passkey answers of different token lengths; use the byte tokenizer")
    rows = np.stack([d.tokens for d in docs])
    pred = []
    for chunk, n in _batches(rows, _rows_per_batch(length, batch_tokens)):
      pred.append(_answer_argmax(fn, params, chunk, answer_len)[:n])
    hit = np.concatenate(pred) == rows[:, -answer_len:]
    exact[i] = hit.all(-1).reshape(len(depths), per_cell).mean(-1)
    digits[i] = hit.mean(-1).reshape(len(depths), per_cell).mean(-1)
    logging.info("passkey length %d: exact %.3f digits %.3f (%.1fs)", length, exact[i].mean(),
                 digits[i].mean(), time.perf_counter() - t0)
  return {"lengths": list(lengths), "depths": list(depths), "exact": exact.tolist(),
          "digits": digits.tolist(), "per_cell": per_cell, "n_digits": n_digits,
          "decoding": "teacher-forced argmax (exact match = greedy exact match)"}


def evaluate(cfg, params, data_dir: str, *, edges=BUCKETS, windows=WINDOWS, lengths=LENGTHS,
             depths=DEPTHS, per_cell: int = 20, max_docs: int = 0, seed: int = 0,
             target_len: int = 128, batch_tokens: int = 8192) -> dict:
  """The three measures for one model: {"loss_by_position", "loss_by_context", "passkey"}."""
  top = max(edges[-1], max(windows), max(lengths))
  if top > cfg.max_position_embeddings:
    raise ValueError(f"evaluation length {top} > the model's max_position_embeddings="
                     f"{cfg.max_position_embeddings}")
  nll = nll_fn(cfg)
  t0 = time.perf_counter()
  docs = heldout_documents(data_dir, max(edges[-1], max(windows)), max_docs)
  by_pos = loss_by_position(nll, params, docs[:, :edges[-1]], edges, batch_tokens=batch_tokens)
  by_ctx = loss_by_context(nll, params, docs[:, :max(windows)], windows, target_len=target_len,
                           batch_tokens=batch_tokens)
  logging.info("loss by position and context: %d documents of %d tokens (%.1fs)", len(docs),
               docs.shape[1], time.perf_counter() - t0)
  tok = tokenizers.get_tokenizer(corpus.load_meta(data_dir)["tokenizer"])
  filler = passkey_lib.filler_from_corpus(data_dir, "validation")
  pk = passkey_accuracy(logits_fn(cfg), params, filler, tok, lengths=lengths, depths=depths,
                        per_cell=per_cell, seed=seed, batch_tokens=batch_tokens)
  return {"loss_by_position": by_pos, "loss_by_context": by_ctx, "passkey": pk}
