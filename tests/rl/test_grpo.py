"""The synchronous GRPO loop on the tiny model: train/rollout consistency, resume, bad input."""

import json
import os

import numpy as np
import pytest

from configs import rl as rl_config
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import orbax_io
from glm5_jax.rl.envs import rewards as rewards_lib
from glm5_jax.rl.orchestration import grpo


@pytest.fixture(scope="module")
def init_workdir(tmp_path_factory):
  cfg = config_lib.get_preset("tiny")
  return orbax_io.save_params(str(tmp_path_factory.mktemp("init")), cfg, gnn.init_params(cfg, 0))


def _config(init_from, **rl):
  c = rl_config.get_config("task=arith,runlocal=True")
  c.init_from = init_from
  c.total_steps = 2
  c.tensorboard = False
  c.rl.task_options.max_digits = 2
  c.rl.update(dict(group_size=4, prompts_per_step=2, minibatches=2, max_new_tokens=6,
                   max_len=48, prefill_chunk=32, eval_problems=8, eval_every=2,
                   checkpoint_every=1), **rl)
  return c


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_grpo_steps_match_the_engine_and_checkpoint(init_workdir, tmp_path):
  wd = str(tmp_path / "rl")
  c = _config(init_workdir)
  c.optimizer = "adamw"        # compiles faster; Muon Split runs in the slow tests below
  last = grpo.run(c, wd)
  rows = [m for m in _metrics(wd) if "loss" in m]
  assert [m["step"] for m in rows] == [1, 2]
  for m in rows:
    # The engine and the trainer run one forward: equal log-probs, identical top-k sets.
    assert m["logp_abs_diff_max"] == 0.0, m          # bitwise: batch-invariant engine
    assert m["topk_mismatches"] == 0 and m["topk_positions"] > 0, m
    assert m["icepop_masked_frac"] == 0.0
    assert np.isfinite(m["loss"]) and m["tokens"] > 0
  assert [m["step"] for m in _metrics(wd) if "heldout_accuracy" in m] == [0, 2]
  assert last["heldout_problems"] == 8
  assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["1", "2"]
  # Run again in the same workdir: it finds step 2 and has nothing left to do.
  grpo.run(c, wd)
  assert [m["step"] for m in _metrics(wd) if "loss" in m] == [1, 2]


@pytest.mark.slow
def test_grpo_with_fp8_rollouts_measures_the_gap_and_routing_replay_closes_routing(
    init_workdir, tmp_path):
  rows = {}
  for name, rl in (("fp8", dict(rollout_weight_dtype="float8_e4m3fn")),
                   ("fp8_r3", dict(rollout_weight_dtype="float8_e4m3fn", routing_replay=True))):
    c = _config(init_workdir, **rl)
    c.optimizer = "adamw"
    grpo.run(c, str(tmp_path / name))
    rows[name] = [m for m in _metrics(str(tmp_path / name)) if "loss" in m]
  for m in rows["fp8"] + rows["fp8_r3"]:
    assert m["logp_abs_diff_max"] > 0 and m["routing_pairs"] > 0 and m["topk_positions"] > 0
    for k in ("logp_abs_diff_mean", "icepop_masked_frac", "topk_mismatch_rate",
              "routing_mismatch_rate", "routing_bytes_per_token"):
      assert k in m, k
  assert sum(m["routing_mismatches"] for m in rows["fp8"]) > 0
  assert all(m["routing_mismatches"] == 0 for m in rows["fp8_r3"])


def test_teacher_of_another_model_shape_is_refused(init_workdir, tmp_path):
  cfg = config_lib.get_preset("tiny", hidden_size=32)
  other = orbax_io.save_params(str(tmp_path / "other"), cfg, gnn.init_params(cfg, 1))
  c = _config(init_workdir)
  c.distill.teacher = other
  with pytest.raises(ValueError, match="config.distill.teacher"):
    grpo.run(c, str(tmp_path / "rl"))


@pytest.mark.parametrize("field,value,match", [
    ("task", "chess", "unknown"),
    ("group_size", 1, "group_size"),
    ("minibatches", 3, "minibatches"),
])
def test_bad_rl_config_is_named(init_workdir, tmp_path, field, value, match):
  c = _config(init_workdir)
  c.rl[field] = value
  with pytest.raises(ValueError, match=match):
    grpo.run(c, str(tmp_path / "rl"))


def test_missing_init_from_is_named(tmp_path):
  with pytest.raises(ValueError, match="config.init_from"):
    grpo.run(_config(""), str(tmp_path / "rl"))
  with pytest.raises(ValueError, match="config.init_from"):
    grpo.run(_config(str(tmp_path / "nowhere")), str(tmp_path / "rl"))


@pytest.mark.slow
def test_killed_and_restarted_run_reproduces_the_uninterrupted_metrics(init_workdir, tmp_path,
                                                                        monkeypatch):
  full, split = str(tmp_path / "full"), str(tmp_path / "split")
  c = _config(init_workdir, eval_every=1, checkpoint_every=2)
  c.total_steps = 4
  # A random model never answers arith: a dense reward (the fraction of digits in the
  # response) gives non-zero advantages, so the resumed optimizer state matters.
  monkeypatch.setitem(rewards_lib._REWARDS, "arith", lambda problem, response, *, truncated:
                      sum(ch.isdigit() for ch in response) / max(len(response), 1))
  grpo.run(c, full)
  assert any(m.get("update_norm", 0.0) > 0 for m in _metrics(full))
  # Killed during step 4: step 3's metrics are written, its checkpoint is not (every 2).
  real_batches = grpo.GRPO.batches

  def dies_at_step_4(self, state, step):
    if step == 3:
      raise KeyboardInterrupt("killed")
    return real_batches(self, state, step)
  monkeypatch.setattr(grpo.GRPO, "batches", dies_at_step_4)
  with pytest.raises(KeyboardInterrupt):
    grpo.run(c, split)
  assert max(m["step"] for m in _metrics(split)) == 3
  monkeypatch.setattr(grpo.GRPO, "batches", real_batches)
  grpo.run(c, split)                        # resumes from the checkpoint of step 2
  timing = ("_s", "est_mfu")
  strip = lambda rows: [{k: v for k, v in m.items() if not k.endswith(timing)} for m in rows]
  assert strip(_metrics(split)) == strip(_metrics(full))


@pytest.mark.slow
def test_distilling_from_itself_gives_zero_opd_advantages(init_workdir, tmp_path):
  # The teacher is the policy's own starting point: log pi_T - log pi = 0 on every token at
  # the first step, so with the task advantage off the first update has zero gradient.
  c = _config(init_workdir)
  c.total_steps = 1
  c.distill.teacher = init_workdir
  c.distill.task_advantage = False
  grpo.run(c, str(tmp_path / "opd"))
  m = [m for m in _metrics(str(tmp_path / "opd")) if "loss" in m][0]
  assert m["opd_advantage_mean"] == 0.0 and m["grad_norm"] == 0.0
