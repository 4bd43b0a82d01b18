r"""Asynchronous agentic RL (GLM-5 §3): `--config=configs/rl_async.py:task=tool_calc,runlocal=True`.

  python -m experiments.rl_async --config=configs/rl_async.py:task=tool_calc,runlocal=True \
      --config.init_from=WORKDIR_OF_TOOL_SFT --workdir=/tmp/rl_async

Arguments: task=<registered task> (glm5_jax.rl.envs.tasks; the tool tasks are multi-turn),
backend=local|ray|distributed, runlocal=True shrinks the run for a laptop CPU. The paper's values where
it states them (§3: direct double-sided IS, eps 0.2 / 0.28, optimizer reset at each push);
the rest are ours. `total_steps` counts optimizer updates.
"""

import dataclasses

import ml_collections

from configs import common
from glm5_jax.rl.envs import tasks


def get_config(arg=None):
  a = common.parse_arg(arg, task="tool_calc", backend="local", runlocal=False)
  c = ml_collections.ConfigDict()
  c.stage = "rl_async"
  c.seed = 0
  c.total_steps = 200                     # optimizer updates
  c.log_every = 1
  c.keep_checkpoints = 2
  c.init_from = ""                        # SFT / pretraining workdir or HF directory
  c.tensorboard = True
  c.async_checkpoints = False
  # The trainer's mesh over the first num_devices devices; rollout replicas take the devices
  # after them (config.rl.placement).
  common.add_runtime(c, num_devices=1)

  c.optimizer = "muon_split"              # indexer frozen (train/step.py, stage 'rl_async')
  c.learning_rate = 2e-5
  c.adam_learning_rate = 0.0
  c.warmup_steps = 0
  c.final_lr_fraction = 1.0
  c.weight_decay = 0.0
  c.grad_clip = 1.0

  c.data = ml_collections.ConfigDict({"tokenizer": "bytes"})   # chat tokenizer
  c.rl = ml_collections.ConfigDict({
      "backend": a.backend,               # "local": threads; "ray": Ray actors;
                                          # "distributed": the jax.distributed cluster's
                                          # processes 1..workers (process 0 trains; every
                                          # process runs the same command)
      "ray_cpus_per_worker": 1,           # Ray actors' num_cpus
      # How backend=ray / distributed pushes weights (backends.SNAPSHOT_STORES): "sharded": each
      # process writes / reads only its own shards (rl/orchestration/snapshots.py); "file": one
      # file.
      "snapshots": "sharded",
      "task": a.task,
      "task_options": ml_collections.ConfigDict(dataclasses.asdict(tasks.get(a.task).config)),
      "group_size": 8,                    # G
      "groups_per_update": 8,             # N: groups the trainer consumes per update
      "updates_per_publish": 1,           # K: updates per weight push (optimizer reset)
      "tau": 2,                           # staleness bound in versions
      "normalize_std": False,
      "eps_low": 0.2,                     # direct double-sided IS trust band
      "eps_high": 0.28,
      "temperature": 1.0,
      "workers": 2,                       # rollout workers (data-parallel replicas)
      # Where the replicas run (glm5_jax/rl/orchestration/weights.py): "disaggregated": each on its
      # own rollout_devices devices after the trainer's (round robin when there are too few),
      # under rollout_mesh, a push a device-to-device reshard leaf by leaf; "colocated": on
      # the trainer's own mesh, serving its arrays (a push is a version bump).
      "placement": "disaggregated",
      "rollout_devices": 1,
      "rollout_mesh": ml_collections.ConfigDict({"data": -1, "fsdp": 1, "context": 1,
                                                 "expert": 1, "tensor": 1}),
      # Versions the trainer keeps (sharded like its params) to measure train/rollout
      # |dlogp| under the version that sampled each token; 0 = tau + 1 (every version a
      # consumed token may carry), fewer: tokens of older versions are counted unmeasured.
      "gap_versions": 0,
      "engine_batch": 16,                 # slots per worker engine
      "engine_shape_buckets": False,      # False: one decode shape (all slots, whole view),
                                          # compiled once; True: per-call buckets
      "episodes_per_worker": 32,          # episodes a worker runs at once
      "max_groups_in_flight": 16,         # admission's hard cap
      "route_load_bound": 1.25,           # consistent hashing with bounded loads
      "max_new_tokens": 48,               # per assistant turn (a tool_calc call needs 34-44)
      "max_len": 256,                     # engine rows per episode (its context)
      "max_turns": 4,
      "prefill_chunk": 64,
      "steps_per_sync": 8,
      "enable_thinking": False,
      "context": ml_collections.ConfigDict({"kind": "none", "k": 2, "max_tokens": 192}),
      "tool_threads": 8,
      "env": ml_collections.ConfigDict({
          "tool_timeout_s": 5.0,
          "latency_median_s": 0.0,        # simulated environment latency (log-normal)
          "latency_sigma": 1.5,
      }),
      "faults": ml_collections.ConfigDict({
          "kill_worker_after_s": 0.0,     # > 0: worker 0 is killed after this many seconds
          "env_crash_rate": 0.0,          # probability an environment step (tool call, scoring) fails
          "slow_env_tail": 0.0,           # probability a tool call outlives its timeout
      }),
      "heartbeat_s": 0.5,
      "heartbeat_timeout_s": 10.0,
      "max_wait_s": 1800.0,               # no update for this long: stop with a diagnosis
      "logprob_chunk": 256,
      "warmup_lengths": (),               # padded lengths whose trainer steps compile first,
                                          # e.g. (64, 128, 256): no stall on a new length
      "eval_every": 50,
      "eval_problems": 200,
      "checkpoint_every": 50,
  })
  common.add_rollout_precision(c.rl)

  if a.runlocal:
    c.total_steps = 20
    c.rl.group_size = 4
    c.rl.groups_per_update = 4
    c.rl.engine_batch = 16
    c.rl.episodes_per_worker = 16
    c.rl.max_groups_in_flight = 8
    c.rl.eval_every = 10
    c.rl.eval_problems = 100
    c.rl.checkpoint_every = 10
    c.rl.rollout_quant_block = 32         # FP8 blocks / INT4 groups that divide tiny's matrices
    c.peak_tflops = 0.2                   # a rough 2-core CPU figure
  return c
