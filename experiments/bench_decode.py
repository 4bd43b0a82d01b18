r"""Inference engine benchmarks on this machine; every number is a ratio measured in one run.

  python -m experiments.bench_decode --checkpoint=/tmp/mj/dsa_sparse \
      --out=docs/bench_decode_cpu.json

Sections (`--sections`, default all):
  continuous  64 requests in 8 groups of 8 (`submit(n=8)`), output lengths log-normal
              (median 32 tokens, sigma 1.0, cap 512; no stop token, so every request runs
              to its length): continuous batching vs static batching (the same engine
              admitting new requests only when every slot is free). Total time and slot
              utilisation. Each mode runs the workload once to compile, then is timed.
  prefix      prefill of one group of 8 copies of a prompt (`n=8`: prefilled once, full
              blocks shared) vs 8 different prompts of the same length.
  hf          our engine vs transformers' `generate` (eager, its own cache) on the same
              weights, greedy, at several batch sizes, for the checkpoint's model (tiny)
              and a random `small`.
  speculative MTP speculative vs plain decoding at batch 1 (greedy) on `--spec_prompts`
              natural prompts (64-byte windows of this repository's own source; the tiny
              model pretrains on the standard library), each decoding setting against
              plain decoding at 8, 32 and 128 steps per call; with the time of one round
              split into draft / verify / accept, each part timed alone.
  bf16        the bfloat16 engine's log-probs vs the bfloat16 trainer forward and vs the
              float32 forward on the same tokens (the train/rollout gap at bf16).
  contexts    decode tokens/s at batch 1 after a long prompt, and KV-cache bytes/token
              (this latent cache vs a per-head K/V cache).
  floor       the decode step against its memory floor (glm5_jax/inference/roofline.py):
              per preset (`--floor_presets`, random weights), context (`--floor_contexts`
              prompt tokens) and batch (`--floor_batches`), the bytes a step must read (the
              routed experts its tokens select, recorded by the engine), this machine's
              streaming bandwidth (a jitted sum over 256 MiB: the median of one measurement per
              round of the runs it divides, the VM's bandwidth drifts), the
              floor time, the engine's measured step time (decode seconds / decode steps of
              `generate`, greedy, the prompts' blocks cached after the first run) and
              floor / step. Batch-invariant engine (RL's exactness mode: a lone request
              runs 8 lanes on CPU), per engine variant of `--floor_engines`
              (FLOOR_ENGINES: the streamed kernel, glm5_jax/stream_matmul.py; the one-row
              head, inference/matvec.py). Medians of `--floor_repeats` interleaved runs.

Writes the JSON of every section and prints a table per section.
"""

import json
import platform
import tempfile
import time

from absl import app
from absl import flags

from glm5_jax import numerics
numerics.batch_invariant_cpu()   # before JAX starts: the engine as RL runs it (bitwise the trainer)

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import convert
from glm5_jax import nn as gnn
from glm5_jax import timing
from glm5_jax.evals import mtp_acceptance
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.inference import engine as engine_lib
from glm5_jax.inference import roofline
from glm5_jax.inference import steps
from glm5_jax.nn import kv_cache
from glm5_jax.nn import layer_stack

SECTIONS = ("continuous", "prefix", "hf", "speculative", "bf16", "contexts", "floor")
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), f"any of {SECTIONS}")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "pretraining workdir or HF dir (trained "
                                  "weights; default: random tiny weights)")
_SLOTS = flags.DEFINE_integer("slots", 16, "max_batch of the continuous/static engines")
_HF_BATCHES = flags.DEFINE_list("hf_batches", ["1", "16", "64"], "batch sizes vs transformers")
_HF_NEW = flags.DEFINE_integer("hf_new_tokens", 32, "greedy tokens per request vs transformers")
_HF_PRESETS = flags.DEFINE_list("hf_presets", ["checkpoint", "small"],
                                "'checkpoint' (the --checkpoint model) and/or presets")
_SPEC_NEW = flags.DEFINE_integer("spec_new_tokens", 96, "tokens per speculative run")
_SPEC_ROUNDS = flags.DEFINE_integer("spec_rounds", 32, "speculative rounds per device call")
_SPEC_PROMPTS = flags.DEFINE_integer("spec_prompts", 8, "prompts of the speculative section")
_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "4096"], "prompt lengths (contexts)")
_FLOOR_PRESETS = flags.DEFINE_list("floor_presets", ["tiny", "small"], "presets (random "
                                   "weights) of the floor section")
