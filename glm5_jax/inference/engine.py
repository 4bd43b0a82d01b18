"""Engine: continuous batching over a paged latent KV cache, exact raw log-probs, sessions,
prefix sharing, weight hot-swap and MTP speculative decoding.

    engine = Engine(cfg, params, max_batch=8, max_len=4096)
    ids = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=16, seed=0), n=8)
    while ids:                                   # or: engine.generate([[1, 2, 3], [4, 5]], sp)
      for out in engine.step():                  # the requests that finished in this step
        ids.remove(out.request_id)
        out.token_ids, out.logprobs, out.versions

Every device step runs the trainer's own model (`GLM5.apply(..., cache=)`, steps.py) on
`max_batch` slots. `step()`:
  1. admits waiting requests (first come, first served) into free slots when their blocks
     fit; with `scheduling="static"` only when every slot is free (the baseline);
  2. runs one chunk of prefill (up to `prefill_chunk` tokens per prefilling slot); a slot
     whose prompt ends in it samples its first token;
  3. runs `steps_per_sync` decode steps (or speculative rounds) for the decoding slots,
     fewer if every one of them finishes first;
  4. returns the requests that finished; their slots are free for the next step.
Token ids in, token ids out; nothing is converted to text.

Memory (scheduler.py over paging.py's pools): the cache is a pool of `num_blocks` blocks of
`block_size` rows per layer. A request holds the blocks its prompt and budget need, reserved
when it is admitted, so a running request never runs out. Equal prompt prefixes (the n
copies of one `submit`, GRPO's group; repeated system prompts) share their full blocks and
are prefilled once. A session keeps its blocks between turns (not a slot) and appends each
turn after its cached conversation; idle sessions and unreferenced cached prefixes are
evicted least recently used first when memory runs short (an evicted session re-prefills
its conversation on its next turn). The indexer scores the blocks the batch's longest
request holds (a power-of-two bucket of them), not `max_len` rows.

Weights (`update_params(params, version)`, placement.py): between steps, no recompilation.
Every cached row becomes invalid: running requests and sessions are prefilled again under
the new weights, prefix entries are keyed by version, and every generated token records the
version that produced it (`GenerationOutput.versions`), so each token's log-prob is exactly
that of a full forward under its recorded version. Parameters already in the engine's
shardings are served as they are (a colocated trainer's own arrays: no copy); others are
copied leaf by leaf, each copy of the previous version freed once its successor is in place
(`engine.params` of an older version is then invalid).

Batch invariance (`batch_invariant=True`, the default): a request's log-probs and top-k do
not depend on which other requests share its device calls, so they equal the trainer's full
forward bitwise on XLA:CPU (glm5_jax/numerics.py). XLA:CPU's matmuls sum a row in another
order below 8 rows, so every call has at least `invariant_tokens(cfg, platform)` tokens,
idle lanes padding it: 8 on CPU, whose MoE kernels (`ffn.blocked_swiglu`,
`ffn.looped_swiglu`) are row-invariant at any token count; elsewhere max(2, E/K), since
below E/K tokens the MoE takes its gathered kernel (another summation order; nn/moe.py
`select_dispatch`), e.g. 32 lanes instead of 1 for GLM-5's 256 / 8 experts. Idle lanes of
a decode step mirror a live lane (`steps.mirror_idle`): they route to its experts and read
its rows, so padding a lone request to 8 lanes costs compute, not memory traffic.
`batch_invariant=False` trades exactness (~1e-6 in log-probs) for it. Under a mesh every
call runs all `max_batch` slots, so choose max_batch >= invariant_tokens x shards.

Shapes (packing.py) are bucketed so that new prompt lengths do not recompile: prefill
chunks are padded to a power of two >= 16 (at most `prefill_chunk`), block tables to a
power-of-two number of blocks; decode runs `steps_per_sync` steps per call. Padding is never
written and never attended to (nn/kv_cache.py).

Precision (precision.py): `weight_dtype` serves the float parameters as they are (float32,
the default: the trainer's forward bitwise), cast to bfloat16, or with their targeted
matrices in FP8 (block scales) or INT4 (group scales), quantized on the device at
construction and at every `update_params`; the KV cache holds its latent rows in
`kv_dtype`. Low precision is a deliberate train/rollout gap, which the RL loops measure per
step. `record_routing=True` returns each token's routed experts per MoE layer (rollout
routing replay, GLM-5's MoE RL: the trainer can replay them).

Errors (ValueError, raised before any state changes, so the engine keeps serving): empty
prompt, token ids outside the vocabulary, a request larger than the cache, unknown request
or session ids, a session with a turn in flight, n < 1, `update_params` with a tree of
another structure, shape or dtype (naming the first leaf that differs), and parameters holding
a NaN or inf (`Engine(...)` and `update_params`; naming the first such leaf and the count).

The Engine is a façade over records.py (requests, sessions, outputs, their checks),
scheduler.py (admission into slots and blocks; host only), packing.py (slots into a call's
lanes, its outputs back), steps.py (the jitted device steps), placement.py (where arrays live).
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import sharding as shd
from glm5_jax import quant
from glm5_jax.inference import packing
from glm5_jax.inference import placement
from glm5_jax.inference import precision
from glm5_jax.inference import records
from glm5_jax.inference import steps
# Public names of the engine that live in its parts (re-exported).
from glm5_jax.inference.packing import invariant_tokens
from glm5_jax.inference.placement import (  # pylint: disable=unused-import
    check_finite, serving_shardings, serving_template, tree_diff)
from glm5_jax.inference.records import GenerationOutput
from glm5_jax.inference.sampling import SamplingParams
from glm5_jax.inference.scheduler import SCHEDULING, Scheduler
from glm5_jax.nn import layer_stack


def _check_args(cfg, params, *, scheduling, speculative, num_draft, **sizes):
  """The Engine's arguments: ValueErrors naming the argument and what it expects."""
  for name, v in sizes.items():
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"Engine {name}={v!r}: expected a positive int")
  if sizes["max_len"] > cfg.max_position_embeddings:
    raise ValueError(f"Engine max_len={sizes['max_len']}: expected <= ModelConfig."
                     f"max_position_embeddings={cfg.max_position_embeddings}")
  if scheduling not in SCHEDULING:
    raise ValueError(f"Engine scheduling={scheduling!r}: expected one of {SCHEDULING}")
  if speculative:
    if not cfg.num_nextn_predict_layers or "mtp" not in params:
      raise ValueError("Engine speculative=True needs the MTP module: ModelConfig."
                       f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} and params "
                       "with an 'mtp' subtree")
    if num_draft < 1:
      raise ValueError(f"Engine num_draft={num_draft}: expected >= 1 with speculative=True")
  check_finite(params, "Engine params")


