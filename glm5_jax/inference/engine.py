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

Memory (paging.py): the cache is a pool of `num_blocks` blocks of `block_size` rows per
layer. A request holds the blocks its prompt and budget need, reserved when it is admitted,
so a running request never runs out. Equal prompt prefixes (the n copies of one `submit`,
GRPO's group; repeated system prompts) share their full blocks and are prefilled once. A
session keeps its blocks between turns (not a slot) and appends each turn after its cached
conversation; idle sessions and unreferenced cached prefixes are evicted least recently used
first when memory runs short (an evicted session re-prefills its conversation on its next
turn). The indexer scores the blocks the batch's longest request holds (a power-of-two
bucket of them), not `max_len` rows.

Weights (`update_params(params, version)`): between steps, no recompilation. Every cached
row becomes invalid: running requests and sessions are prefilled again under the new
weights before they continue, prefix entries are keyed by version, and every generated
token records the version that produced it (`GenerationOutput.versions`), so each token's
log-prob is exactly that of a full forward under its recorded version. Parameters already
in the engine's shardings are served as they are (a colocated trainer's own arrays: no copy);
others are copied device to device leaf by leaf, each copied leaf of the previous version
freed once its successor is in place (`engine.params` of an older version is then invalid).

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

Shapes are bucketed so that new prompt lengths do not recompile: prefill chunks are padded
to a power of two >= 16 (at most `prefill_chunk`), block tables to a power-of-two number of
blocks; decode runs `steps_per_sync` steps per call. Padding is never written and never
attended to (nn/kv_cache.py).

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
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import functools
import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax import nn as gnn
from glm5_jax import numerics
from glm5_jax import sharding as shd
from glm5_jax import quant
from glm5_jax.inference import paging
from glm5_jax.inference import precision
from glm5_jax.inference import steps
from glm5_jax.inference.sampling import SamplingParams
from glm5_jax.nn import layer_stack

SCHEDULING = ("continuous", "static")


@dataclasses.dataclass
class GenerationOutput:
  """One request's result.

  Attributes:
    request_id: the id `submit` returned.
    token_ids: generated ids (stop token included).
    logprobs: raw-model log-prob of each generated id (before temperature, top-k, top-p),
      float32 values as Python floats.
    versions: the weight version that produced each generated id.
    finish_reason: "stop" | "length" (max_new_tokens) | "cache_full" (max_len).
    session_id: the session this turn belongs to, or None.
    num_rounds: speculative verify rounds (0 without speculative decoding).
    num_accepted: drafts accepted over those rounds.
    topk_indices: with `record_topk=True`, {absolute position: int32 [L, K]} the DSA
      top-k each layer chose for the token at that position, from its first computation:
      for a position followed by a generated token, the step that sampled that token (a
      re-prefill after `update_params` does not overwrite it), so it belongs to that token's
      recorded version.
    num_cached_prompt_tokens: prompt rows taken from the cache (a session's conversation or
      a shared prefix) instead of being prefilled.
    routing: with `record_routing=True`, {absolute position: int32 [L_moe, K]} the experts
      each MoE layer routed the token at that position to (the same first-computation rule
      as `topk_indices`).

  Records of rows a request took from a shared prefix come from the request that computed
  them (the engine keeps them with the cached blocks), so every processed position is
  recorded once per request.
  """
  request_id: int
  token_ids: list
  logprobs: list
  versions: list
  finish_reason: str
  session_id: str | None = None
  num_rounds: int = 0
  num_accepted: int = 0
  topk_indices: dict | None = None
  num_cached_prompt_tokens: int = 0
  routing: dict | None = None

  @property
  def acceptance_length(self) -> float:
    """Tokens emitted per verify round (1 + accepted drafts); the first token, sampled
    from the prefill's logits, is not a verified one."""
    return (len(self.token_ids) - 1) / self.num_rounds if self.num_rounds else float("nan")


@dataclasses.dataclass
class _Session:
  sid: str
  tokens: list = dataclasses.field(default_factory=list)   # cached rows + the pending token
  blocks: list = dataclasses.field(default_factory=list)
  cache_len: int = 0
  h_last: object = None          # MTP: main hidden state of row cache_len - 1 (host copy)
  busy: bool = False
  last_used: int = 0
  shard: int = 0                 # the pool shard of its blocks (sharded serving)


@dataclasses.dataclass
class _Request:
  rid: int
  stream: int
  sampling: SamplingParams
  session: _Session | None
  record_topk: bool
  tokens: list                   # conversation: cached rows, rows to prefill, the pending token
  budget: int
  leader: int | None = None      # the copy whose prefill this one waits for (n > 1)
  blocks: list = dataclasses.field(default_factory=list)
  shard: int = 0
  cache_len: int = 0
  slot: int | None = None
  h_valid: bool = False
  sampled: bool = False
  prefilled: bool = False
  gen: list = dataclasses.field(default_factory=list)
  lps: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  topk: dict | None = None
  routing: dict | None = None
  rounds: int = 0
  accepted: int = 0
  cached_prompt: int = 0
  active: bool = True

  @property
  def feed_end(self) -> int:
    """Rows to have in the cache before decoding: all but the pending token."""
    return len(self.tokens) - 1 if self.sampled else len(self.tokens)


def _buckets(chunk: int):
  out, b = [], 16
  while b < chunk:
    out.append(b)
    b *= 2
  return out + [chunk]