_FLOOR_BATCHES = flags.DEFINE_list("floor_batches", ["1", "16", "64"], "floor: batch sizes")
_FLOOR_CONTEXTS = flags.DEFINE_list("floor_contexts", ["32", "1024", "4096"],
                                    "floor: prompt tokens before the decode steps")
_FLOOR_NEW = flags.DEFINE_integer("floor_new_tokens", 33, "floor: tokens generated per "
                                  "request (the first by the prefill)")
_FLOOR_REPEATS = flags.DEFINE_integer("floor_repeats", 5, "floor: interleaved timed runs")
# Engine variants the floor section times, interleaved: Engine keyword arguments.
FLOOR_ENGINES = {
    "default": dict(),                                           # streamed + one-row head
    "xla": dict(stream_matmul=False),                            # XLA's matmuls, one-row head
    "xla_8lane_head": dict(stream_matmul=False, matvec_head=False),
}
_FLOOR_ENGINES = flags.DEFINE_list("floor_engines", ["default", "xla"],
                                   f"floor: engine variants, of {sorted(FLOOR_ENGINES)}")
_OUT = flags.DEFINE_string("out", "bench_decode.json", "JSON output path")


def _model():
  if _CHECKPOINT.value:
    cfg, params = convert.load_model(_CHECKPOINT.value)
    return cfg, params, _CHECKPOINT.value
  cfg = config_lib.get_preset("tiny")
  return cfg, gnn.init_params(cfg, 0), "random tiny"


def _prompts(cfg, n, length, seed):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, cfg.vocab_size, length).tolist() for _ in range(n)]


def _run(engine, groups, lengths):
  """Submits every group (n copies of its prompt, each copy its own length), steps to the
  end. Returns (seconds, slot utilisation of this run)."""
  before = dict(engine.stats)
  t0 = time.perf_counter()
  ids = []
  for g, (prompt, lens) in enumerate(zip(groups, lengths)):
    for j, n_new in enumerate(lens):
      ids += engine.submit(prompt, SamplingParams(max_new_tokens=int(n_new), seed=g),
                           stream=j)
  engine.wait(ids)
  dt = time.perf_counter() - t0
  used = engine.stats["decode_slot_steps"] - before.get("decode_slot_steps", 0)
  offered = (engine.stats["decode_steps"] - before.get("decode_steps", 0)) * engine.max_batch
  return dt, used / max(offered, 1)


def bench_continuous(cfg, params):
  rng = np.random.default_rng(0)
  lengths = np.minimum(np.round(np.exp(np.log(32) + rng.normal(size=(8, 8)))), 512).astype(int)
  lengths = np.maximum(lengths, 1)
  max_len = 24 + 512 + 8
  out = {"requests": 64, "groups": 8, "slots": _SLOTS.value,
         "output_len_median": float(np.median(lengths)), "output_len_max": int(lengths.max()),
         "output_tokens": int(lengths.sum())}
  for mode in ("static", "continuous"):
    eng = Engine(cfg, params, max_batch=_SLOTS.value, max_len=max_len, scheduling=mode)
    # Once to compile every shape the schedule uses, then timed on other prompts of the
    # same lengths (no cached prefix from the first run: the same shapes again).
    _run(eng, _prompts(cfg, 8, 24, 1), lengths)
    out[f"{mode}_s"], out[f"{mode}_slot_utilisation"] = _run(eng, _prompts(cfg, 8, 24, 2),
                                                             lengths)
    print(f"  {mode}: {out[f'{mode}_s']:.2f}s, slot utilisation "
          f"{out[f'{mode}_slot_utilisation']:.2f}", flush=True)
  out["speed_up"] = out["static_s"] / out["continuous_s"]
  return out


def bench_prefix(cfg, params, length=2048):
  def prefill_time(same: bool, seed):
    eng = Engine(cfg, params, max_batch=8, max_len=length + 8, prefill_chunk=512)
    sp = SamplingParams(max_new_tokens=1)
    for s in (seed, seed + 1):                                  # the second one is timed
      prompts = _prompts(cfg, 1 if same else 8, length, s)
      t0 = time.perf_counter()
      ids = (eng.submit(prompts[0], sp, n=8) if same
             else [eng.submit(p, sp, stream=j)[0] for j, p in enumerate(prompts)])
      eng.wait(ids)
      dt = time.perf_counter() - t0
    return dt
  out = {"prompt_len": length, "group_of_8_s": prefill_time(True, 10),
         "separate_8_s": prefill_time(False, 20)}
  out["speed_up"] = out["separate_8_s"] / out["group_of_8_s"]
  print(f"  prefix: group {out['group_of_8_s']:.3f}s vs separate {out['separate_8_s']:.3f}s "
        f"(x{out['speed_up']:.2f})", flush=True)
  return out