class Engine:
  """KV-cached GLM-5 inference with continuous batching (see module docstring)."""

  def __init__(self, cfg, params, *, max_batch: int = 8, max_len: int = 4096,
               block_size: int = 16, num_blocks: int | None = None, prefill_chunk: int = 256,
               steps_per_sync: int = 8, speculative: bool = False, num_draft: int | None = None,
               rounds_per_sync: int = 1, scheduling: str = "continuous", version: int = 0,
               mesh=None, rules=None, batch_invariant: bool = True,
               shape_buckets: bool = True, weight_dtype: str = "float32",
               kv_dtype: str = "float32", quant_targets: str | None = None,
               quant_block: int | None = None, keep_indexer: bool = False,
               record_routing: bool = False, matvec_head: bool = True,
               stream_matmul: bool = True):
    """Args:
      cfg: ModelConfig.
      params: the model's parameter tree (nn.init_params / hf.load_pretrained / a trainer).
      max_batch: slots: requests that run in one device step.
      max_len: most rows one request may use (conversation + generated tokens).
      block_size: rows per cache block.
      num_blocks: blocks in the pool (default: room for max_batch requests of max_len).
      prefill_chunk: most tokens per slot in one prefill step (chunked prefill).
      steps_per_sync: decode steps per device call (the host sees finished requests after
        each call).
      speculative: draft with the MTP module and verify (needs cfg with MTP).
      num_draft: drafts per round (default cfg.mtp_num_steps).
      rounds_per_sync: speculative rounds per device call.
      scheduling: "continuous" or "static" (admit only into an empty batch; a baseline).
      version: the weight version of `params` (recorded per generated token).
      mesh: serve under this mesh (sharding.make_mesh): parameters in the model's
        shardings (`rules`, default sharding.DEFAULT_RULES: heads over `tensor`, experts
        over `expert`), slots and the cache pool split over the batch axes (each request's
        blocks on its slots' shard). None: the first device.
      batch_invariant: pad each device call to `invariant_tokens(cfg)` tokens so that a
        request's results do not depend on its batch (module docstring); False: lone
        requests decode in one lane (faster; log-probs then differ by float rounding).
      shape_buckets: size each call to its requests (power-of-two lanes and block-table
        buckets: less idle work, more compiled shapes). False: every call runs all
        max_batch lanes over the whole max_len view, so only the prefill chunk length
        varies; for long runs where compiling each bucket costs more than the idle lanes
        (RL rollouts on CPU compile ~5 s per shape of the tiny model).
      weight_dtype: "float32" (the parameters as given), "bfloat16", "float8_e4m3fn" or
        "int4" (precision.py); quant_targets / quant_block: the quantized target group and
        its block edge or group size (default: all_linear, 128 for FP8; experts, 32 for
        INT4); keep_indexer: the indexer's weights stay as given.
      kv_dtype: the latent KV cache's dtype ("float32", "bfloat16", "float8_e4m3fn").
      record_routing: requests may record each token's routed experts (`submit`); the steps
        then also return them.
      matvec_head: on one CPU device with float32 weights, also serve the lm_head split at
        the matmul's k-blocks, so that a step with one live lane (a lone request's decode
        steps and MTP drafts) computes its logits with the matrix-vector kernel: the same
        bits, ~2-3x faster, one more copy of the head in memory (inference/matvec.py;
        `self.head_blocks` says whether it is served). False: never.
      stream_matmul: on one CPU device with float32 weights, decode steps (calls of at most
        `nn.params.STREAM_MAX_ROWS` tokens) multiply the decoder's and the MTP layer's
        dense weights with the streamed kernel (glm5_jax/stream_matmul.py: XLA's matmul's
        bits, each weight read once from its layer stack, a mirrored lane computed once;
        `self.stream_plan` lists them). False, or the kernel not built: XLA's matmul.
    """
    num_draft = cfg.mtp_num_steps if num_draft is None else num_draft
    _check_args(cfg, params, max_batch=max_batch, max_len=max_len, block_size=block_size,
                prefill_chunk=prefill_chunk, steps_per_sync=steps_per_sync,
                rounds_per_sync=rounds_per_sync, scheduling=scheduling,
                speculative=speculative, num_draft=num_draft)
    self.weight_dtype, self.kv_dtype = weight_dtype, precision.check_kv_dtype(kv_dtype)
    scheme = precision.scheme_for(weight_dtype, quant_targets, quant_block, keep_indexer)
    if scheme is not None:
      quant.check_tree(params, scheme)
    self.record_routing = bool(record_routing)
    per_request = -(-max_len // block_size)
    num_blocks = max_batch * per_request if num_blocks is None else num_blocks
    if not isinstance(num_blocks, int) or num_blocks < 1:
      raise ValueError(f"Engine num_blocks={num_blocks!r}: expected a positive int")
    self.cfg, self.max_batch, self.max_len = cfg, max_batch, max_len
    self.block_size, self.num_blocks = block_size, num_blocks
    self.prefill_chunk = min(prefill_chunk, max_len)
    self.steps_per_sync, self.speculative = steps_per_sync, speculative
    self.num_draft, self.rounds_per_sync, self.scheduling = num_draft, rounds_per_sync, scheduling
    self.version = version
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    min_tokens = invariant_tokens(cfg, platform) if batch_invariant else 1
    self.mesh = mesh
    n_shards = 1 if mesh is None else shd.batch_axis_size(mesh)
    for name, v in (("max_batch", max_batch), ("num_blocks", num_blocks)):
      if v % n_shards:
        raise ValueError(f"Engine {name}={v}: expected a multiple of the mesh's batch axes "
                         f"({n_shards} shards: {dict(mesh.shape)})")
    self.stats = collections.Counter()
    self.last_stats: dict = {}
    self.scheduler = Scheduler(max_batch, num_blocks, block_size, n_shards=n_shards,
                               scheduling=scheduling, speculative=speculative,
                               version=version, stats=self.stats)
    self._packer = packing.Packer(max_batch, block_size, num_blocks, packing.pow2(per_request),
                                  self.prefill_chunk, min_tokens, n_shards, shape_buckets)
    self._served = placement.Served(cfg, params, mesh, rules, weight_dtype, scheme,
                                    matvec_head, stream_matmul)
    self.head_blocks = self._served.head_blocks
    self.stream_plan = self._served.stream_plan
    cache = layer_stack.init_cache(cfg, num_blocks * block_size, with_mtp=speculative,
                                   kv_dtype=self.kv_dtype)
    self._cache = jax.device_put(cache, self._served.shardings["cache"](cache))
    h_last = jnp.zeros((max_batch, cfg.hidden_size), cfg.dtype)
    self._h_last = jax.device_put(h_last, self._served.shardings["rows"])
    self._undelivered: list[GenerationOutput] = []
    self._prefill, self._decode, self._spec, self._set_h = steps.jit_steps(
        cfg, block_size, speculative, steps_per_sync, num_draft, rounds_per_sync,
        min_tokens if n_shards == 1 else 1, self.record_routing)

  @property
  def params(self):
    """The served parameters (those of the latest `update_params`)."""
    return self._served.params

  # ------------------------------------------------------------------ weights
  def update_params(self, params, version: int) -> None:
    """Serves `params` (same tree, shapes and dtypes, every float finite) from the next step
    on; see the module docstring. Running requests and sessions are prefilled again under the
    new weights. A ValueError names the first missing, extra or mismatched leaf, or the first
    leaf holding a NaN or inf, before anything changes."""
    self._served.update(params)
    self.version = version
    self.scheduler.new_weights(version)

  # ------------------------------------------------------------------ sessions
  def new_session(self) -> str:
    """Opens a multi-turn conversation (its cache blocks persist between turns)."""
    return self.scheduler.new_session()

  def end_session(self, session_id: str) -> None:
    """Frees the session's blocks."""
    self.scheduler.end_session(session_id)

  def session_tokens(self, session_id: str) -> list:
    """The session's conversation so far: every prompt and generated token, in order."""
    return list(self.scheduler.session(session_id).tokens)

  # ------------------------------------------------------------------ requests
  def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(), *,
             n: int = 1, session_id: str | None = None, record_topk: bool = False,
             stream: int = 0, record_routing: bool = False) -> list[int]:
    """Queues a request (n copies of it); returns their request ids.

    Args:
      prompt_ids: token ids; with a session, appended to its conversation.
      sampling: SamplingParams.
      n: copies (e.g. a GRPO group): they share the prompt's cache blocks and sample
        streams stream .. stream + n - 1 of the seed.
      session_id: a session from `new_session` (n must be 1), or None.
      record_topk: also return each layer's DSA top-k per processed position.
      stream: the first sampling stream (requests with equal seed and stream sample alike).
      record_routing: also return each MoE layer's routed experts per processed position
        (an engine made with `record_routing=True`).
    """
    prompt = records.as_prompt(prompt_ids, "prompt_ids")
    if not isinstance(sampling, SamplingParams):
      raise ValueError(f"sampling: expected a SamplingParams, got {sampling!r}")
    records.check_stop_ids(sampling, self.cfg.vocab_size)
    records.check_n(n)
    if record_routing and not self.record_routing:
      raise ValueError("submit: record_routing=True on an engine made with "
                       "record_routing=False; construct the Engine with record_routing=True")
    session = self.scheduler.turn_session(session_id, n)
    conv = list(session.tokens) if session else []
    records.check_prompt(prompt, conv, self.cfg.vocab_size, self.max_len)
    total = len(conv) + len(prompt)
    budget = min(sampling.max_new_tokens, self.max_len - total + 1)
    self.scheduler.check_fits(total, budget)
    self._packer.n_stop = max(self._packer.n_stop, packing.pow2(len(sampling.stop_token_ids)))
    return self.scheduler.submit(conv + prompt, sampling, budget, n=n, session=session,
                                 stream=stream, record_topk=record_topk,
                                 record_routing=record_routing)

  def cancel(self, request_id: int) -> None:
    """Drops a waiting or running request; its blocks are released (a session keeps its
    conversation as it was before this turn)."""
    self.scheduler.cancel(request_id)

  @property
  def num_unfinished(self) -> int:
    """Requests submitted and not yet returned by `step` (waiting or running)."""
    return len(self.scheduler.requests)

  @property
  def running(self) -> list[int]:
    """Ids of the requests that hold a slot now."""
    return [r.rid for r in self.scheduler.slots if r is not None]

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[
      SamplingParams] = SamplingParams(), *, session_id=None,
               record_topk: bool = False, record_routing: bool = False
               ) -> list[GenerationOutput]:
    """Submits every prompt and steps until they finish (token ids in, token ids out).

    Args:
      prompts: token-id lists, one per request (prompt i samples stream i of its seed).
      sampling: one SamplingParams for all requests or one per request.
      session_id: None, one id (one prompt), or one id (or None) per prompt.
      record_topk: also return each layer's DSA top-k per processed position.
      record_routing: also return each MoE layer's routed experts per processed position.

    Returns:
      One GenerationOutput per prompt, in order. Other requests' outputs that finish
      meanwhile are returned by the next `step()`.
    """
    prompts = records.as_prompts(prompts)
    sps = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(sps) != len(prompts) or not all(isinstance(s, SamplingParams) for s in sps):
      raise ValueError(f"sampling: expected one SamplingParams or a list of {len(prompts)}, "
                       f"got {sampling!r}")
    sids = records.session_ids(session_id, len(prompts), self.scheduler.session)
    convs = [self.scheduler.sessions[sid].tokens if sid else [] for sid in sids]
    records.check_prompts(prompts, convs, sps, self.cfg.vocab_size, self.max_len)
    t0, before = time.perf_counter(), dict(self.stats)
    ids = [self.submit(p, sp, session_id=sid, record_topk=record_topk, stream=i,
                       record_routing=record_routing)[0]
           for i, (p, sp, sid) in enumerate(zip(prompts, sps, sids))]
    outs = self.wait(ids)
    self.last_stats = {k: self.stats[k] - before.get(k, 0) for k in self.stats}
    self.last_stats["wall_s"] = time.perf_counter() - t0
    return outs

  def wait(self, request_ids: Sequence[int]) -> list[GenerationOutput]:
    """Steps until the given requests finish; returns their outputs in order. Other
    requests' outputs that finish meanwhile are returned by the next `step()`."""
    unknown = [i for i in request_ids if i not in self.scheduler.requests
               and all(o.request_id != i for o in self._undelivered)]
    if unknown:
      raise ValueError(f"wait: request ids {unknown} are unknown or already returned")
    want, got = set(request_ids), {}
    while want - set(got):
      for out in self.step():
        if out.request_id in want:
          got[out.request_id] = out
        else:
          self._undelivered.append(out)
    return [got[i] for i in request_ids]

  # ------------------------------------------------------------------ scheduling
  def step(self) -> list[GenerationOutput]:
    """One scheduling step (module docstring). Returns the requests that finished."""
    done, self._undelivered = self._undelivered, []
    for a in self.scheduler.admit():
      if a.h_last is not None:            # the session's MTP state into its new slot's row
        with placement.mesh_scope(self.mesh):
          self._h_last = self._set_h(self._h_last, a.slot, a.h_last)
    slots = self.scheduler.slots
    if any(r is not None and r.prefilling for r in slots):
      self._prefill_step()
    if any(r is not None and r.decoding for r in slots):
      self._decode_step()
    for r in list(slots):
      if r is not None and not r.active:
        h = shd.to_host(self._h_last[r.slot]) if self.speculative and r.session else None
        done.append(self.scheduler.finish(r, h))
    return done

  def _prefill_step(self):
    t0 = time.perf_counter()
    slots = self.scheduler.slots
    call = self._packer.prefill(slots)
    with placement.mesh_scope(self.mesh):
      self._cache, self._h_last, out = self._prefill(
          self.params, self._cache, self._h_last, *call[:-1], steps.pack_state(call.state))
    for r in packing.read_prefill(call, shd.to_host(out), slots, self.version, self.stats):
      self.scheduler.prompt_cached(r)
    self.stats["prefill_s"] += time.perf_counter() - t0

  def _decode_step(self):
    t0 = time.perf_counter()
    slots = self.scheduler.slots
    # A speculative call verifies D + 1 tokens per lane (its drafting pads its own lanes).
    t, ahead = ((self.num_draft + 1, self.rounds_per_sync * (self.num_draft + 1))
                if self.speculative else (1, self.steps_per_sync))
    lanes, table, st = self._packer.decode(slots, t, ahead)
    st = steps.pack_state(st)
    with placement.mesh_scope(self.mesh):
      if self.speculative:
        self._cache, self._h_last, st, out = self._spec(
            self.params, self._cache, self._h_last, np.asarray(lanes, np.int32), table, st)
      else:
        self._cache, st, out = self._decode(self.params, self._cache, table, st)
    read = packing.read_speculative if self.speculative else packing.read_decode
    read(lanes, *shd.to_host((out, st)), slots, self.version, self.stats)
    self.stats["decode_calls"] += 1
    self.stats["decode_s"] += time.perf_counter() - t0

  @property
  def slot_utilisation(self) -> float:
    """Decoding slot-steps used / offered so far (max_batch per decode step)."""
    return self.stats["decode_slot_steps"] / max(self.stats["decode_steps"] * self.max_batch, 1)
