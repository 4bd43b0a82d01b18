"""A rollout worker of asynchronous agentic RL: one engine, many multi-turn episodes in flight.

The same class runs under both backends of `async_loop` (a thread with `queue.Queue`s and
in-process weights, or a Ray actor with Ray queues and file snapshots): it only sees

  inbox    group requests {"group_id", "prompt_index", "problem", "group_size", "seed"}
  outbox   ("beat", worker_id, epoch, info) every `heartbeat_s`, ("group", worker_id, epoch,
           result) when all G episodes of a group have ended, ("error", worker_id, epoch,
           traceback) if the worker itself fails
  weights  `version()` / `latest()`: before every engine step, a newer version is swapped
           into the engine (`Engine.update_params`, no recompilation: leaf by leaf, device to
           device from the trainer's published arrays, or from a snapshot read from disk);
           running turns continue under it and every token records the version that sampled
           it (GLM-5 §3: rollouts never wait for the trainer)

An `agent.Driver` steps the engine while tool calls run in a thread pool, so a slow
environment stalls only its own episode. Each episode holds one engine session (its turns
reuse the cached conversation); a context rewrite opens a new session (a new segment).
Environment faults are injected here by config (`faults.env_crash_rate`: an environment
step fails: its setup, a tool call or the answer's scoring; `faults.slow_env_tail`: a tool call outlives its timeout) and the simulated environment latency of the benchmark
(`env.latency_median_s`, `env.latency_sigma`: log-normal) is slept in the tool thread.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import traceback

import jax
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import memory
from glm5_jax import sharding as shd
from glm5_jax.data import chat
from glm5_jax.inference import Engine
from glm5_jax.inference import precision
from glm5_jax.inference.engine import serving_template
from glm5_jax.rl.algorithm.seeds import seed_of
from glm5_jax.rl.envs import agent as agent_lib
from glm5_jax.rl.envs import context as context_lib
from glm5_jax.rl.envs import tasks as tasks_lib
from glm5_jax.rl.envs import tools as tools_lib


class ToolRunner:
  """Runs one turn's tool calls (in a pool thread), with the configured latency and faults."""

  def __init__(self, r: dict, seed: int):
    self.r = r
    self._rng = np.random.default_rng(seed)

  def _draw(self):
    # One draw per call, made under the GIL on the caller's thread (deterministic order).
    f, env = self.r["faults"], self.r["env"]
    latency = 0.0
    if env["latency_median_s"] > 0:
      latency = float(env["latency_median_s"] * np.exp(env["latency_sigma"]
                                                       * self._rng.standard_normal()))
    crash = self._rng.random() < f["env_crash_rate"]
    slow = self._rng.random() < f["slow_env_tail"]
    return latency, crash, slow

  def submit(self, pool, calls, allowed=None):
    """Runs `calls` in `pool` (a future of their ToolResults); `allowed`: the episode's
    tools (a call to another one is the model's error, told in the result)."""
    draws = [self._draw() for _ in calls]
    return pool.submit(self._run, calls, draws, allowed)

  def _run(self, calls, draws, allowed):
    out = []
    timeout = self.r["env"]["tool_timeout_s"]
    for call, (latency, crash, slow) in zip(calls, draws):
      if slow:
        latency = max(latency, timeout * 1.5)
      if latency > timeout:                    # the environment would not answer in time
        time.sleep(timeout)
        out.append(tools_lib.ToolResult(f"tool {call.name!r} timed out after {timeout}s",
                                        "timeout"))
        continue
      time.sleep(latency)
      if crash:
        out.append(tools_lib.ToolResult(f"tool {call.name!r}: environment crashed (injected)",
                                        "env_error"))
        continue
      out.append(tools_lib.call(call.name, call.arguments, allowed=allowed))
    return out


class InjectedCrash(RuntimeError):
  """An environment failure injected by `faults.env_crash_rate`."""


def crashing_task(task, rate: float, rng):
  """`task` whose answer checking (the environment's last step) raises with probability
  `rate`: the episode ends "env_error", as when a real environment dies while scoring."""
  if rate <= 0:
    return task
  def check(problem, response):
    if rng.random() < rate:
      raise InjectedCrash("environment crashed while scoring (faults.env_crash_rate)")
    return task.check(problem, response)
  return dataclasses.replace(task, check=check)


def maybe_crash_setup(ep, rate: float, rng):
  """With probability `rate` the episode's environment fails to start ("env_error")."""
  if rate > 0 and rng.random() < rate:
    ep.fail("env_error", "environment setup crashed (faults.env_crash_rate)")
  return ep


def replica_mesh(devices=None, mesh_axes=None):
  """A replica's mesh over `devices` (a list; None: no mesh, the first device) with the axes
  `mesh_axes` (config.rl.rollout_mesh; default all devices over `data`)."""
  return None if devices is None else shd.make_mesh(dict(mesh_axes or {"data": -1}), devices)


def build_engine(cfg, params, r: dict, version: int, mesh=None, rules=None, *,
                 rollout: bool = True) -> Engine:
  """A worker's engine on `mesh` (`replica_mesh`) in the model's serving shardings; a rollout
  engine (`rollout`) serves in the config's rollout precision (inference/precision.py) and
  records each token's routed experts, an evaluation engine serves the weights as they are."""
  kw = {}
  if rollout:
    kw = dict(precision.engine_kwargs(r),
              record_routing=any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)))
  return Engine(cfg, params, max_batch=r["engine_batch"], max_len=r["max_len"],
                prefill_chunk=r["prefill_chunk"], steps_per_sync=r["steps_per_sync"],
                version=version, mesh=mesh, rules=rules,
                shape_buckets=r["engine_shape_buckets"], **kw)