def bench_hf(cfg, params, name):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from glm5_jax import hf  # pylint: disable=g-import-not-at-top
  d = tempfile.mkdtemp()
  hf.save_pretrained(cfg, params, d)
  model = transformers.GlmMoeDsaForCausalLM.from_pretrained(d).eval()
  n_new, prompt_len = _HF_NEW.value, 32
  rows = []
  for b in (int(x) for x in _HF_BATCHES.value):
    prompts = _prompts(cfg, b, prompt_len, 2)
    eng = Engine(cfg, params, max_batch=b, max_len=prompt_len + n_new + 8)
    sp = SamplingParams(max_new_tokens=n_new, temperature=0.0)
    eng.generate(prompts, sp)                                   # compile
    t0 = time.perf_counter()
    outs = eng.generate(_prompts(cfg, b, prompt_len, 3), sp)
    ours = time.perf_counter() - t0
    x = torch.tensor(_prompts(cfg, b, prompt_len, 3))
    with torch.no_grad():
      model.generate(x, max_new_tokens=2, min_new_tokens=2, do_sample=False)     # warm up
      t0 = time.perf_counter()
      ref = model.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
      theirs = time.perf_counter() - t0
    same = float(np.mean([o.token_ids == r[prompt_len:].tolist() for o, r in zip(outs, ref)]))
    rows.append({"model": name, "batch": b, "ours_s": ours, "transformers_s": theirs,
                 "speed_up": theirs / ours, "greedy_sequences_equal": same})
    print(f"  {rows[-1]}", flush=True)
  return rows


def bench_speculative(cfg, params):
  """Batch-1 greedy decoding of `--spec_prompts` natural prompts, one request at a time:
  plain (8 steps per call, the default, then 32 and 128) vs MTP speculative
  (`--spec_rounds` rounds per call; D = the config's MTP steps, and D + 2). Each variant
  decodes every prompt once per repeat, 5 repeats interleaved (this machine's timings
  drift); the medians of the per-repeat totals are compared."""
  prompts = mtp_acceptance.code_prompts(_SPEC_PROMPTS.value, 64, 0)
  n = _SPEC_NEW.value
  d = cfg.mtp_num_steps
  variants = {"plain_sync8": dict(steps_per_sync=8), "plain_sync32": dict(steps_per_sync=32),
              "plain_sync8_matmul_head": dict(steps_per_sync=8, matvec_head=False),
              "plain_sync128": dict(steps_per_sync=128),
              f"speculative_d{d}": dict(speculative=True, rounds_per_sync=_SPEC_ROUNDS.value),
              f"speculative_d{d + 2}": dict(speculative=True, num_draft=d + 2,
                                            rounds_per_sync=_SPEC_ROUNDS.value)}
  sp = SamplingParams(max_new_tokens=n, temperature=0.0)
  engines = {}
  for name, kw in variants.items():
    engines[name] = Engine(cfg, params, max_batch=1, max_len=64 + n + 64, **kw)
    for p in prompts:                                            # compile every shape
      engines[name].generate([p], sp)
  times = {name: [] for name in variants}
  step_s = {name: [] for name in variants}       # the engine's decode seconds per step / round
  accept = {}
  for _ in range(5):
    for name, eng in engines.items():
      t0, decode_s, steps_run = time.perf_counter(), 0.0, 0
      res = []
      for p in prompts:
        res.append(eng.generate([p], sp)[0])
        decode_s += eng.last_stats["decode_s"]
        steps_run += eng.last_stats["decode_steps"]
      times[name].append(time.perf_counter() - t0)
      step_s[name].append(decode_s / steps_run)
      if res[0].num_rounds:
        accept[name] = [r.acceptance_length for r in res]
  out = {"batch": 1, "prompts": len(prompts), "new_tokens": n,
         "rounds_per_sync": _SPEC_ROUNDS.value,
         "seconds": {k: float(np.median(v)) for k, v in times.items()},
         "decode_s_per_step_or_round": {k: float(np.median(v)) for k, v in step_s.items()},
         "acceptance_length": {k: float(np.mean(v)) for k, v in accept.items()},
         "acceptance_length_per_prompt": accept}
  # The bound: a round emits `acceptance` tokens in the time of round / step plain steps.
  plain_step = min(v for k, v in out["decode_s_per_step_or_round"].items()
                   if k.startswith("plain"))
  out["round_in_plain_steps"] = {k: out["decode_s_per_step_or_round"][k] / plain_step
                                 for k in accept}
  out["decode_speed_up_bound"] = {k: out["acceptance_length"][k]
                                  / out["round_in_plain_steps"][k] for k in accept}
  best_plain = min(v for k, v in out["seconds"].items() if k.startswith("plain"))
  best_spec = min(v for k, v in out["seconds"].items() if k.startswith("speculative"))
  out["speed_up_vs_default_plain"] = out["seconds"]["plain_sync8"] / best_spec
  out["speed_up_vs_best_plain"] = best_plain / best_spec
  out["parts_s"] = _round_parts(cfg, engines["plain_sync8"].params, d)
  print(f"  speculative: {out['seconds']}, acceptance {out['acceptance_length']}, round in "
        f"plain steps {out['round_in_plain_steps']}, bound {out['decode_speed_up_bound']}, "
        f"x{out['speed_up_vs_default_plain']:.2f} "
        f"vs default plain, x{out['speed_up_vs_best_plain']:.2f} vs best plain; parts (ms) "
        f"{ {k: round(v * 1e3, 3) for k, v in out['parts_s'].items()} }", flush=True)
  return out


