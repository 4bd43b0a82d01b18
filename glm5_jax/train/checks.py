"""Config checks as tables: each stage's fields and the rule each must satisfy.

`validate(c)` runs `TABLE[c.stage]` before anything is built (no JAX call: jax.distributed
may not be started yet). A row is (field, rule, what is expected); a failing row raises
`ValueError("config.<field>=<value>: expected <what>")`. Rules read the field's value and the
whole config (for rules that relate two fields). Checks that need a built object (a task,
a context policy, the mesh) live with the code that builds it.
"""

from __future__ import annotations

from typing import Any, Callable


def _int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def at_least(n) -> Callable[[Any, Any], bool]:
  return lambda v, c: _int(v) and v >= n


def positive(v, c) -> bool:
  del c
  return _int(v) and v >= 1


def between(lo, hi) -> Callable[[Any, Any], bool]:
  """An int in [lo, hi]; `hi` may be a function of the config."""
  return lambda v, c: _int(v) and lo <= v <= (hi(c) if callable(hi) else hi)


def _in_range(lo, hi, what=""):
  return f"an integer in [{lo}, {hi}]{what}"


def _profile(v, c) -> bool:
  del c
  return not v or (len(v) == 2 and 0 <= v[0] < v[1])


def _bucket(n: int) -> int:
  """Power-of-two bucket of a length (>= 16), as rl/algorithm/trajectory.py pads batches."""
  b = 16
  while b < n:
    b *= 2
  return b


def _divides_rollouts(v, c) -> bool:
  n = c.rl.group_size * c.rl.prompts_per_step
  return _int(v) and v >= 2 and n % v == 0


_COUNT = "an integer >= 1"
_MAX_GROUP, _MAX_PROBLEMS, _MAX_PROMPTS, _MAX_LEN = 4096, 100_000, 65_536, 1 << 20
_MAX_WORKERS, _MAX_TURNS = 1024, 1024

COMMON = [
    ("total_steps", positive, _COUNT),
    ("log_every", positive, _COUNT),
    ("keep_checkpoints", positive,
     "an integer >= 1 (the newest checkpoints kept; the one a run resumes from is among them)"),
    ("learning_rate", lambda v, c: v >= 0, ">= 0"),
    ("seed", lambda v, c: _int(v) and 0 <= v < 2**31, "an integer in [0, 2**31)"),
    ("num_devices", lambda v, c: _int(v) and v >= 0, "an int >= 0 (0 = every device)"),
    ("microbatches", positive, _COUNT + " (gradient accumulation)"),
    ("profile_steps", _profile, "() or (start, stop) with 0 <= start < stop (steps "
     "start..stop-1 are traced), e.g. --config.profile_steps='(10, 13)'"),
]

_QAT_TARGETS = ("experts", "attention", "all_linear")   # optim/param_groups.QUANT_TARGETS
_WEIGHT_DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "int4")   # inference/precision.py
_KV_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")

LM = COMMON + [
    ("qat.bits", lambda v, c: v in (0, 4), "0 (no QAT) or 4 (INT4 quantization-aware)"),
    ("qat.group_size", lambda v, c: _int(v) and v >= 2 and v % 2 == 0 and v <= 4096,
     "an even integer in [2, 4096] (INT4 values per scale, along the reduction dimension)"),
    ("qat.targets", lambda v, c: v in _QAT_TARGETS, f"one of {_QAT_TARGETS}"),
    ("checkpoint_every", positive, _COUNT),
    ("eval_every", positive, _COUNT),
    ("eval_batches", positive, _COUNT),
    ("loss_chunk", positive, _COUNT),
    ("param_init", lambda v, c: v in ("auto", "host", "jit"), "'auto', 'host' or 'jit'"),
]

# Both RL loops: a trained model to start from, groups, temperature 1, the trust band.
RL = COMMON + [
    ("init_from", lambda v, c: bool(v), "a trained model to start RL from (an SFT "
     "workdir, a pretraining workdir or a Hugging Face directory)"),
    ("rl.group_size", at_least(2), ">= 2 (group-relative advantages)"),
    ("rl.temperature", lambda v, c: v == 1.0, "1.0; the losses' ratios compare raw-policy "
     "log-probs, which are the sampling distribution's only at 1"),
    ("rl.eps_low", lambda v, c: v >= 0.0, ">= 0 (the lower bound is 1 - eps_low)"),
    ("rl.eps_high", lambda v, c: v >= 0.0, ">= 0 (the upper bound is 1 + eps_high)"),
    # Upper bounds: a count past them is a typo, and drawing that many distinct problems
    # (or slots, or groups) would run for hours before the first line of output.
    ("rl.group_size", between(2, _MAX_GROUP), _in_range(2, _MAX_GROUP, " (group-relative "
     "advantages)")),
    ("rl.eval_problems", between(1, _MAX_PROBLEMS), _in_range(1, _MAX_PROBLEMS,
     " (held-out problems)")),
    ("rl.max_len", between(2, _MAX_LEN), _in_range(2, _MAX_LEN, " (engine rows per "
     "sequence)")),
    ("rl.max_new_tokens", between(1, lambda c: c.rl.max_len - 1),
     "an integer in [1, config.rl.max_len - 1] (a prompt takes at least one row)"),
    # The rollout engine's precision (glm5_jax/inference/precision.py).
    ("rl.rollout_weight_dtype", lambda v, c: v in _WEIGHT_DTYPES, f"one of {_WEIGHT_DTYPES}"),
    ("rl.rollout_kv_dtype", lambda v, c: v in _KV_DTYPES, f"one of {_KV_DTYPES}"),
    ("rl.rollout_quant_targets", lambda v, c: v in ("",) + _QAT_TARGETS,
     f"'' (the format's default) or one of {_QAT_TARGETS}"),
    ("rl.rollout_quant_block", lambda v, c: _int(v) and 0 <= v <= 4096,
     "an integer in [0, 4096] (0 = the format's default: FP8 128, INT4 32)"),
    ("rl.rollout_indexer_dtype", lambda v, c: v in ("same", "float32"),
     "'same' (as the other weights) or 'float32' (the trainer's precision)"),
    ("rl.routing_replay", lambda v, c: isinstance(v, bool), "True or False"),
] + [(f"rl.{f}", positive, _COUNT) for f in (
    "prefill_chunk", "steps_per_sync", "logprob_chunk", "eval_every", "checkpoint_every")]