def _is_token_id(t) -> bool:
  """A Python or NumPy integer; bool (an int subclass) and np.bool_ are not."""
  return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def _as_prompt(ids, name: str) -> list:
  """`ids` as a list; a scalar or a string is an error naming `name`."""
  try:
    flat = not isinstance(ids, (str, bytes)) and np.ndim(ids) == 1
  except ValueError:                               # ragged nesting
    flat = False
  if not flat:
    raise ValueError(f"{name}={ids!r:.80}: expected a list of token ids" + (
        "; `generate` takes a list of prompts, e.g. [[1, 2, 3]] for one prompt"
        if name.startswith("prompts[") else ""))
  return list(ids)


def _pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def invariant_tokens(cfg, platform: str = "cpu") -> int:
  """Fewest tokens per device call at which each row's result is independent of the others
  (module docstring): 8 on CPU (`numerics.MIN_INVARIANT_ROWS`; the MoE's CPU kernels run
  every token count); elsewhere max(2, ceil(E / K)) if any layer (or the MTP layer) is MoE
  (below it the MoE takes its gathered kernel), else 2."""
  if platform == "cpu":
    return numerics.MIN_INVARIANT_ROWS
  n_layers = cfg.num_hidden_layers + (1 if cfg.has_mtp else 0)
  if any(cfg.is_moe_layer(i) for i in range(n_layers)):
    return max(2, -(-cfg.n_routed_experts // cfg.num_experts_per_tok))
  return 2


@functools.lru_cache(maxsize=32)
def _step_fns(cfg, bs: int, speculative: bool, steps_per_sync: int, num_draft: int,
              rounds_per_sync: int, min_draft_lanes: int, routing: bool = False):
  """The jitted device steps of an engine, shared by every engine of the same configuration
  (an evaluation engine, a restarted rollout worker), so their compilations are reused."""
  def prefill(params, cache, h_last, lanes, table, tokens, start, n_valid, h_valid, packed):
    cache, h, out = steps.prefill(cfg, bs, speculative, params, cache,
                                  jnp.take(h_last, lanes, axis=0, mode="clip"), table, tokens,
                                  start, n_valid, h_valid, steps.unpack_state(packed), routing)
    return cache, h_last.at[lanes].set(h, mode="drop"), out

  def decode(params, cache, table, packed):
    cache, st, out = steps.decode(cfg, bs, steps_per_sync, params, cache, table,
                                  steps.unpack_state(packed), routing)
    return cache, {"pos": st["pos"], "active": st["active"]}, out

  def spec_rounds(params, cache, h_all, lanes, table, packed):
    st = steps.unpack_state(packed)
    h_last = jnp.take(h_all, lanes, axis=0, mode="clip")
    def body(carry, _):
      cache, fold, st = carry
      cache, fold, st, out = steps.speculative_round(cfg, bs, num_draft, params, cache,
                                                     fold, table, st, min_draft_lanes,
                                                     routing)
      return (cache, fold, st), out
    fold = steps.init_fold(st, h_last, num_draft)
    (cache, fold, st), outs = steps.scan_while_active(body, (cache, fold, st),
                                                      rounds_per_sync)
    cache, h_last = steps.finish_fold(cfg, bs, params, cache, fold, table, st)
    h_all = h_all.at[lanes].set(h_last, mode="drop")
    return cache, h_all, {"pos": st["pos"], "active": st["active"]}, outs

  set_h = lambda h, i, row: h.at[i].set(row.astype(h.dtype))
  return (jax.jit(prefill, donate_argnums=(1, 2)), jax.jit(decode, donate_argnums=(1,)),
          jax.jit(spec_rounds, donate_argnums=(1, 2)), jax.jit(set_h, donate_argnums=(0,)))


def serving_shardings(cfg, mesh, rules=None):
  """The engine's parameter shardings on `mesh` (the model's logical-axis `rules`, default
  sharding.DEFAULT_RULES); a mesh of None: the first device."""
  shapes, specs = gnn.abstract_params(cfg)
  if mesh is None:
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: dev, shapes)
  param_sh = shd.param_shardings(specs, mesh, shd.rules_from_config(rules))
  shd.check_divisible(shapes, param_sh, mesh)
  return param_sh


def serving_template(cfg, mesh, rules=None):
  """Shapes, dtypes and serving shardings of the engine's parameters, as
  `jax.ShapeDtypeStruct`s: a weight store's `latest(template)` reads each process's slices
  straight into them (rl/orchestration/snapshots.py)."""
  shapes, _ = gnn.abstract_params(cfg)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, serving_shardings(cfg, mesh, rules))


def tree_diff(got, want) -> str | None:
  """The first difference of tree `got` from `want`, naming its path (keystr): a missing or
  extra leaf, then a shape or dtype; None if they agree."""
  got_flat, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_flat, want_def = jax.tree_util.tree_flatten_with_path(want)
  got_at = {jax.tree_util.keystr(k): x for k, x in got_flat}
  want_at = {jax.tree_util.keystr(k): x for k, x in want_flat}
  missing = [k for k in want_at if k not in got_at]
  extra = [k for k in got_at if k not in want_at]
  if missing or extra:
    return "; ".join(
        f"{what} {ks[0]}" + (f" (and {len(ks) - 1} more)" if len(ks) > 1 else "")
        for what, ks in (("missing", missing), ("unexpected", extra)) if ks)
  if got_def != want_def:                    # same paths, other node types (e.g. a tuple)
    return f"tree structure {got_def} differs from {want_def}"
  for k, x in got_at.items():
    a, b = _shape_dtype(x), _shape_dtype(want_at[k])
    if a != b:
      return f"{k} is {a[1]}{list(a[0])}, expected {b[1]}{list(b[0])}"
  return None


