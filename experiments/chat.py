r"""Chat with a model on stdin, with tool calls (calculator, python sandbox, search).

  python -m experiments.chat --checkpoint=WORKDIR_OR_HF_DIR --tools=calculator,python
  printf '17*23?\n/reset\nhi\n' | python -m experiments.chat --checkpoint=... --temperature=0

One user message per line (`/reset` forgets the conversation, `/quit` ends); prints the
model's turns, its tool calls and their results (glm5_jax/rl/envs/chat_session.py). The
conversation is in GLM's chat format, byte-level tokens (glm5_jax/data/chat.py). A line
that is not UTF-8 is reported on stderr and skipped.

Ctrl-C (SIGINT) during a reply cancels it at the next engine step (after a compile in
progress: the first turns compile) and returns to the prompt, printing `(cancelled)`;
Ctrl-C at the prompt, or twice during one reply, exits with status 130. Model turn t
samples with seed `chat_session.turn_seed(--seed, t)`: fresh noise every turn, and the same
--seed and input replay the chat.
"""

import math
import signal
import sys

from absl import app
from absl import flags

from glm5_jax import convert
from glm5_jax.data import chat
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.rl.envs import chat_session
from glm5_jax.rl.envs import tools

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "pretraining / RL workdir or Hugging "
                                  "Face glm_moe_dsa directory", required=True)
_TOOLS = flags.DEFINE_list("tools", ["calculator", "python"], f"some of {tuple(tools.TOOLS)}")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "tokens per model turn (>= 1)")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_SEED = flags.DEFINE_integer("seed", 0, "chat seed; model turn t samples with "
                             "chat_session.turn_seed(seed, t)")
_MAX_LEN = flags.DEFINE_integer("max_len", 2048, "cache rows (the conversation's limit; >= 1, "
                                "<= the model's max_position_embeddings)")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 4, "model turns (tool rounds) per user line "
                                  "(>= 1)")
_THINKING = flags.DEFINE_boolean("thinking", False, "let the model write a reasoning block")
_SYSTEM = flags.DEFINE_string("system", None, "system message")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "'bytes' or a tokenizer.json path")

EXIT_INTERRUPTED = 130            # 128 + SIGINT, as shells report it


def _check_flags() -> None:
  """The flags that need no model, checked before it loads."""
  for flag in (_MAX_NEW, _MAX_LEN, _MAX_TURNS):
    if flag.value < 1:
      raise SystemExit(f"error: --{flag.name}={flag.value}: expected an int >= 1")
  if not 0 <= _TEMPERATURE.value < math.inf:
    raise SystemExit(f"error: --temperature={_TEMPERATURE.value}: expected a finite number "
                     ">= 0 (0 = greedy)")


def _load():
  """(engine, tokenizer, sampling) from the flags."""
  try:
    cfg, params = convert.load_model(_CHECKPOINT.value, what="--checkpoint")
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  tok = chat.get_chat_tokenizer(_TOKENIZER.value)
  if tok.vocab_size > cfg.vocab_size:
    raise SystemExit(f"error: --tokenizer={_TOKENIZER.value!r} has {tok.vocab_size} ids, the "
                     f"model's vocab_size is {cfg.vocab_size}")
  if _MAX_LEN.value > cfg.max_position_embeddings:
    raise SystemExit(f"error: --max_len={_MAX_LEN.value}: expected <= the model's "
                     f"max_position_embeddings={cfg.max_position_embeddings}")
  engine = Engine(cfg, params, max_batch=1, max_len=_MAX_LEN.value)
  sp = SamplingParams(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
                      stop_token_ids=chat.stop_ids(tok), seed=_SEED.value)
  return engine, tok, sp


def main(argv):
  del argv
  _check_flags()
  interrupts = chat_session.Interrupts()
  signal.signal(signal.SIGINT, interrupts)   # KeyboardInterrupt only where no JAX work runs
  try:
    with interrupts.deferred():              # Ctrl-C while loading: exit once loaded
      engine, tok, sp = _load()
    if interrupts.requested:
      raise KeyboardInterrupt
    chat_session.run(engine, tok, sys.stdin.buffer, sp, tools=tuple(_TOOLS.value),
                     max_turns=_MAX_TURNS.value, enable_thinking=_THINKING.value,
                     system=_SYSTEM.value, write=lambda s: print(s, flush=True),
                     interrupts=interrupts)
    interrupts.busy = True                   # teardown: later SIGINTs are only counted
  except KeyboardInterrupt:
    interrupts.busy = True
    print("(interrupted)", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
  except ValueError as e:
    interrupts.busy = True
    raise SystemExit(f"error: {e}") from None
  return 0


if __name__ == "__main__":
  app.run(main)