def make_episode(task, problem, tok, r: dict, *, rollout_id: str, group_id: str,
                 prompt_index: int):
  return agent_lib.Episode(
      task, problem, tok, rollout_id=rollout_id, group_id=group_id, prompt_index=prompt_index,
      max_turns=r["max_turns"], max_len=r["max_len"],
      context=context_lib.ContextPolicy(**r["context"]),
      enable_thinking=r["enable_thinking"])


class RolloutWorker:
  """See the module docstring. `spec`: picklable {"worker_id", "epoch", "devices" (indices
  into jax.devices(), or None: the first `rl.rollout_devices` of this process's own devices),
  "mesh" (the replica's mesh axes), "rules" (logical-axis rules or None), "model_config"
  (dict), "rl" (the config's `rl` as a dict), "tokenizer", "seed"}.

  A heartbeat thread beats every `rl.heartbeat_s` while `run` is alive (also through long
  compilations); it stops with the loop, so a killed worker falls silent."""

  def __init__(self, spec: dict):
    self.spec = spec
    self.worker_id, self.epoch = spec["worker_id"], spec["epoch"]
    self.info: dict = {"version": -1}

  def run(self, inbox, outbox, weights, should_stop) -> None:
    done = threading.Event()
    stopped = lambda: done.is_set() or should_stop()

    def beat():
      while not stopped():
        outbox.put(("beat", self.worker_id, self.epoch, dict(self.info)))
        done.wait(self.spec["rl"]["heartbeat_s"])

    beats = threading.Thread(target=beat, daemon=True, name=f"beat-{self.worker_id}")
    beats.start()
    try:
      self._run(inbox, outbox, weights, stopped)
    except Exception:  # pylint: disable=broad-except
      outbox.put(("error", self.worker_id, self.epoch, traceback.format_exc()))
    finally:
      done.set()
      beats.join()

  def _run(self, inbox, outbox, weights, should_stop):
    spec, r = self.spec, self.spec["rl"]
    cfg = config_lib.ModelConfig(**spec["model_config"])
    task = tasks_lib.from_config(r)
    tok = chat.get_chat_tokenizer(spec["tokenizer"])
    devices = (jax.local_devices()[:r["rollout_devices"]] if spec["devices"] is None
               else [jax.devices()[i] for i in spec["devices"]])
    mesh = replica_mesh(devices, spec["mesh"])
    # Each pull reads straight into the serving shardings (a sharded snapshot: only the
    # slices this process's devices hold); the engine then serves the arrays as they are.
    template = serving_template(cfg, mesh, spec["rules"])
    while weights.version() < 0:                # nothing published yet
      if should_stop():
        return
      time.sleep(0.01)
    version, params = weights.latest(template)
    engine = build_engine(cfg, params, r, version, mesh, spec["rules"])
    del params
    runner = ToolRunner(r, seed_of(spec["seed"], self.worker_id, self.epoch))
    crash_rate = r["faults"]["env_crash_rate"]
    crash_rng = np.random.default_rng(seed_of(spec["seed"], self.worker_id, self.epoch, 1))
    task = crashing_task(task, crash_rate, crash_rng)
    driver = agent_lib.Driver(engine, tok, tools=runner, threads=r["tool_threads"],
                              max_new_tokens=r["max_new_tokens"], temperature=r["temperature"],
                              record_routing=engine.record_routing)
    pull = dict(getattr(weights, "last_pull", {}))   # what the latest pull read
    self.info = {"version": engine.version, **driver.stats, **pull}
    groups: dict = {}                            # group_id -> (request, ended episodes)
    try:
      while not should_stop():
        while driver.in_flight + r["group_size"] <= r["episodes_per_worker"]:
          try:
            req = inbox.get(timeout=0.0 if driver.in_flight else 0.02)
          except queue.Empty:
            break
          groups[req["group_id"]] = (req, [])
          for j in range(req["group_size"]):
            ep = make_episode(task, req["problem"], tok, r, rollout_id=f"{req['group_id']}/{j}",
                              group_id=req["group_id"], prompt_index=req["prompt_index"])
            driver.add(maybe_crash_setup(ep, crash_rate, crash_rng), req["seed"])
        # After taking work: the trainer publishes a version before admitting the groups
        # meant for it, so a group never starts on the weights before.
        if weights.version() > engine.version:
          if hasattr(weights, "last_pull"):           # a store read from another process
            with memory.Peak() as peak:              # this process: read + swap
              engine.update_params(*reversed(weights.latest(template)))
            pull = dict(weights.last_pull, pull_rss_growth_bytes=peak.growth)
            self.info = {"version": engine.version, **driver.stats, **pull}   # next beat
          else:
            engine.update_params(*reversed(weights.latest(template)))
        if not driver.in_flight:
          continue
        t_busy = time.monotonic()
        for ep in driver.poll():
          req, done = groups[ep.group_id]
          done.append(ep)
          if len(done) == req["group_size"]:
            del groups[ep.group_id]
            done.sort(key=lambda e: int(e.rollout_id.rsplit("/", 1)[1]))
            outbox.put(("group", self.worker_id, self.epoch, {
                "group_id": req["group_id"], "prompt_index": req["prompt_index"],
                "rollouts": [e.trajectories() for e in done]}))
        driver.stats["busy_s"] = driver.stats.get("busy_s", 0.0) + time.monotonic() - t_busy
        self.info = {"version": engine.version, **driver.stats, **pull}
        if not engine.num_unfinished and driver.in_flight:
          time.sleep(0.001)                      # only tools running: do not spin
    finally:
      driver.close()
