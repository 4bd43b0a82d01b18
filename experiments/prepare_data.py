r"""Tokenizes a directory of text files into ArrayRecord shards (train / validation).

Files that are not text (binary, or not UTF-8) are skipped, each named on stderr and in
meta.json's `skipped`; a split left without a document is an error.

  python -m experiments.prepare_data --out=~/.cache/glm5_jax/stdlib_bytes            # the stdlib
  python -m experiments.prepare_data --src=DIR --pattern='*.txt' --tokenizer=tok.json --out=DIR
"""

import json
import os

from absl import app
from absl import flags

from glm5_jax.data import corpus

_SRC = flags.DEFINE_string("src", "", "text directory ('' = the Python standard library)")
_OUT = flags.DEFINE_string("out", "~/.cache/glm5_jax/stdlib_bytes", "output directory")
_PATTERN = flags.DEFINE_string("pattern", "*.py", "file glob, searched recursively")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "'bytes' or a tokenizer.json path")
_VAL = flags.DEFINE_float("val_fraction", 0.05, "fraction of files held out, in (0, 1)")
_SHARDS = flags.DEFINE_integer("num_shards", 4, f"shards per split, in [1, {corpus.MAX_SHARDS}]")
_MAX_FILES = flags.DEFINE_integer("max_files", 0, "the first N files (sorted); 0 = all files")


def main(argv):
  del argv
  try:
    corpus.check_split_fields(val_fraction=_VAL.value, num_shards=_SHARDS.value,
                              max_files=_MAX_FILES.value, prefix="--")
    meta = corpus.prepare(_SRC.value or corpus.default_source_dir(),
                          os.path.expanduser(_OUT.value), tokenizer=_TOKENIZER.value,
                          pattern=_PATTERN.value, val_fraction=_VAL.value,
                          num_shards=_SHARDS.value, max_files=_MAX_FILES.value)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None
  print(json.dumps(meta, indent=2))


if __name__ == "__main__":
  app.run(main)
