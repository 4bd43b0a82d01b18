r"""Pretraining config: `--config=configs/pretrain.py:model=tiny,runlocal=True`.

Arguments (big_vision style): model=<preset>, stage=pretrain|midtrain|dsa_warmup|dsa_sparse|sft,
context=32k|128k|200k (stage=midtrain), runlocal=True shrinks the same config for a laptop CPU.
Any field can be overridden: `--config.total_steps=300 --config.mesh.fsdp=2`.

Mid-training grows the context in three stages (GLM-5 paper §2: 32K for 1T tokens, 128K for
500B, 200K for 50B), each starting from the previous stage's parameters:

  python -m experiments.pretrain \
      --config=configs/pretrain.py:model=glm5,stage=midtrain,context=32k \
      --workdir=W/midtrain_32k --config.init_from=W/pretrain
  ... context=128k --workdir=W/midtrain_128k --config.init_from=W/midtrain_32k
  ... context=200k --workdir=W/midtrain_200k --config.init_from=W/midtrain_128k

RoPE is unchanged (the paper names no base change or YaRN for the extension; the released
config keeps rope_theta 1e6, rope_type "default"). See docs/long_context.md.

`SWEEPS` (below) holds this config's sweeps, one training run per point (docs/sweeps.md):

  python -m experiments.sweep --config=configs/pretrain.py:model=tiny,runlocal=True \
      --sweep=muon_ablation --workdir=/tmp/muon_ablation
"""

import os

import ml_collections

from configs import common
from glm5_jax import config as config_lib

# context -> (seq_len, batch_size, total_steps). About 1M tokens per step, like pretraining's
# 256 x 4096 (200K: 4 x 202,752 = 0.8M, a batch that power-of-two meshes divide), and steps in
# the paper's 20 : 10 : 1 token ratio. 200K is GLM-5's max_position_embeddings, 202,752.
MIDTRAIN = {"32k": (32_768, 32, 1000), "128k": (131_072, 8, 500), "200k": (202_752, 4, 50)}
# runlocal: three growing lengths within the tiny preset's max_position_embeddings (4096), from
# pretraining's 256; 2048-4096 tokens per step.
MIDTRAIN_LOCAL = {"32k": (1024, 2, 100), "128k": (2048, 1, 100), "200k": (4096, 1, 200)}