def _round_parts(cfg, params, d, iters=32):
  """Seconds per iteration of each part of a speculative round and of a plain step, each
  run `iters` times inside one compiled loop (as the engine runs them: no dispatch per
  step) with the parameters as arguments, at the engine's lanes for one request: plain
  steps and drafts after the first over `invariant_tokens` lanes (one real, the others
  inert), the verify and the first MTP call (catch-up + draft 1) over one lane of D + 1
  tokens. `params`: an engine's served parameters (with the one-row head's blocks, when it
  serves them: inference/matvec.py). Medians of 5 runs."""
  bs, nb = 16, 16
  cache = layer_stack.init_cache(cfg, nb * bs, with_mtp=True)
  lanes = engine_lib.invariant_tokens(cfg, jax.devices()[0].platform)

  def lane_args(n_lanes, t):
    table = jnp.full((n_lanes, nb), nb, jnp.int32).at[0].set(jnp.arange(nb, dtype=jnp.int32))
    n_valid = jnp.zeros(n_lanes, jnp.int32).at[0].set(t)
    return table, jnp.ones((n_lanes, t), jnp.int32), jnp.full(n_lanes, 100, jnp.int32), n_valid

  def looped(body):
    """body(params, cache) -> (cache, outputs): `iters` calls in one compiled loop, with
    every output summed into the carry so that nothing is dropped as dead code."""
    def run(p, c):
      def step(carry, _):
        c, total = carry
        c, y = body(p, c)
        return (c, total + sum(jnp.sum(x).astype(jnp.float32) for x in jax.tree.leaves(y))), None
      return jax.lax.scan(step, (c, jnp.float32(0)), None, length=iters)[0]
    run = jax.jit(run)
    return lambda: run(params, cache)

  def forward(n_lanes, t):
    table, tok, pos, n = lane_args(n_lanes, t)
    def body(p, c):
      out, c = steps.forward(cfg, bs, p, c, table, tok, pos, n)
      return c, steps.head(cfg, p, out.hidden)
    return looped(body)

  def mtp(n_lanes, t):
    table, tok, pos, n = lane_args(n_lanes, t)
    h = jnp.zeros(tok.shape + (cfg.hidden_size,), cfg.dtype)
    live = (jnp.arange(n_lanes) == 0) if t == 1 else None       # a draft after the first
    def body(p, c):
      h_out, logits, c = steps.mtp(cfg, bs, p, c, table, tok, h, pos, n, live_b=live)
      return c, (h_out, logits)
    return looped(body)

  table, _, pos, _ = lane_args(1, 1)
  one = jnp.ones(1, jnp.int32)
  st = {"tok": one, "pos": pos, "active": jnp.ones(1, bool), "n_gen": one, "budget": one * 99,
        "seed": one, "req": one, "temp": jnp.zeros(1), "top_k": one * 0, "top_p": jnp.ones(1),
        "stop": -jnp.ones((1, 4), jnp.int32)}
  fold = steps.init_fold(st, jnp.zeros((1, cfg.hidden_size), cfg.dtype), d)
  def plain(p, c):
    c, _, outs = steps.decode(cfg, bs, 1, p, c, steps.pad_lanes(table, lanes, nb),
                              jax.tree.map(lambda x: steps.pad_lanes(x, lanes), st))
    return c, outs["logprob"]
  def spec(p, c):
    c, _, _, res = steps.speculative_round(cfg, bs, d, p, c, fold, table, st, lanes)
    return c, (res["logprob"], res["n_emit"])
  parts = {f"plain_step_{lanes}_lanes": looped(plain),
           f"verify_{d + 1}_tokens": forward(1, d + 1),
           f"mtp_{d + 1}_tokens": mtp(1, d + 1),
           f"mtp_1_token_{lanes}_lanes": mtp(lanes, 1),
           "round": looped(spec)}
  for f in parts.values():
    jax.block_until_ready(f())                                   # compile
  times = {k: [] for k in parts}
  for _ in range(5):
    for k, f in parts.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f())
      times[k].append((time.perf_counter() - t0) / iters)
  out = {k: float(np.median(v)) for k, v in times.items()}
  out["accept_and_rest"] = max(out["round"] - out[f"verify_{d + 1}_tokens"]
                               - out[f"mtp_{d + 1}_tokens"]
                               - (d - 1) * out[f"mtp_1_token_{lanes}_lanes"], 0.0)
  return out