def _shape_dtype(x):
  return np.shape(x), (x.dtype if hasattr(x, "dtype") else np.result_type(x))


@functools.lru_cache(maxsize=16)
def _finite_fns(out_sharding):
  """jitted (leaves -> bool[n] all finite per leaf, leaf -> its non-finite count)."""
  def count(x):
    bad = ~jnp.isfinite(x)
    if x.size < 2**31:
      return jnp.sum(bad, dtype=jnp.int32)
    return jnp.sum(jnp.sum(bad, axis=-1, dtype=jnp.int32), dtype=jnp.float32)  # 2**31+ values
  kw = {} if out_sharding is None else {"out_shardings": out_sharding}
  return (jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]), **kw),
          jax.jit(count, **kw))


def _devices(x):
  """Host arrays: None; a jax.Array: the ordered devices one jitted call over it runs on."""
  return x.sharding._device_assignment if isinstance(x, jax.Array) else None  # pylint: disable=protected-access


def check_finite(params, what: str) -> None:
  """Raises ValueError naming the first leaf (keystr) of `params` holding a NaN or inf, and
  how many. Integer leaves pass. jax.Arrays (sharded global arrays too) are checked where they
  live, by one jitted reduction per device assignment (one for a tree on one mesh) and one
  host read; host arrays by NumPy (never copied to a device)."""
  leaves = [(k, x) for k, x in jax.tree_util.tree_leaves_with_path(params)
            if jnp.issubdtype(_shape_dtype(x)[1], jnp.inexact)]
  groups = collections.defaultdict(list)
  for i, (_, x) in enumerate(leaves):
    groups[_devices(x)].append(i)
  ok, fns = np.ones(len(leaves), bool), {}
  for devices, idx in groups.items():
    xs = [leaves[i][1] for i in idx]
    if devices is None:
      ok[idx] = [np.isfinite(np.asarray(x)).all() for x in xs]
      continue
    sh = xs[0].sharding
    rep = NamedSharding(sh.mesh, P()) if isinstance(sh, NamedSharding) else None
    fns[devices] = _finite_fns(rep)
    ok[idx] = np.asarray(fns[devices][0](xs))
  if ok.all():
    return
  path, x = leaves[int(np.argmin(ok))]
  devices = _devices(x)
  n = (int(np.count_nonzero(~np.isfinite(np.asarray(x)))) if devices is None
       else int(fns[devices][1](x)))
  raise ValueError(f"{what}: {jax.tree_util.keystr(path)} holds {n} non-finite values (NaN "
                   f"or inf) of {np.size(x)}; refusing to serve them (diverged or corrupt "
                   "weights?)")


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
               record_routing: bool = False):
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
    """
    for name, v in (("max_batch", max_batch), ("max_len", max_len), ("block_size", block_size),
                    ("prefill_chunk", prefill_chunk), ("steps_per_sync", steps_per_sync),
                    ("rounds_per_sync", rounds_per_sync)):
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"Engine {name}={v!r}: expected a positive int")
    if max_len > cfg.max_position_embeddings:
      raise ValueError(f"Engine max_len={max_len}: expected <= ModelConfig."
                       f"max_position_embeddings={cfg.max_position_embeddings}")
    if scheduling not in SCHEDULING:
      raise ValueError(f"Engine scheduling={scheduling!r}: expected one of {SCHEDULING}")
    num_draft = cfg.mtp_num_steps if num_draft is None else num_draft
    if speculative:
      if not cfg.num_nextn_predict_layers or "mtp" not in params:
        raise ValueError("Engine speculative=True needs the MTP module: ModelConfig."
                         f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} and params "
                         "with an 'mtp' subtree")
      if num_draft < 1:
        raise ValueError(f"Engine num_draft={num_draft}: expected >= 1 with speculative=True")
    check_finite(params, "Engine params")
    self.weight_dtype, self.kv_dtype = weight_dtype, precision.check_kv_dtype(kv_dtype)
    self._scheme = precision.scheme_for(weight_dtype, quant_targets, quant_block, keep_indexer)
    if self._scheme is not None:
      quant.check_tree(params, self._scheme)
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
    self._min_tokens = invariant_tokens(cfg, platform) if batch_invariant else 1
    self.shape_buckets = shape_buckets
    self._buckets = _buckets(self.prefill_chunk)
    self._max_table = _pow2(per_request)
    self.mesh = mesh
    self._n_shards = 1 if mesh is None else shd.batch_axis_size(mesh)
    for name, v in (("max_batch", max_batch), ("num_blocks", num_blocks)):
      if v % self._n_shards:
        raise ValueError(f"Engine {name}={v}: expected a multiple of the mesh's batch axes "
                         f"({self._n_shards} shards: {dict(mesh.shape)})")
    per_shard = num_blocks // self._n_shards
    self._pools = [paging.BlockPool(per_shard, block_size, lookahead=1 if speculative else 0,
                                    first=i * per_shard) for i in range(self._n_shards)]
    self._template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    self._placement = self._shardings(params, rules)
    self._converter = self._make_converter()
    self._owned = None                 # per leaf: a copy the engine made (freed on a swap)
    self.params = self._place(self._converter(params))
    self._n_stop = 4
    self._records: dict[int, list] = {}      # cached block -> its rows' (topk, routing)
    cache = layer_stack.init_cache(cfg, num_blocks * block_size, with_mtp=speculative,
                                   kv_dtype=self.kv_dtype)
    self._cache = jax.device_put(cache, self._placement["cache"](cache))
    h_last = jnp.zeros((max_batch, cfg.hidden_size), cfg.dtype)
    self._h_last = jax.device_put(h_last, self._placement["rows"])
    self._slots: list[_Request | None] = [None] * max_batch
    self._waiting: collections.deque[_Request] = collections.deque()
    self._requests: dict[int, _Request] = {}
    self._sessions: dict[str, _Session] = {}
    self._undelivered: list[GenerationOutput] = []
    self._ids = itertools.count()
    self._session_ids = itertools.count()
    self._clock = itertools.count()
    self.stats = collections.Counter()
    self.last_stats: dict = {}
    self._prefill, self._decode, self._spec, self._set_h = _step_fns(
        cfg, block_size, speculative, steps_per_sync, num_draft, rounds_per_sync,
        self._min_tokens if self._n_shards == 1 else 1, self.record_routing)

  def _convert(self, params):
    return precision.convert(params, self.weight_dtype, self._scheme)

  def _make_converter(self):
    """params -> the served parameters (precision.py), on the devices, into the placement;
    the identity when nothing is converted (float32: the given arrays are served)."""
    if self.weight_dtype == "float32" and self._scheme is None:
      return lambda p: p
    flat_sh = self._placement["params"]
    fn = jax.jit(self._convert, out_shardings=flat_sh)

    def convert(params):
      with self._mesh_scope():
        return fn(params)
    return convert

  def _shardings(self, params, rules):
    """Where parameters, cache and per-slot rows live (one placement: no recompiles)."""
    served = jax.eval_shape(self._convert, self._template)
    if self.mesh is None:
      dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      return {"params": jax.tree.map(lambda _: dev, served), "rows": dev,
              "cache": lambda c: jax.tree.map(lambda _: dev, c)}
    param_sh = serving_shardings(self.cfg, self.mesh, rules)
    param_sh = precision.converted_shardings(served, param_sh)
    axes = tuple(a for a in shd.BATCH_AXES if self.mesh.shape.get(a, 1) > 1) or None
    rows = NamedSharding(self.mesh, P(axes))
    pool = lambda x: NamedSharding(self.mesh, P(*([None] * (x.ndim - 2)), axes, None))
    return {"params": param_sh, "rows": rows, "cache": lambda c: jax.tree.map(pool, c)}

  def _place(self, params):
    """Commits the parameters to the engine's placement, leaf by leaf.

    A leaf already in its sharding is served as it is (a trainer's own arrays: colocated, no
    copy); any other is copied device to device into the engine's sharding (a replica on
    other devices). Swapping weights frees each copied leaf the engine made once its new
    value is in place, so a swap needs at most one leaf of memory beyond the parameters.
    """
    new, owned = [], []
    old = jax.tree_util.tree_leaves(self.params) if self._owned is not None else None
    flat_sh = jax.tree_util.tree_leaves(self._placement["params"],
                                        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    for i, (x, sh) in enumerate(zip(jax.tree_util.tree_leaves(params), flat_sh)):
      y = jax.device_put(x, sh)
      if self._owned is not None and self._owned[i] and old[i] is not y:
        old[i].delete()                             # a copy of the previous version
      new.append(y)
      # Already in place, device_put aliases x's buffers (a new Array object sharing them):
      # only a leaf whose sharding changed is a copy of the engine's own.
      owned.append(not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sh, x.ndim)))
    self._owned = owned
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), new)

  def _mesh_scope(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _shard_of(self, slot: int) -> int:
    return slot // (self.max_batch // self._n_shards)

  # ------------------------------------------------------------------ weights
  def update_params(self, params, version: int) -> None:
    """Serves `params` (same tree, shapes and dtypes, every float finite) from the next step
    on; see the module docstring. Running requests and sessions are prefilled again under the
    new weights. A ValueError names the first missing, extra or mismatched leaf, or the first
    leaf holding a NaN or inf, before anything changes."""
    diff = tree_diff(params, self._template)
    if diff is not None:
      raise ValueError(f"update_params: the parameter tree differs from the engine's (a "
                       f"different config?): {diff}")
    check_finite(params, "update_params")
    self.params = self._place(self._converter(params))
    self._records = {}
    self.version = version
    running = sorted((r for r in self._slots if r is not None), key=lambda r: r.rid)
    for r in running:
      self._slots[r.slot] = None
      r.slot = None
    self._waiting.extendleft(reversed(running))
    for r in self._waiting:
      r.blocks, r.cache_len, r.h_valid = [], 0, False
    for s in self._sessions.values():
      s.blocks, s.cache_len, s.h_last = [], 0, None
    for pool in self._pools:
      pool.reset()

  # ------------------------------------------------------------------ sessions
  def new_session(self) -> str:
    """Opens a multi-turn conversation (its cache blocks persist between turns)."""
    sid = f"session-{next(self._session_ids)}"
    self._sessions[sid] = _Session(sid, last_used=next(self._clock))
    return sid

  def end_session(self, session_id: str) -> None:
    """Frees the session's blocks."""
    s = self._session(session_id)
    if s.busy:
      raise ValueError(f"end_session({session_id!r}): a turn is in flight; cancel it first")
    self._pools[s.shard].release(s.blocks)
    del self._sessions[session_id]

  def session_tokens(self, session_id: str) -> list:
    """The session's conversation so far: every prompt and generated token, in order."""
    return list(self._session(session_id).tokens)

  def _session(self, session_id) -> _Session:
    if session_id not in self._sessions:
      raise ValueError(f"session_id={session_id!r} is unknown; open sessions: "
                       f"{sorted(self._sessions)}")
    return self._sessions[session_id]

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
    prompt = _as_prompt(prompt_ids, "prompt_ids")
    if not isinstance(sampling, SamplingParams):
      raise ValueError(f"sampling: expected a SamplingParams, got {sampling!r}")
    self._check_stop_ids(sampling)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
      raise ValueError(f"submit: n={n!r}, expected an int >= 1")
    if record_routing and not self.record_routing:
      raise ValueError("submit: record_routing=True on an engine made with "
                       "record_routing=False; construct the Engine with record_routing=True")
    session = None
    if session_id is not None:
      session = self._session(session_id)
      if n != 1:
        raise ValueError(f"submit: n={n} with session_id={session_id!r}; a session has one "
                         "conversation, expected n=1")
      if session.busy:
        raise ValueError(f"session_id={session_id!r} has a turn in flight; wait for it or "
                         "cancel it")
    conv = list(session.tokens) if session else []
    self._check_prompt(prompt, conv)
    total = len(conv) + len(prompt)
    budget = min(sampling.max_new_tokens, self.max_len - total + 1)
    need = self._pools[0].blocks_for(total + budget - 1)
    if need > self._pools[0].num_blocks:
      raise ValueError(f"submit: {total} prompt tokens + {budget - 1} more rows need {need} "
                       f"blocks; the whole cache has num_blocks={self.num_blocks} of "
                       f"block_size={self.block_size}"
                       + (f" in {self._n_shards} shards" if self._n_shards > 1 else ""))
    self._n_stop = max(self._n_stop, _pow2(len(sampling.stop_token_ids)))
    ids = []
    for j in range(n):
      rid = next(self._ids)
      r = _Request(rid, stream + j, sampling, session, record_topk, conv + prompt, budget,
                   leader=ids[0] if ids else None,
                   topk={} if record_topk else None,
                   routing={} if record_routing else None)
      self._requests[rid] = r
      self._waiting.append(r)
      ids.append(rid)
    if session:
      session.busy = True
    return ids

  def _check_prompt(self, prompt, conv):
    v = self.cfg.vocab_size
    if not prompt and not conv:
      raise ValueError("prompt is empty: expected at least one token id")
    for i, t in enumerate(prompt):
      if not _is_token_id(t) or not 0 <= t < v:
        raise ValueError(f"prompt[{i}]={t!r}: token ids must be ints (not bools) in "
                         f"[0, vocab_size={v})")
    if len(conv) + len(prompt) > self.max_len:
      raise ValueError(f"prompt: {len(prompt)} tokens" + (f" after {len(conv)} session tokens"
                       if conv else "") + f" do not fit the cache (Engine max_len="
                       f"{self.max_len})")

  def _check_stop_ids(self, sampling: SamplingParams):
    v = self.cfg.vocab_size
    bad = [t for t in sampling.stop_token_ids if t >= v]
    if bad:
      raise ValueError(f"SamplingParams.stop_token_ids={list(sampling.stop_token_ids)}: "
                       f"{bad} outside the vocabulary; expected ids in [0, vocab_size={v})")

  def cancel(self, request_id: int) -> None:
    """Drops a waiting or running request; its blocks are released (a session keeps its
    conversation as it was before this turn)."""
    if request_id not in self._requests:
      raise ValueError(f"cancel: request_id={request_id!r} is unknown or already finished")
    r = self._requests.pop(request_id)
    if r.slot is not None:
      self._slots[r.slot] = None
    else:
      self._waiting.remove(r)
    if r.session is not None:
      s = r.session
      s.busy = False
      if r.blocks:                            # rows before the turn are unchanged
        s.blocks, s.cache_len = r.blocks, min(r.cache_len, len(s.tokens) - 1)
        s.h_last = None
      s.cache_len = min(s.cache_len, max(len(s.tokens) - 1, 0))
      s.shard = r.shard if r.blocks else s.shard
    else:
      self._pools[r.shard].release(r.blocks)

  @property
  def num_unfinished(self) -> int:
    """Requests submitted and not yet returned by `step` (waiting or running)."""
    return len(self._requests)

  @property
  def running(self) -> list[int]:
    """Ids of the requests that hold a slot now."""
    return [r.rid for r in self._slots if r is not None]

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
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, collections.abc.Iterable):
      raise ValueError(f"prompts: expected a list of prompts (token-id lists), got "
                       f"{type(prompts).__name__}")
    prompts = [_as_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    if not prompts:
      raise ValueError("prompts: expected at least one prompt")
    sps = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(sps) != len(prompts) or not all(isinstance(s, SamplingParams) for s in sps):
      raise ValueError(f"sampling: expected one SamplingParams or a list of {len(prompts)}, "
                       f"got {sampling!r}")
    sids = self._check_sessions(session_id, len(prompts))
    for i, (p, sid, sp) in enumerate(zip(prompts, sids, sps)):  # all checked before queueing
      try:
        self._check_prompt(p, self._sessions[sid].tokens if sid else [])
        self._check_stop_ids(sp)
      except ValueError as e:
        raise ValueError(f"prompts[{i}]: {e}") from None
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
    unknown = [i for i in request_ids if i not in self._requests
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

  def _check_sessions(self, session_id, n):
    if session_id is None or isinstance(session_id, str):
      if session_id is not None and n != 1:
        raise ValueError(f"session_id={session_id!r} with {n} prompts: pass one id per prompt")
      sids = [session_id] * n
    else:
      sids = list(session_id)
      if len(sids) != n:
        raise ValueError(f"session_id: {len(sids)} ids for {n} prompts")
    named = [s for s in sids if s is not None]
    if len(set(named)) != len(named):
      raise ValueError(f"session_id: a session appears twice in one call: {named}")
    for s in named:
      if self._session(s).busy:
        raise ValueError(f"session_id={s!r} has a turn in flight")
    return sids

  # ------------------------------------------------------------------ scheduling
  def step(self) -> list[GenerationOutput]:
    """One scheduling step (module docstring). Returns the requests that finished."""
    done, self._undelivered = self._undelivered, []
    self._admit()
    if any(r is not None and r.cache_len < r.feed_end for r in self._slots):
      self._prefill_step()
    if any(r is not None and r.active and r.sampled and r.cache_len == r.feed_end
           for r in self._slots):
      self._decode_step()
    for r in list(self._slots):
      if r is not None and not r.active:
        done.append(self._finish(r))
    return done

  def _admit(self):
    if self.scheduling == "static" and any(r is not None for r in self._slots):
      return
    deferred = []
    lookahead = self._pools[0].lookahead
    while self._waiting and None in self._slots:
      r = self._waiting[0]
      leader = self._requests.get(r.leader) if r.leader is not None else None
      if (leader is not None and not leader.prefilled
          and r.feed_end > self.block_size + lookahead):
        deferred.append(self._waiting.popleft())        # shares the leader's prompt blocks
        continue
      slot = self._pick_slot(r, leader)
      if slot is None or not self._reserve(r, self._shard_of(slot)):
        break
      self._waiting.popleft()
      r.slot = slot
      self._slots[slot] = r
      if r.h_valid and r.session is not None and self.speculative and r.session.h_last is not None:
        with self._mesh_scope():
          self._h_last = self._set_h(self._h_last, slot, r.session.h_last)
        r.session.h_last = None
    self._waiting.extendleft(reversed(deferred))

  def _pick_slot(self, r: _Request, leader):
    """A free slot for r: on the shard that holds its blocks (its own, its session's, its
    group leader's), else on the shard with the most available blocks."""
    free = [i for i, x in enumerate(self._slots) if x is None]
    held = r.shard if r.blocks else (r.session.shard if r.session and r.session.blocks
                                     else (leader.shard if leader is not None
                                           and leader.blocks else None))
    if held is not None:
      free = [i for i in free if self._shard_of(i) == held] or ([] if r.blocks else free)
    if not free:
      return None
    return max(free, key=lambda i: (self._pools[self._shard_of(i)].num_available, -i))

  def _reserve(self, r: _Request, shard: int) -> bool:
    """Gives r the blocks (of `shard`) for its prompt and budget, shared prefix first.
    False: not now."""
    pool = self._pools[shard]
    if r.session is not None and r.session.blocks and not r.blocks:
      s = r.session
      if s.shard == shard:
        r.blocks, r.cache_len = s.blocks, s.cache_len
        r.h_valid = not self.speculative or s.h_last is not None
        if not r.h_valid:                      # MTP row cache_len - 1 needs h: recompute it
          r.cache_len = max(r.cache_len - 1, 0)
      else:                                    # its shard is full: prefill it again here
        self._pools[s.shard].release(s.blocks)
      s.blocks, s.cache_len = [], 0
      r.cached_prompt = r.cache_len
    if not r.blocks:
      max_shared = (r.feed_end - 1) // self.block_size         # keep a token to prefill
      r.blocks = pool.lookup(r.tokens, self.version, max_shared)
      r.cache_len = len(r.blocks) * self.block_size
      r.cached_prompt, r.h_valid = r.cache_len, False
      self._recall(r)
    r.shard = shard
    rows = len(r.tokens) + (r.budget - len(r.gen)) - 1
    fresh = self._allocate(pool.blocks_for(rows) - len(r.blocks), r.session, shard)
    if fresh is None:
      return False
    r.blocks = r.blocks + fresh
    return True

  def _remember(self, r: _Request, blocks) -> None:
    """Keeps the records (top-k, routing) of the rows of `blocks` (newly cached prefix
    blocks of r) for the requests that will share them."""
    if r.topk is None and r.routing is None:
      return
    pos = {b: j * self.block_size for j, b in enumerate(r.blocks)}
    for b in blocks:
      rows = range(pos[b], pos[b] + self.block_size)
      self._records[b] = [((r.topk or {}).get(p), (r.routing or {}).get(p)) for p in rows]

  def _recall(self, r: _Request) -> None:
    """Fills r's records of the rows it took from cached blocks (`_remember`)."""
    if r.topk is None and r.routing is None:
      return
    for j, b in enumerate(r.blocks):
      for i, (topk, routing) in enumerate(self._records.get(b, ())):
        p = j * self.block_size + i
        if r.topk is not None and topk is not None:
          r.topk.setdefault(p, topk)
        if r.routing is not None and routing is not None:
          r.routing.setdefault(p, routing)

  def _allocate(self, n, keep, shard):
    """n blocks of `shard`, evicting its idle sessions least recently used first if needed."""
    pool = self._pools[shard]
    fresh = pool.allocate(max(n, 0))
    idle = sorted((s for s in self._sessions.values() if s is not keep and not s.busy
                   and s.blocks and s.shard == shard), key=lambda s: s.last_used)
    while fresh is None and idle:
      s = idle.pop(0)
      pool.release(s.blocks)
      s.blocks, s.cache_len, s.h_last = [], 0, None
      self.stats["sessions_evicted"] += 1
      fresh = pool.allocate(max(n, 0))
    return fresh

  def _lanes(self, rows, t: int = 1):
    """The slot of each lane (batch row) of a device call over `rows` with t tokens each: the
    participating slots packed into a power-of-two batch, so that idle slots cost nothing
    (padding lanes: slot max_batch), of at least `invariant_tokens` tokens when
    batch-invariant. Under a mesh lane i is slot i (a slot's blocks live on its shard)."""
    if self._n_shards > 1:
      return [b if b in rows else self.max_batch for b in range(self.max_batch)]
    n = min(_pow2(len(rows)), self.max_batch) if self.shape_buckets else self.max_batch
    n = max(n, _pow2(-(-self._min_tokens // t)))
    return rows + [self.max_batch] * (n - len(rows))

  def _live(self, lanes):
    return [(i, b) for i, b in enumerate(lanes) if b < self.max_batch]

  def _table(self, lanes, horizon: int):
    """Block tables [lanes, m], m the power-of-two bucket of the blocks that rows
    0 .. horizon - 1 span (at least `horizon` rows: the call's queries)."""
    m = _pow2(self._pools[0].blocks_for(horizon))
    if not self.shape_buckets:
      m = max(m, self._max_table)
    table = np.full((len(lanes), m), self.num_blocks, np.int32)
    for i, b in self._live(lanes):
      blocks = self._slots[b].blocks[:m]
      table[i, :len(blocks)] = blocks
    return table

  def _state(self, lanes):
    """Host-built decode state (steps.py) of each lane."""
    b = len(lanes)
    st = {"tok": np.zeros(b, np.int32), "pos": np.zeros(b, np.int32),
          "active": np.zeros(b, bool), "n_gen": np.zeros(b, np.int32),
          "budget": np.zeros(b, np.int32), "seed": np.zeros(b, np.int32),
          "req": np.zeros(b, np.int32), "temp": np.zeros(b, np.float32),
          "top_k": np.zeros(b, np.int32), "top_p": np.ones(b, np.float32),
          "stop": np.full((b, self._n_stop), -1, np.int32)}
    for i, slot in self._live(lanes):
      r = self._slots[slot]
      sp = r.sampling
      st["tok"][i] = r.tokens[-1]
      st["pos"][i] = len(r.tokens) - 1 if r.sampled else len(r.tokens)
      st["active"][i] = r.active
      st["n_gen"][i], st["budget"][i] = len(r.gen), r.budget
      st["seed"][i], st["req"][i] = sp.seed, r.stream
      st["temp"][i], st["top_k"][i], st["top_p"][i] = sp.temperature, sp.top_k, sp.top_p
      st["stop"][i, :len(sp.stop_token_ids)] = sp.stop_token_ids
    return st

  def _emit(self, r: _Request, tok: int, lp: float, pos: int, topk_lk=None, routing_lk=None):
    """Accounts one generated token of r (sampled for position pos + 1)."""
    r.gen.append(tok)
    r.lps.append(lp)
    r.versions.append(self.version)
    r.tokens.append(tok)
    r.sampled = True
    if r.topk is not None and topk_lk is not None:
      r.topk[pos] = topk_lk
    if r.routing is not None and routing_lk is not None:
      r.routing[pos] = routing_lk
    self.stats["generated_tokens"] += 1
    if tok in r.sampling.stop_token_ids or len(r.gen) >= r.budget:
      r.active = False

  def _prefill_step(self):
    t0 = time.perf_counter()
    rows = [b for b, r in enumerate(self._slots) if r is not None and r.cache_len < r.feed_end]
    longest = max(self._slots[b].feed_end - self._slots[b].cache_len for b in rows)
    t = next(x for x in self._buckets if x >= min(longest, self.prefill_chunk))
    lanes = self._lanes(rows, t)
    table = self._table(lanes, max([t] + [self._slots[b].cache_len + t for b in rows]))
    n = len(lanes)
    tokens = np.zeros((n, t), np.int32)
    start, n_valid = np.zeros(n, np.int32), np.zeros(n, np.int32)
    h_valid = np.zeros(n, bool)
    for i, b in self._live(lanes):
      r = self._slots[b]
      piece = r.tokens[r.cache_len:min(r.cache_len + t, r.feed_end)]
      tokens[i, :len(piece)] = piece
      start[i], n_valid[i], h_valid[i] = r.cache_len, len(piece), r.h_valid
    st = steps.pack_state(self._state(lanes))
    with self._mesh_scope():
      self._cache, self._h_last, out = self._prefill(
          self.params, self._cache, self._h_last, np.asarray(lanes, np.int32), table, tokens,
          start, n_valid, h_valid, st)
    out = shd.to_host(out)
    for i, b in self._live(lanes):
      r = self._slots[b]
      r.cache_len += int(n_valid[i])
      r.h_valid = True
      if r.topk is not None and out["topk"] is not None:
        for j in range(n_valid[i]):     # first computation wins: a re-prefill after a weight
          r.topk.setdefault(int(start[i]) + j, out["topk"][:, i, j])   # swap keeps the record
      if r.routing is not None and out.get("routing") is not None:
        for j in range(n_valid[i]):
          r.routing.setdefault(int(start[i]) + j, out["routing"][:, i, j])
      if r.cache_len == r.feed_end and not r.prefilled:
        r.prefilled = True
        pool = self._pools[r.shard]
        self._remember(r, pool.register(r.tokens, r.blocks, self.version,
                                        r.cache_len - pool.lookahead))
      if r.cache_len == r.feed_end and not r.sampled:
        self._emit(r, int(out["tok"][i]), float(out["logprob"][i]), r.cache_len - 1)
    self.stats["prefill_tokens"] += int(n_valid.sum())
    self.stats["prefill_calls"] += 1
    self.stats["prefill_s"] += time.perf_counter() - t0

  def _decode_step(self):
    t0 = time.perf_counter()
    rows = [b for b, r in enumerate(self._slots)
            if r is not None and r.active and r.sampled and r.cache_len == r.feed_end]
    # A speculative call verifies D + 1 tokens per lane (its drafting pads its own lanes).
    lanes = self._lanes(rows, self.num_draft + 1 if self.speculative else 1)
    live = self._live(lanes)
    ahead = self.rounds_per_sync * (self.num_draft + 1) if self.speculative else self.steps_per_sync
    table = self._table(lanes, max(self._slots[b].cache_len + ahead for b in rows))
    st = steps.pack_state(self._state(lanes))
    if self.speculative:
      with self._mesh_scope():
        self._cache, self._h_last, st, out = self._spec(
            self.params, self._cache, self._h_last, np.asarray(lanes, np.int32), table, st)
      out, st = shd.to_host((out, st))
      for k in range(self.rounds_per_sync):
        for i, b in live:
          r, e = self._slots[b], int(out["n_emit"][k, i])
          if not e:
            continue
          r.rounds += 1
          r.accepted += int(min(out["n_accepted"][k, i], e))
          for j in range(e):
            topk = None if out["topk"] is None else out["topk"][k, :, i, j]
            routing = None if out.get("routing") is None else out["routing"][k, :, i, j]
            self._emit(r, int(out["tok"][k, i, j]), float(out["logprob"][k, i, j]),
                       int(out["pos"][k, i]) + j, topk, routing)
          self.stats["rounds"] += 1
          self.stats["decode_slot_steps"] += 1
      self.stats["decode_steps"] += int((out["n_emit"] > 0).any(axis=1).sum())   # rounds run
    else:
      with self._mesh_scope():
        self._cache, st, out = self._decode(self.params, self._cache, table, st)
      out, st = shd.to_host((out, st))
      for s in range(self.steps_per_sync):
        for i, b in live:
          if out["emit"][s, i]:
            topk = None if out["topk"] is None else out["topk"][s, :, i]
            routing = None if out.get("routing") is None else out["routing"][s, :, i]
            self._emit(self._slots[b], int(out["tok"][s, i]), float(out["logprob"][s, i]),
                       int(out["pos"][s, i]), topk, routing)
      self.stats["decode_slot_steps"] += int(out["emit"].sum())
      self.stats["decode_steps"] += int(out["emit"].any(axis=1).sum())           # steps run
    for i, b in live:
      r = self._slots[b]
      r.cache_len = int(st["pos"][i])
      r.active = bool(st["active"][i]) and r.active
    self.stats["decode_calls"] += 1
    self.stats["decode_s"] += time.perf_counter() - t0

  def _finish(self, r: _Request) -> GenerationOutput:
    self._slots[r.slot] = None
    del self._requests[r.rid]
    sp = r.sampling
    if r.gen and r.gen[-1] in sp.stop_token_ids:
      reason = "stop"
    elif len(r.gen) >= sp.max_new_tokens:
      reason = "length"
    else:
      reason = "cache_full"
    if r.session is not None:
      s = r.session
      s.tokens, s.blocks, s.cache_len, s.shard = list(r.tokens), r.blocks, r.cache_len, r.shard
      s.h_last = (shd.to_host(self._h_last[r.slot]) if self.speculative
                  else None)
      s.busy, s.last_used = False, next(self._clock)
    else:
      self._pools[r.shard].release(r.blocks)
    return GenerationOutput(r.rid, r.gen, r.lps, r.versions, reason,
                            None if r.session is None else r.session.sid, r.rounds, r.accepted,
                            r.topk, r.cached_prompt, r.routing)

  @property
  def slot_utilisation(self) -> float:
    """Decoding slot-steps used / offered so far (max_batch per decode step)."""
    return self.stats["decode_slot_steps"] / max(self.stats["decode_steps"] * self.max_batch, 1)
