"""Rollouts: prompts -> the engine's samples -> scored trajectories, and held-out accuracy.

The data path of one synchronous RL step (GLM-5 paper §3; the split of tunix's `rl/`
and slime's `rollout/`):

  problems --render_prompt--> prompt ids --engine.generate (G per prompt)--> response ids
  + raw log-probs (+ DSA top-k) --parse_assistant--> answer text --reward--> Trajectory

Token ids go from the engine into the Trajectory untouched (TITO); the response is decoded
only to be scored. A response that ran out of tokens (no stop token) is `truncated`, which
every reward scores 0 (its status stays `ok`: a sampled answer that earns 0 is still trained
on). A reward function that raises scores 0, is recorded as the trajectory's `error` with
status `env_error` (an environment failure: the trainer gives it no loss) and never stops the
run. Each response is one single-segment `Trajectory` (`Trajectory.from_response`), rollout
id `g{group:06d}/{j}`.
"""

from __future__ import annotations

import time

from absl import logging
import numpy as np

from glm5_jax.data import chat
from glm5_jax.inference import SamplingParams
from glm5_jax.rl.algorithm.trajectory import Trajectory
from glm5_jax.rl.envs import rewards as rewards_lib


def prompt_ids(task, problem, tokenizer, *, enable_thinking: bool) -> list[int]:
  """The generation prompt for `problem`: its SFT conversation up to the assistant's turn."""
  messages = task.sft_record(problem)["messages"]
  conv = {"messages": [m for m in messages if m["role"] != "assistant"]}
  return chat.render_prompt(conv, tokenizer, enable_thinking=enable_thinking).tolist()


def truncated(turn, finish_reason: str) -> bool:
  """No stop token: the response ran out of `max_new_tokens` or of cache rows."""
  return turn.ended_by is None or finish_reason != "stop"


def score(reward_fn, problem, response_ids, tokenizer, finish_reason: str):
  """(reward, parsed turn, error or None) of one response."""
  turn = chat.parse_assistant(response_ids, tokenizer)
  reward, err = rewards_lib.safe_call(reward_fn, problem, turn.content,
                                      truncated=truncated(turn, finish_reason))
  return reward, turn, err


def rollout(engine, task, reward_fn, problems, tokenizer, *, group_size: int,
            sampling: SamplingParams, version: int, enable_thinking: bool = False,
            record_topk: bool = True, record_routing: bool = False):
  """Samples `group_size` responses per problem and scores them.

  Returns:
    (trajectories in problem-major order, group g = problems[g]; stats dict with
    rollout_s, reward_s, reward_errors, truncated, response_len_mean).
  """
  t0 = time.perf_counter()
  prompts = [prompt_ids(task, p, tokenizer, enable_thinking=enable_thinking) for p in problems]
  requests = [p for p in prompts for _ in range(group_size)]
  # One request of n = group_size copies per prompt: the copies share the prompt's cache
  # blocks (prefilled once); copy j of group g samples stream g * group_size + j.
  ids = [rid for g, p in enumerate(prompts)
         for rid in engine.submit(p, sampling, n=group_size, stream=g * group_size,
                                  record_topk=record_topk, record_routing=record_routing)]
  outs = engine.wait(ids)
  t1 = time.perf_counter()
  trajs, n_trunc = [], 0
  for i, out in enumerate(outs):
    g = i // group_size
    reward, turn, err = score(reward_fn, problems[g], out.token_ids, tokenizer,
                              out.finish_reason)
    n_trunc += truncated(turn, out.finish_reason)
    trajs.append(Trajectory.from_response(
        requests[i], list(out.token_ids), list(out.logprobs), version,
        rollout_id=f"g{g:06d}/{i % group_size}", group_id=g,
        status="ok" if err is None else "env_error", reward=reward,
        finish_reason=out.finish_reason, topk=out.topk_indices, routing=out.routing,
        error=err))
  t2 = time.perf_counter()
  full = sum(tr.finish_reason == "cache_full" for tr in trajs)
  if full:
    logging.warning("rollout: %d responses hit the end of the cache (config.rl.max_len); "
                    "they are truncated and score 0", full)
  lens = [tr.num_loss_tokens for tr in trajs]
  return trajs, {"rollout_s": t1 - t0, "reward_s": t2 - t1,
                 "reward_errors": float(sum(tr.error is not None for tr in trajs)),
                 "truncated": float(n_trunc), "cache_full": float(full),
                 "response_len_mean": float(np.mean(lens))}


def scored_responses(engine, task, reward_fn, problems, tokenizer, sampling: SamplingParams, *,
                     samples: int = 1, enable_thinking: bool = False) -> list:
  """Each problem answered `samples` times through `engine.generate`, in calls of at most
  `engine.max_batch` requests: [(reward, parsed turn)], problem-major."""
  rows, per_call = [], max(1, engine.max_batch // samples)
  for lo in range(0, len(problems), per_call):
    chunk = problems[lo:lo + per_call]
    prompts = [prompt_ids(task, p, tokenizer, enable_thinking=enable_thinking)
               for p in chunk for _ in range(samples)]
    for i, out in enumerate(engine.generate(prompts, sampling)):
      reward, turn, _ = score(reward_fn, chunk[i // samples], out.token_ids, tokenizer,
                              out.finish_reason)
      rows.append((reward, turn))
  return rows


def heldout_accuracy(engine, task, reward_fn, problems, tokenizer, *, max_new_tokens: int,
                     enable_thinking: bool = False) -> dict:
  """Greedy decoding on `problems`: accuracy (reward == 1), mean reward, and the fraction of
  responses with a non-empty reasoning block (thinking_rate)."""
  sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                      stop_token_ids=chat.stop_ids(tokenizer))
  rows = scored_responses(engine, task, reward_fn, problems, tokenizer, sp,
                          enable_thinking=enable_thinking)
  r = np.asarray([reward for reward, _ in rows], np.float64)
  return {"accuracy": float(np.mean(r >= 1.0)), "reward_mean": float(np.mean(r)),
          "thinking_rate": float(np.mean([turn.reasoning is not None for _, turn in rows])),
          "problems": len(r)}