def bench_bf16(cfg, params):
  cfg16 = cfg.replace(dtype="bfloat16")
  prompts = _prompts(cfg, 4, 48, 5)
  eng = Engine(cfg16, params, max_batch=4, max_len=128)
  outs = eng.generate(prompts, SamplingParams(max_new_tokens=32, seed=0))
  seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
  tokens = jnp.asarray(seqs, jnp.int32)
  gaps = {}
  for name, c in (("bf16_trainer", cfg16), ("f32_trainer", cfg)):
    logits = jax.jit(lambda p, t, c=c: gnn.GLM5(c).apply({"params": p}, t, mtp=False).logits)(
        params, tokens)
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
    d = np.concatenate([np.abs(np.asarray(o.logprobs) - logp[i, 47 + np.arange(32), o.token_ids])
                        for i, o in enumerate(outs)])
    gaps[name] = {"max_abs": float(d.max()), "mean_abs": float(d.mean())}
  print(f"  bf16 engine log-prob gap: {gaps}", flush=True)
  return {"tokens": 4 * 32, **gaps}


def bench_contexts(cfg, params):
  rows = []
  for ctx in (int(c) for c in _CONTEXTS.value):
    c = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, ctx + 128))
    eng = Engine(c, params, max_batch=1, max_len=ctx + 128, prefill_chunk=512)
    sp = SamplingParams(max_new_tokens=64, temperature=0.0)
    eng.generate(_prompts(c, 1, ctx, 6), sp)                    # compile
    eng.generate(_prompts(c, 1, ctx, 7), sp)                    # same shapes, no shared prefix
    st = eng.last_stats
    rows.append({"context": ctx, "decode_tok_s": 63 / st["decode_s"],
                 "prefill_tok_s": st["prefill_tokens"] / st["prefill_s"],
                 **{f"kv_bytes_per_token_{k}": v for k, v in kv_cache.bytes_per_token(c).items()}})
    print(f"  {rows[-1]}", flush=True)
  return rows


