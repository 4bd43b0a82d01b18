"""Post-training (GLM-5 §3): the batch sources of the RL stages and what they need.

Both RL loops are sources of the one training runner (glm5_jax/train/loop.py), whose
`train_step` computes their loss (train/step.py: `icepop_grpo`, `double_sided_is`, from
glm5_jax/policy_losses.py, with the policy's forward of glm5_jax/policy.py).
Reasoning RL, synchronous: `grpo` (the source: rollouts -> rewards -> minibatches), `rollout`,
`rewards`, `tasks`, `sandbox`. Agentic RL, fully asynchronous (docs/agentic_rl.md): `async_loop`
(the trainer's source), `rollout_worker`, `agent` (multi-turn episodes), `context`, `tools`,
`trajectory`, `groups` (failure filtering, refill), `staleness`, `routing`, `ledger`,
`heartbeat`, `weights` and `snapshots` (pushes), `local_backend` / `ray_backend`;
`chat_session` (the interactive chat).
"""
