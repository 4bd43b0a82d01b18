r"""Long-context evaluation of a workdir, optionally against others (before / after mid-training).

  python -m experiments.eval_long_context --workdir=/tmp/lc/midtrain \
      --compare_workdir=/tmp/lc/pretrain

Prints held-out loss by position bucket, the loss of each document's last tokens by window
length, and passkey exact match by (length, depth)
(glm5_jax/evals/long_context.py), and writes long_context.json and long_context.png to --out
(default: --workdir).
"""

import json
import os

from absl import app
from absl import flags

from experiments import long_context_report as report
from glm5_jax import convert
from glm5_jax.evals import long_context
from glm5_jax.train import checkpoint

_WORKDIR = flags.DEFINE_string("workdir", None, "the model to evaluate (a training workdir)",
                               required=True)
_COMPARE = flags.DEFINE_list("compare_workdir", [],
                             "baseline workdirs, shown first (comma-separated)")
_LABEL = flags.DEFINE_string("label", "", "name of --workdir in tables ('' = its basename)")
_COMPARE_LABEL = flags.DEFINE_list("compare_label", [],
                                   "names of --compare_workdir ('' = their basenames)")
_DATA_DIR = flags.DEFINE_string("data_dir", "~/.cache/glm5_jax/stdlib_bytes",
                                "prepared corpus: validation documents and passkey filler")
_BUCKETS = flags.DEFINE_list("buckets", [str(b) for b in long_context.BUCKETS],
                             "position bucket edges")
_WINDOWS = flags.DEFINE_list("windows", [str(w) for w in long_context.WINDOWS],
                             "window lengths for the loss of each document's last tokens")
_TARGET_LEN = flags.DEFINE_integer("target_len", 128, "the last tokens scored by window")
_LENGTHS = flags.DEFINE_list("lengths", [str(x) for x in long_context.LENGTHS],
                             "passkey document lengths")
_DEPTHS = flags.DEFINE_list("depths", [str(d) for d in long_context.DEPTHS],
                            "passkey depths (fractions of the filler)")
_PER_CELL = flags.DEFINE_integer("per_cell", 20, "passkey documents per (length, depth)")
_MAX_DOCS = flags.DEFINE_integer("max_docs", 0, "held-out documents (0 = all long enough)")
_ATTENTION = flags.DEFINE_enum("attention", "dense", ["dense", "sparse"],
                               "attention of the evaluated models (dense before DSA)")
_BATCH_TOKENS = flags.DEFINE_integer("batch_tokens", 8192, "tokens per forward batch")
_SEED = flags.DEFINE_integer("seed", 0, "passkey stream seed")
_OUT = flags.DEFINE_string("out", "", "output directory ('' = --workdir)")


def _evaluate(workdir: str) -> dict:
  cfg, params = convert.load_model(workdir)
  return long_context.evaluate(
      cfg.replace(attention_type=_ATTENTION.value), params, os.path.expanduser(_DATA_DIR.value),
      edges=[int(b) for b in _BUCKETS.value], windows=[int(w) for w in _WINDOWS.value],
      target_len=_TARGET_LEN.value, lengths=[int(x) for x in _LENGTHS.value],
      depths=[float(d) for d in _DEPTHS.value], per_cell=_PER_CELL.value,
      max_docs=_MAX_DOCS.value, seed=_SEED.value, batch_tokens=_BATCH_TOKENS.value)


def main(argv):
  del argv
  checkpoint.quiet_orbax()
  workdirs = [*_COMPARE.value, _WORKDIR.value]
  labels = [*_COMPARE_LABEL.value, _LABEL.value] if _COMPARE_LABEL.value else (
      [""] * len(_COMPARE.value) + [_LABEL.value])
  if len(labels) != len(workdirs):
    raise ValueError(f"--compare_label={_COMPARE_LABEL.value}: expected one label per "
                     f"--compare_workdir ({len(_COMPARE.value)})")
  runs = [(lb or os.path.basename(os.path.normpath(wd)), wd) for lb, wd in zip(labels, workdirs)]
  if len({name for name, _ in runs}) < len(runs):
    raise ValueError(f"labels must differ (--label, --compare_label), got {[n for n, _ in runs]}")
  results = {name: {"workdir": os.path.abspath(wd), **_evaluate(wd)} for name, wd in runs}
  out = _OUT.value or _WORKDIR.value
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "long_context.json"), "w") as f:
    json.dump(results, f, indent=2)
  report.plot(results, os.path.join(out, "long_context.png"))
  print(report.format_tables(results))
  print(f"wrote {os.path.join(out, 'long_context.json')} and long_context.png")


if __name__ == "__main__":
  app.run(main)
