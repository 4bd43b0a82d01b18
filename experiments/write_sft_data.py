r"""Writes SFT conversations (JSONL, the chat schema of glm5_jax/data/chat.py) for a task.

  python -m experiments.write_sft_data --task=arith --options=max_digits=2,ops=+ \
      --n=7000 --out=/tmp/arith.jsonl
  python -m experiments.write_sft_data --task=tool_calc --n=7000 --out=/tmp/tool_calc.jsonl

Tool tasks (tool_calc, tool_search, tool_python) write multi-turn conversations: the
assistant calls the tool, the observation holds its output, the assistant answers;
`--no_tool_fraction=0.7` makes 70% of them answer directly instead, without the tool.
`--task=arith --options=ops=+ --think_fraction=0.3`: 30% of the answers come after a
column-by-column working in the reasoning block (thinking on), the rest after an empty one.
"""

import dataclasses

from absl import app
from absl import flags

from configs import common
from glm5_jax.rl.envs import tasks

_TASK = flags.DEFINE_string("task", "arith", f"one of {tasks.names() + tasks.tool_names()}")
_OPTIONS = flags.DEFINE_string("options", "", "task options, k=v,k=v (the task's Config fields)")
_N = flags.DEFINE_integer("n", 5000, "training conversations")
_SEED = flags.DEFINE_integer("seed", 0, "problem draw seed")
_OUT = flags.DEFINE_string("out", None, "output JSONL path", required=True)
_NO_TOOL = flags.DEFINE_float("no_tool_fraction", 0.0,
                              "tool tasks: fraction of conversations answered without the tool")
_THINK = flags.DEFINE_float("think_fraction", 0.0,
                            "arith with ops=+: fraction of conversations with worked reasoning")


def main(argv):
  del argv
  defaults = dataclasses.asdict(tasks.get(_TASK.value).config)
  options = common.parse_arg(_OPTIONS.value, **defaults).to_dict()
  n = tasks.get(_TASK.value, **options).write_sft(_OUT.value, _N.value, _SEED.value,
                                                      no_tool_fraction=_NO_TOOL.value,
                                                      think_fraction=_THINK.value)
  print(f"wrote {n} {_TASK.value} conversations to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
