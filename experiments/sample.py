r"""Samples a continuation of a prompt with the KV-cached inference engine.

  python -m experiments.sample --checkpoint=/path/to/hf_dir --prompt="Hello" --max_new_tokens=64
  python -m experiments.sample --preset=tiny --prompt="Hello" --speculative   # random weights

--checkpoint is a Hugging Face `glm_moe_dsa` directory (config.json +
safetensors, read by glm5_jax.hf.load_pretrained) or a pretraining workdir
(orbax checkpoints, its latest step). Without --checkpoint, --preset builds
random weights (smoke runs).
The prompt is tokenized byte-level (one id per UTF-8 byte; the tiny preset's vocabulary
holds the bytes and GLM's special tokens); --prompt_ids passes token ids directly for any
vocabulary. Prints the continuation (byte-level prompts: decoded, special tokens by name) and
tokens/s.
"""


from absl import app
from absl import flags

from glm5_jax import config as config_lib
from glm5_jax import convert
from glm5_jax import nn as gnn
from glm5_jax.data import tokenizers
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams

_CHECKPOINT = flags.DEFINE_string("checkpoint", None,
                                  "Hugging Face glm_moe_dsa directory or pretraining workdir")
_PRESET = flags.DEFINE_string("preset", "tiny", "random-weight preset when no --checkpoint")
_PROMPT = flags.DEFINE_string("prompt", "Hello", "prompt text (byte-level tokens)")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "prompt token ids (overrides --prompt)")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus mass")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_MAX_LEN = flags.DEFINE_integer("max_len", 1024, "cache rows")
_SPECULATIVE = flags.DEFINE_boolean("speculative", False, "MTP speculative decoding")


def load(checkpoint, preset):
  """(cfg, params) from an HF directory or a pretraining workdir, or random weights."""
  if checkpoint is None:
    cfg = config_lib.get_preset(preset)
    return cfg, gnn.init_params(cfg, 0)
  return convert.load_model(checkpoint, what="checkpoint")


def parse_prompt_ids(values: list[str]) -> list[int]:
  """--prompt_ids as ints; a ValueError names the first entry that is not an integer >= 0."""
  ids = []
  for i, v in enumerate(values):
    try:
      ids.append(int(v))
    except ValueError:
      ids.append(-1)
    if ids[-1] < 0:
      raise ValueError(f"--prompt_ids[{i}]={v!r}: expected an integer >= 0 (a token id)")
  return ids


def main(argv):
  del argv
  try:
    prompt = parse_prompt_ids(_PROMPT_IDS.value) if _PROMPT_IDS.value else None
    sp = SamplingParams(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
                        top_k=_TOP_K.value, top_p=_TOP_P.value, seed=_SEED.value)
    cfg, params = load(_CHECKPOINT.value, _PRESET.value)
    if prompt is None:
      if cfg.vocab_size < 256:
        raise ValueError(f"byte-level --prompt needs vocab_size >= 256 (got "
                         f"{cfg.vocab_size}); pass --prompt_ids")
      prompt = list(_PROMPT.value.encode("utf-8"))
    engine = Engine(cfg, params, max_batch=1, max_len=_MAX_LEN.value,
                    speculative=_SPECULATIVE.value)
    out = engine.generate([prompt], sp)[0]
  except (FileNotFoundError, ValueError) as e:  # a bad flag, a missing or corrupt checkpoint
    raise SystemExit(f"error: {e}") from None
  stats = engine.last_stats
  if not _PROMPT_IDS.value:
    print(tokenizers.ByteTokenizer().decode(out.token_ids, skip_special_tokens=False))
  print("token_ids:", out.token_ids)
  print(f"finish_reason={out.finish_reason} generated={len(out.token_ids)} "
        f"prefill={stats['prefill_s']:.2f}s decode={stats['decode_s']:.2f}s "
        f"(includes compilation on the first call) "
        f"tokens/s={len(out.token_ids) / (stats['prefill_s'] + stats['decode_s']):.1f}")
  if _SPECULATIVE.value:
    print(f"speculative: {out.num_rounds} verify rounds, {out.num_accepted} drafts accepted, "
          f"mean acceptance length {out.acceptance_length:.2f} tokens/round")


if __name__ == "__main__":
  app.run(main)
