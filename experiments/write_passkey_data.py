r"""A corpus directory with passkey documents mixed into its train split (data/passkey.py).

  python -m experiments.write_passkey_data --data_dir=~/.cache/glm5_jax/stdlib_bytes \
      --out=/tmp/lc/data_passkey --length=4096 --fraction=0.3
  python -m experiments.pretrain --config=configs/pretrain.py:stage=midtrain,... \
      --config.data.dir=/tmp/lc/data_passkey

--length should be the training seq_len: each passkey document is then one whole row.
"""

import json
import os

from absl import app
from absl import flags

from glm5_jax.data import passkey

_DATA_DIR = flags.DEFINE_string("data_dir", "~/.cache/glm5_jax/stdlib_bytes",
                                "prepared corpus (linked, not copied)")
_OUT = flags.DEFINE_string("out", None, "output corpus directory", required=True)
_LENGTH = flags.DEFINE_integer("length", 4096, "tokens per passkey document (= seq_len)")
_FRACTION = flags.DEFINE_float("fraction", 0.3, "passkey share of the train tokens")
_SEED = flags.DEFINE_integer("seed", 0, "train passkey stream seed")


def main(argv):
  del argv
  meta = passkey.write_mixed_corpus(os.path.expanduser(_DATA_DIR.value),
                                    os.path.expanduser(_OUT.value), length=_LENGTH.value,
                                    fraction=_FRACTION.value, seed=_SEED.value)
  print(json.dumps(meta["passkey"], indent=2))


if __name__ == "__main__":
  app.run(main)
