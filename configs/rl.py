r"""Reasoning RL (synchronous GRPO + IcePop): `--config=configs/rl.py:task=arith,runlocal=True`.

  python -m experiments.rl --config=configs/rl.py:task=arith,runlocal=True \
      --config.init_from=WORKDIR_OF_SFT --workdir=/tmp/rl

Arguments: task=<registered task> (glm5_jax.rl.envs.tasks), runlocal=True shrinks the run for a
laptop CPU. The GLM-5 paper's values where it states them (§3: G = 32, IcePop beta = 2,
eps 0.2 / 0.28, no std normalization as slime's GLM-5 gate); the rest are ours.
"""

import dataclasses

import ml_collections

from configs import common
from glm5_jax.rl.envs import tasks


def get_config(arg=None):
  a = common.parse_arg(arg, task="arith", runlocal=False)
  c = ml_collections.ConfigDict()
  c.stage = "rl"
  c.seed = 0
  c.total_steps = 200
  c.log_every = 1
  c.keep_checkpoints = 2
  c.init_from = ""                        # SFT / pretraining workdir or HF directory
  c.tensorboard = True
  c.async_checkpoints = False
  # The trainer's mesh (data, fsdp, context, expert, tensor) over the first num_devices
  # devices, as pretraining's; the rollout engine serves from the trainer's own arrays on the
  # same mesh (colocated: generation and training alternate, a push is a version bump).
  common.add_runtime(c)

  # Optimizer: Muon Split, indexer frozen (train/step.py STAGE_TABLE["rl"]), constant LR.
  c.optimizer = "muon_split"
  c.learning_rate = 1e-4
  c.adam_learning_rate = 0.0
  c.warmup_steps = 0
  c.final_lr_fraction = 1.0
  c.weight_decay = 0.0
  c.grad_clip = 1.0

  c.data = ml_collections.ConfigDict({"tokenizer": "bytes"})   # chat tokenizer
  c.rl = ml_collections.ConfigDict({
      "task": a.task,
      # The task's difficulty knobs (its Config fields), e.g. --config.rl.task_options.max_digits=3
      "task_options": ml_collections.ConfigDict(dataclasses.asdict(tasks.get(a.task).config)),
      "reward": "",                       # "" = the task's own reward
      "group_size": 32,                   # G
      "prompts_per_step": 16,
      "minibatches": 2,                   # updates per rollout batch (>= 2: the clip acts)
      "temperature": 1.0,
      "max_new_tokens": 64,
      "max_len": 256,                     # engine cache rows per request
      "prefill_chunk": 128,
      "steps_per_sync": 8,
      "enable_thinking": False,           # template writes an empty reasoning block
      "icepop": True,                     # False: plain GRPO-clip (the mismatch-correction ablation)
      "icepop_beta": 2.0,
      "eps_low": 0.2,
      "eps_high": 0.28,
      "normalize_std": False,
      "logprob_chunk": 256,
      "eval_every": 50,
      "eval_problems": 500,
      "checkpoint_every": 50,
  })
  common.add_rollout_precision(c.rl)
  # On-policy distillation (GLM-5 §3): advantage += coef * sg(log pi_teacher - log pi).
  c.distill = ml_collections.ConfigDict({"teacher": "", "coef": 1.0, "task_advantage": True})

  if a.runlocal:
    c.total_steps = 40
    c.rl.group_size = 8
    c.rl.prompts_per_step = 8
    c.rl.max_new_tokens = 16
    c.rl.max_len = 96
    c.rl.prefill_chunk = 64
    c.rl.eval_every = 20
    c.rl.eval_problems = 500
    c.rl.checkpoint_every = 20
    c.rl.rollout_quant_block = 32         # FP8 blocks / INT4 groups that divide tiny's matrices
    c.learning_rate = 3e-4
    c.peak_tflops = 0.2                   # a rough 2-core CPU figure
  return c
