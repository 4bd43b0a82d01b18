"""What the tool tasks share: the multi-turn SFT conversation of a reference solution.

  {"id", "messages": [system?, user,
                      assistant (no text, thinking off, the solution's tool calls),
                      observation (each call's real tool output, `glm5_jax.rl.envs.tools.call`),
                      assistant (the reference answer)]}

The observation is computed by running the tools, so SFT shows the model exactly what the
tools return at RL time (GLM-5, arXiv 2602.15763, section 3: SFT teaches the tool-call
format before agentic RL). Rendered by `glm5_jax/data/chat.py`, the loss covers both
assistant turns (call syntax, stop tokens, the answer), not the observation.
"""

from __future__ import annotations

from glm5_jax.rl.envs import tools
from glm5_jax.rl.envs.tasks import problem as problem_lib


def sft_record(problem, calls: list[dict], *, allowed, system: str | None = None,
               results: list[str] | None = None) -> dict:
  """The conversation above for `problem` solved by `calls` ([{"name", "arguments"}]).

  results: the calls' outputs when the task knows them without running the tools (its own
  trusted programs: tool_python); default: run them.
  """
  if results is None:
    ran = [tools.call(c["name"], c["arguments"], allowed=allowed) for c in calls]
    bad = [r for r in ran if r.status != "ok"]
    if bad:
      raise ValueError(f"problem {problem.id!r}: a reference tool call failed: {bad[0]}")
    results = [r.text for r in ran]
  return {"id": problem.id, "messages": problem_lib.prompt_messages(problem, system=system) + [
      {"role": "assistant", "content": "", "reasoning": None, "tool_calls": calls},
      {"role": "observation", "content": list(results)},
      {"role": "assistant", "content": problem.answer, "reasoning": None}]}
