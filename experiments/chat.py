r"""Chat with a model on stdin, with tool calls (calculator, python sandbox, search).

  python -m experiments.chat --checkpoint=WORKDIR_OR_HF_DIR --tools=calculator,python
  printf '17*23?\n/reset\nhi\n' | python -m experiments.chat --checkpoint=... --temperature=0

One user message per line (`/reset` forgets the conversation, `/quit` ends); prints the
model's turns, its tool calls and their results (glm5_jax/rl/chat_session.py). The
conversation is in GLM's chat format, byte-level tokens (glm5_jax/data/chat.py).
"""

import sys

from absl import app
from absl import flags

from glm5_jax.data import chat
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.rl import chat_session
from glm5_jax.rl import tools
from glm5_jax.train import checkpoint as train_checkpoint

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "pretraining / RL workdir or Hugging "
                                  "Face glm_moe_dsa directory", required=True)
_TOOLS = flags.DEFINE_list("tools", ["calculator", "python"], f"some of {tuple(tools.TOOLS)}")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "tokens per model turn")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_MAX_LEN = flags.DEFINE_integer("max_len", 2048, "cache rows (the conversation's limit)")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 4, "model turns (tool rounds) per user line")
_THINKING = flags.DEFINE_boolean("thinking", False, "let the model write a reasoning block")
_SYSTEM = flags.DEFINE_string("system", None, "system message")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "'bytes' or a tokenizer.json path")


def main(argv):
  del argv
  try:
    cfg, params = train_checkpoint.load_model(_CHECKPOINT.value, what="--checkpoint")
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  tok = chat.get_chat_tokenizer(_TOKENIZER.value)
  if tok.vocab_size > cfg.vocab_size:
    raise SystemExit(f"error: --tokenizer={_TOKENIZER.value!r} has {tok.vocab_size} ids, the "
                     f"model's vocab_size is {cfg.vocab_size}")
  engine = Engine(cfg, params, max_batch=1, max_len=_MAX_LEN.value)
  sp = SamplingParams(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
                      stop_token_ids=chat.stop_ids(tok), seed=_SEED.value)
  try:
    chat_session.run(engine, tok, sys.stdin, sp, tools=tuple(_TOOLS.value),
                     max_turns=_MAX_TURNS.value, enable_thinking=_THINKING.value,
                     system=_SYSTEM.value, write=lambda s: print(s, flush=True))
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
  app.run(main)