GRPO = RL + [
    ("rl.icepop_beta", lambda v, c: v >= 1.0, ">= 1 (the IcePop band is [1/beta, beta])"),
    ("rl.icepop", lambda v, c: isinstance(v, bool), "True (GRPO + IcePop) or False (plain "
     "GRPO-clip, no train/rollout mismatch correction)"),
    ("rl.minibatches", _divides_rollouts, ">= 2 (so the clip acts) and a divisor of the "
     "rollouts per step (group_size * prompts_per_step)"),
    ("rl.prompts_per_step", between(1, _MAX_PROMPTS), _in_range(1, _MAX_PROMPTS)),
]

ASYNC = RL + [
    ("rl.backend", lambda v, c: v in ("local", "ray", "distributed"),
     "one of ('local', 'ray', 'distributed')"),
    ("rl.snapshots", lambda v, c: v in ("sharded", "file"), "one of ('sharded', 'file')"),
    ("rl.tau", lambda v, c: _int(v) and v >= 0,
     ">= 0 (0 = every token of a consumed group from the current version)"),
    ("rl.episodes_per_worker", lambda v, c: _int(v) and v >= c.rl.group_size,
     ">= config.rl.group_size (a worker runs whole groups)"),
    ("rl.warmup_lengths", lambda v, c: all(
        _int(t) and 1 <= t <= _bucket(c.rl.max_len) for t in v),
     "ints in [1, the bucket of config.rl.max_len] (padded lengths of trainer batches)"),
    ("rl.gap_versions", lambda v, c: _int(v) and v >= 0,
     "an int >= 0 (0 = tau + 1: every version a consumed token may carry)"),
    ("rl.faults.env_crash_rate", lambda v, c: 0.0 <= v <= 1.0, "a probability"),
    ("rl.faults.slow_env_tail", lambda v, c: 0.0 <= v <= 1.0, "a probability"),
    ("rl.groups_per_update", between(1, _MAX_PROMPTS), _in_range(1, _MAX_PROMPTS)),
    ("rl.max_groups_in_flight", between(1, _MAX_PROMPTS), _in_range(1, _MAX_PROMPTS)),
    # Admission never lets more than max_groups_in_flight groups run or wait: fewer than one
    # update's worth and no update can ever be taken.
    ("rl.groups_per_update", lambda v, c: v <= c.rl.max_groups_in_flight,
     "<= config.rl.max_groups_in_flight (admission caps the groups running or ready at it; "
     "an update needs groups_per_update of them at once)"),
    ("rl.workers", between(1, _MAX_WORKERS), _in_range(1, _MAX_WORKERS)),
    ("rl.tool_threads", between(1, _MAX_WORKERS), _in_range(1, _MAX_WORKERS)),
    ("rl.max_turns", between(1, _MAX_TURNS), _in_range(1, _MAX_TURNS, " (assistant turns "
     "per episode)")),
    ("rl.episodes_per_worker", between(1, _MAX_PROMPTS), _in_range(1, _MAX_PROMPTS)),
    ("rl.engine_batch", between(1, _MAX_PROMPTS), _in_range(1, _MAX_PROMPTS)),
] + [(f"rl.{f}", positive, _COUNT) for f in ("updates_per_publish", "rollout_devices")]

TABLE = {"pretrain": LM, "midtrain": LM, "dsa_warmup": LM, "dsa_sparse": LM, "sft": LM,
         "rl": GRPO, "rl_async": ASYNC}


def _get(c, field: str):
  node = c
  for k in field.split("."):
    node = node[k]
  return node


def validate(c, table=None) -> None:
  """Raises ValueError naming the first field of `table` (default: the stage's) that breaks
  its rule."""
  if table is None:
    if c.stage not in TABLE:
      raise ValueError(f"config.stage={c.stage!r}: expected one of {tuple(TABLE)}")
    table = TABLE[c.stage]
  for field, ok, expected in table:
    v = _get(c, field)
    try:
      good = ok(v, c)
    except (TypeError, ValueError):
      good = False
    if not good:
      raise ValueError(f"config.{field}={v!r}: expected {expected}")
