"""Post-training (GLM-5 §3).

Reasoning RL, synchronous: `grpo` (the loop), `rollout`, `policy`, `losses`, `rewards`,
`tasks`, `sandbox`. Agentic RL, fully asynchronous (docs/agentic_rl.md): `async_loop` (the
trainer), `rollout_worker`, `agent` (multi-turn episodes), `context`, `tools`, `trajectory`,
`groups` (failure filtering, refill), `staleness`, `routing`, `ledger`, `heartbeat`, `weights`,
`local_backend` / `ray_backend`; `chat_session` (the interactive chat).
"""
