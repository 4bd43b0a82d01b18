"""Post-training (GLM-5 §3): the batch sources of the RL stages and what they need.

Both RL loops are sources of the one training runner (glm5_jax/train/loop.py), whose
`train_step` computes their loss (train/step.py: `icepop_grpo`, `double_sided_is`, from
glm5_jax/policy_losses.py, with the policy's forward of glm5_jax/policy.py). Three levels,
imports pointing down only (tests/test_layout.py):

  orchestration/   the loops and the system around them: `grpo` (synchronous GRPO, reasoning
       |           RL), `async_loop` (fully asynchronous agentic RL, docs/agentic_rl.md) with
       |           `group_stream` (admission, worker messages, restarts) and `control` (its
       |           checkpointed counters), `rollout_worker`, `routing`, `staleness`, `ledger`,
       |           `heartbeat`, `weights` and `snapshots` (pushes; `snapshot_layout`),
       |           `backends`: `local_backend` / `ray_backend` / `distributed_backend`
       v
  envs/            what a policy acts in: `tasks/` (problems and verifiers), `rewards`,
       |           `rollout` (single-turn samples), `agent` (multi-turn episodes), `context`,
       |           `tools`, `sandbox`, `chat_session` (the interactive chat)
       v
  algorithm/       the data the method works on, independent of where it runs:
                   `trajectory` (token provenance, TITO), `groups` (failure filtering, refill,
                   advantages), `batches` (trainer batches), `consistency` (train/rollout
                   mismatch), `seeds`

`glm5_jax.rl.sandbox` re-exports `envs.sandbox`, `glm5_jax.rl.losses` `glm5_jax.policy_losses`.
"""