def get_config(arg=None):
  a = common.parse_arg(arg, model="tiny", stage="pretrain", context="", runlocal=False)
  if a.context and a.stage != "midtrain":
    raise ValueError(f"config argument context={a.context!r} is for stage=midtrain, not "
                     f"stage={a.stage!r}")
  if a.stage == "midtrain":
    a.context = a.context or "32k"
    if a.context not in MIDTRAIN:
      raise ValueError(f"config argument context={a.context!r}: expected one of "
                       f"{list(MIDTRAIN)}")
  c = ml_collections.ConfigDict()
  c.model = config_lib.preset_config_dict(a.model)
  c.stage = a.stage
  c.seed = 0
  c.batch_size = 256                      # global, in sequences
  c.seq_len = 4096
  c.total_steps = 10_000
  c.log_every = 10
  c.eval_every = 500
  c.eval_batches = 8
  c.checkpoint_every = 500
  c.keep_checkpoints = 3
  c.async_checkpoints = True
  c.init_from = ""                        # a workdir or checkpoint dir: start from its params
  c.param_init = "auto"                   # auto | host | jit

  # Optimizer (Muon Split for hidden matrices, AdamW for the rest; glm5_jax/optim).
  c.optimizer = "muon_split"              # muon_split | muon (whole-matrix) | adamw
  c.learning_rate = 2e-3
  c.adam_learning_rate = 0.0              # 0 = same as learning_rate
  c.warmup_steps = 200
  c.final_lr_fraction = 0.1
  c.weight_decay = 0.1
  c.grad_clip = 1.0
  c.loss_chunk = 512                      # sequence chunk of the cross entropy
  c.bias_update_rate = 1e-3               # aux-loss-free routing-bias speed (DeepSeek-V3)
  c.tensorboard = True
  # INT4 quantization-aware training (GLM-5 §2: SFT trains the weights the INT4 model serves):
  # the forward uses dequantize(quantize(w)) of the targeted weights, straight-through
  # gradients to float32 master weights (glm5_jax/quant.py). bits: 0 (off) or 4.
  c.qat = ml_collections.ConfigDict({"bits": 0, "group_size": 32, "targets": "experts"})
  common.add_runtime(c)                   # mesh, num_devices, distributed, microbatches, ...

  c.data = ml_collections.ConfigDict({
      "dir": os.path.expanduser("~/.cache/glm5_jax/stdlib_bytes"),
      "source_dir": "",                   # "" = the Python standard library on this machine
      "tokenizer": "bytes",               # or a path to a tokenizer.json
      "pattern": "*.py",
      "sources": "",                      # stage=sft: conversation JSONL files (comma-separated globs)
      "val_fraction": 0.05,
      "num_shards": 4,
      "max_files": 0,
      "prepare_if_missing": True,
      "shard": "rows",                    # rows: same global batch for any process count
                                          # documents: disjoint reading per process
  })

  if a.stage == "midtrain":              # from the previous stage: --config.init_from=WORKDIR
    c.seq_len, c.batch_size, c.total_steps = MIDTRAIN[a.context]
    c.learning_rate = 1e-3                # the paper gives none: half of pretraining's peak
    c.warmup_steps = min(c.warmup_steps, c.total_steps // 10)
    if a.context == "200k":               # per-head keys / values of 202,752 keys do not fit
      c.model.dense_attention_form = "absorbed"   # (docs/long_context.md, train-step memory)
  if a.stage == "sft":                    # conversations: --config.data.sources=FILE.jsonl
    c.data.dir = os.path.expanduser("~/.cache/glm5_jax/sft")
    c.data.val_fraction = 0.02
    c.learning_rate = 1e-3
    c.warmup_steps = 20
  if a.stage == "dsa_warmup":
    c.learning_rate = 1e-3
    c.warmup_steps = 20
  if a.stage == "dsa_sparse":
    c.learning_rate = 7.3e-6 * 100

  if a.runlocal:
    c.batch_size = 8
    c.seq_len = 256
    c.total_steps = 100
    c.log_every = 10
    c.eval_every = 50
    c.eval_batches = 4
    c.checkpoint_every = 50
    c.warmup_steps = 10
    c.loss_chunk = 128
    c.peak_tflops = 0.2                   # a rough 2-core CPU figure
    if a.stage == "midtrain":
      c.seq_len, c.batch_size, c.total_steps = MIDTRAIN_LOCAL[a.context]
  return c


# Sweeps: name -> points, each a dict of the fields it overrides (`python -m experiments.sweep
# --sweep=NAME`; docs/sweeps.md). Meant for `model=tiny,runlocal=True`.
# The Muon Split ablation (docs/muon_split_ablation.md): 240 steps of 8 x 128 tokens, warm-up
# 20, dense attention (stage pretrain), held-out loss every 20 steps on 8 batches.
MUON_ABLATION = dict(stage="pretrain", total_steps=240, batch_size=8, seq_len=128,
                     warmup_steps=20, log_every=20, eval_every=20, eval_batches=8,
                     checkpoint_every=240)
# The main job's pretraining stage (configs/main_job.py, experiments/main_job_stages.py).
MAIN_JOB_PRETRAIN = dict(stage="pretrain", total_steps=300, batch_size=8, seq_len=256,
                         warmup_steps=20, log_every=20, eval_every=100, eval_batches=8,
                         checkpoint_every=300)
SWEEPS = {
    "lr_x_optimizer": common.product(optimizer=["muon_split", "muon", "adamw"],
                                     learning_rate=[3e-3, 1e-2, 3e-2]),
    # Each optimizer at its tuned peak learning rate (the ablation's one-seed sweep); a seed
    # sets the initialization and the batch order, the same for every optimizer.
    "muon_ablation": common.product(
        MUON_ABLATION,
        common.zip_(optimizer=["adamw", "muon", "muon_split"], learning_rate=[1e-2, 3e-2, 3e-2]),
        seed=[0, 1, 2]),
    # The main job's pretraining learning rate (docs/sweeps.md): two seeds, then two more for
    # the three best (a sweep is a list: `+` appends points).
    "main_job_lr": (common.product(MAIN_JOB_PRETRAIN, learning_rate=[1e-2, 2e-2, 3e-2, 5e-2],
                                   seed=[0, 1])
                    + common.product(MAIN_JOB_PRETRAIN, learning_rate=[1e-2, 2e-2, 3e-2],
                                     seed=[2, 3])),
}