def stream_gbs(mib: int = 256) -> float:
  """GB/s of a jitted sum over `mib` MiB of float32 (read once), median of 7 runs."""
  x = jnp.ones((mib * 2 ** 20 // 4,), jnp.float32)
  return x.nbytes / timing.median_time(jax.jit(jnp.sum), x, repeats=7) / 1e9


def _floor_bytes(cfg, params, outs, ctx, n_new):
  """Mean bytes of the decode steps of `outs` (greedy, recorded routing): step i processes
  position ctx + i of every request."""
  need = []
  for i in range(n_new - 1):
    pos = ctx + i
    used = roofline.distinct_experts([o.routing[pos] for o in outs])
    need.append(roofline.decode_bytes(cfg, params, used, [pos + 1] * len(outs)))
  return {k: float(np.mean([n[k] for n in need])) for k in need[0]}


def bench_floor(cfg, params):
  del cfg, params                                    # random weights of each preset
  batches = [int(b) for b in _FLOOR_BATCHES.value]
  n_new = _FLOOR_NEW.value
  sp = SamplingParams(max_new_tokens=n_new, temperature=0.0)
  rows = []
  for name in _FLOOR_PRESETS.value:
    for ctx in (int(c) for c in _FLOOR_CONTEXTS.value):
      c = config_lib.get_preset(name)
      c = c.replace(max_position_embeddings=max(c.max_position_embeddings, ctx + n_new + 16))
      params = gnn.init_params(c, 0)
      kw = dict(max_batch=max(batches), max_len=ctx + n_new + 16, prefill_chunk=512)
      prompts = _prompts(c, max(batches), ctx, 11)
      # The bytes: the same greedy requests on an engine that records their routing (batch
      # invariance: the same tokens as the timed engine's).
      recorder = Engine(c, params, record_routing=True, **kw)
      need = {b: _floor_bytes(c, params, recorder.generate(prompts[:b], sp,
                                                           record_routing=True), ctx, n_new)
              for b in batches}
      del recorder
      engines = {v: Engine(c, params, **FLOOR_ENGINES[v], **kw) for v in _FLOOR_ENGINES.value}
      runs = [(mv, b) for b in batches for mv in engines]
      for mv, b in runs:                                  # compile; the prompts' blocks cached
        engines[mv].generate(prompts[:b], sp)
      times = {run: [] for run in runs}
      gbs_all = []      # the VM's bandwidth drifts: measured between the rounds it divides
      for _ in range(_FLOOR_REPEATS.value):
        gbs_all.append(stream_gbs())
        for mv, b in runs:
          engines[mv].generate(prompts[:b], sp)
          st = engines[mv].last_stats
          times[mv, b].append(st["decode_s"] / st["decode_steps"])
      gbs = float(np.median(gbs_all))
      print(f"  streaming read: {gbs:.1f} GB/s (median; {min(gbs_all):.1f} .. "
            f"{max(gbs_all):.1f} over the rounds)", flush=True)
      for mv, b in runs:
        step_s = float(np.median(times[mv, b]))
        floor_s = need[b]["total"] / (gbs * 1e9)
        rows.append({"preset": name, "context": ctx, "batch": b, "stream_gbs": gbs,
                     "stream_gbs_all": gbs_all,
                     "engine": mv, "matvec_head": engines[mv].head_blocks is not None,
                     "stream_matmul": engines[mv].stream_plan is not None,
                     **{f"{k}_bytes": v for k, v in need[b].items()}, "floor_ms": floor_s * 1e3,
                     "step_ms": step_s * 1e3, "step_ms_all": [t * 1e3 for t in times[mv, b]],
                     "fraction": floor_s / step_s})
        r = rows[-1]
        print(f"  {name:>5} ctx {ctx:>5} batch {b:>3} {mv:>14}: "
              f"{r['total_bytes'] / 1e6:8.1f} MB (weights {r['weights_bytes'] / 1e6:.1f}, "
              f"experts {r['experts_bytes'] / 1e6:.1f}, kv {r['kv_bytes'] / 1e6:.1f})  floor "
              f"{r['floor_ms']:7.2f} ms  step {r['step_ms']:7.2f} ms  {r['fraction']:6.1%}",
              flush=True)
  return rows


def main(argv):
  del argv
  bad = set(_SECTIONS.value) - set(SECTIONS)
  if bad:
    raise ValueError(f"--sections: {sorted(bad)} unknown; expected any of {SECTIONS}")
  if not set(_FLOOR_ENGINES.value) <= set(FLOOR_ENGINES):
    raise ValueError(f"--floor_engines={_FLOOR_ENGINES.value}: expected any of "
                     f"{sorted(FLOOR_ENGINES)}")
  cfg, params, weights = _model()
  result = {"machine": f"{platform.node()} ({platform.processor() or platform.machine()}, "
                       f"{jax.devices()[0].platform}, {jax.device_count()} device(s))",
            "weights": weights}
  for section in _SECTIONS.value:
    print(f"[{section}]", flush=True)
    if section == "hf":
      rows = []
      for name in _HF_PRESETS.value:
        if name == "checkpoint":
          rows += bench_hf(cfg, params, weights)
        else:
          c = config_lib.get_preset(name)
          rows += bench_hf(c, gnn.init_params(c, 0), f"random {name}")
      result["hf"] = rows
    else:
      result[section] = globals()[f"bench_{section}"](cfg, params)
  with open(_OUT.value, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main)
