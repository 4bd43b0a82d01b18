"""Training config checks that need no run: each bad value is refused before anything is
built, with the field and the allowed values; throughput leaves out evaluation time; the
main job's summary prints a stage's missing metric as nan."""

import json
import os

import jax
import pytest

from configs import pretrain
from glm5_jax.train import loop
from glm5_jax.train import metrics as metrics_lib
from experiments import main_job_report


def _config(**fields):
  c = pretrain.get_config("model=tiny,runlocal=True")
  for k, v in fields.items():
    *parents, leaf = k.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = v
  return c


@pytest.mark.parametrize("field,value,match", [
    ("learning_rate", -1e-3, r"config.learning_rate=-0.001: expected >= 0"),
    ("loss_chunk", 0, r"config.loss_chunk=0: expected an integer >= 1"),
    ("eval_batches", 0, r"config.eval_batches=0: expected an integer >= 1"),
    ("keep_checkpoints", 0, r"config.keep_checkpoints=0: expected an integer >= 1"),
    ("seed", 2**40, r"config.seed=1099511627776: expected an integer in \[0, 2\*\*31\)"),
    ("seed", -1, r"config.seed=-1: expected an integer in \[0, 2\*\*31\)"),
    ("param_init", "gpu", r"config.param_init='gpu': expected 'auto', 'host' or 'jit'"),
    ("profile_steps", (5, 2), r"config.profile_steps=\(5, 2\): expected \(\) or \(start, stop\)"),
    ("num_devices", -1, r"config.num_devices=-1: expected an int >= 0 \(0 = every device\)"),
])
def test_bad_field_is_refused_with_its_name(field, value, match):
  with pytest.raises(ValueError, match=match):
    loop.validate_config(_config(**{field: value}))


def test_default_config_is_valid():
  loop.validate_config(_config())
  loop.validate_config(_config(num_devices=1))
  assert loop._devices(_config(num_devices=1)) == jax.devices()[:1]
  with pytest.raises(ValueError, match=r"config.num_devices=4096: expected an int in \[0, \d+\]"):
    loop._devices(_config(num_devices=4096))      # checked once the devices are known
  loop.validate_config(_config(profile_steps=(2, 4)))


@pytest.mark.parametrize("field,value,match", [
    ("val_fraction", 0.0, r"config.data.val_fraction=0.0: expected in \(0, 1\)"),
    ("val_fraction", 1.0, r"config.data.val_fraction=1.0: expected in \(0, 1\)"),
    ("val_fraction", -0.5, r"config.data.val_fraction=-0.5: expected in \(0, 1\)"),
    ("num_shards", 0, r"config.data.num_shards=0: expected an integer in \[1, 4096\]"),
    ("max_files", -2, r"config.data.max_files=-2: expected an integer in \[0, ")])
def test_split_fields_out_of_range_on_a_fresh_data_dir_are_refused(tmp_path, field, value,
                                                                   match):
  c = _config(**{"data.dir": str(tmp_path / "fresh"), f"data.{field}": value})
  with pytest.raises(ValueError, match=match):
    loop.ensure_data(c)
  assert not os.path.exists(tmp_path / "fresh")             # nothing prepared


def test_validation_split_shorter_than_a_row_is_refused(tmp_path):
  meta = {"vocab_size": 300, "splits": {"train": {"tokens": 10_000, "bytes": 10_000},
                                        "validation": {"tokens": 100, "bytes": 100}}}
  with open(tmp_path / "meta.json", "w") as f:
    json.dump(meta, f)
  c = _config(**{"data.dir": str(tmp_path), "seq_len": 256})
  with pytest.raises(ValueError, match="validation split holds 100 tokens, fewer than one row "
                                       "of config.seq_len=256"):
    loop.ensure_data(c)


def test_throughput_leaves_out_excluded_time(monkeypatch):
  clock = iter([0.0, 10.0, 20.0])
  monkeypatch.setattr(metrics_lib.time, "perf_counter", lambda: next(clock))
  p = metrics_lib.Progress(0, 100, tokens_per_step=50)
  p.exclude(8.0)                                           # e.g. an evaluation and a save
  assert p.update(4)["steps_per_s"] == pytest.approx(4 / 2.0)
  assert p.update(8)["tokens_per_s"] == pytest.approx(4 * 50 / 10.0)   # reset per window


def test_summary_of_stages_without_eval_metrics_prints_nan(tmp_path):
  for name in ("pretrain", "dense_baseline", "dsa_warmup", "dsa_sparse"):
    os.makedirs(tmp_path / name)
    with open(tmp_path / name / "metrics.jsonl", "w") as f:
      f.write(json.dumps({"step": 1, "loss": 1.0}) + "\n")
  meta = {"train_unigram_entropy_bits_per_token": 4.0,
          "splits": {"train": {"tokens": 10, "bytes": 10}}}
  s = main_job_report.summarize({n: {} for n in ("pretrain", "dense_baseline", "dsa_warmup",
                                        "dsa_sparse")},
                        dict.fromkeys(("pretrain", "dense_baseline", "dsa_warmup",
                                       "dsa_sparse"), 1.0), meta, str(tmp_path))
  assert s["dsa_vs_dense_relative_loss_gap"] is None
  assert "nan" in main_job_report.table(s)


def test_profile_steps_write_a_trace_of_those_steps(tmp_path):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  c = _config(profile_steps=(1, 3))
  tracing, seen = False, []
  for step in range(5):
    tracing = loop._profile(c, str(tmp_path), step, tracing)
    seen.append(tracing)
    (jnp.ones(4) * step).block_until_ready()
  assert seen == [False, True, True, False, False]
  traces = [f for _, _, fs in os.walk(tmp_path / "profile") for f in fs if f.endswith(".xplane.pb")]
  assert len(traces) == 1


def test_summary_reports_grpo_and_the_async_rl_stage(tmp_path):
  rows = {name: [{"step": 1, "eval_loss": 1.0}] for name in
          ("pretrain", "dense_baseline", "dsa_warmup", "dsa_sparse", "sft")}
  rl = {"logp_abs_diff_max": 0.0, "topk_mismatches": 0.0, "topk_positions": 10.0}
  rows["grpo"] = [{"step": 0, "heldout_accuracy": 0.5, "heldout_problems": 8},
                  {"step": 1, "reward_mean": 0.5, **rl},
                  {"step": 1, "heldout_accuracy": 0.625}]
  rows["rl_async"] = [{"step": 0, "heldout_success_rate": 0.625},
                      {"step": 1, "reward_mean": 0.6, "staleness_max": 1.0,
                       "trainer_idle_ratio": 0.3, **rl},
                      {"step": 2, "reward_mean": 0.7, "staleness_max": 0.0,
                       "trainer_idle_ratio": 0.2, **rl, "topk_positions": 12.0,
                       "logp_abs_diff_mean": 0.0, "routing_mismatches": 1.0,
                       "routing_pairs": 40.0},
                      {"step": 2, "heldout_success_rate": 0.75}]
  for name, ms in rows.items():
    os.makedirs(tmp_path / name)
    with open(tmp_path / name / "metrics.jsonl", "w") as f:
      f.writelines(json.dumps(m) + "\n" for m in ms)
  meta = {"train_unigram_entropy_bits_per_token": 4.0,
          "splits": {"train": {"tokens": 10, "bytes": 10}}}
  s = main_job_report.summarize(dict.fromkeys(rows, {}), dict.fromkeys(rows, 1.0), meta, str(tmp_path))
  assert s["post_training"]["heldout_accuracy_after_grpo"] == 0.625
  assert s["async_rl"] == {
      "heldout_accuracy_before": 0.625, "heldout_accuracy_after": 0.75, "updates": 2,
      "train_rollout_logp_abs_diff_max": 0.0, "train_rollout_logp_abs_diff_mean": 0.0,
      "topk_mismatches": 0.0, "topk_positions_compared": 22.0, "routing_mismatches": 1.0,
      "routing_pairs_compared": 40.0, "routing_mismatch_rate": 0.025, "staleness_max": 1.0,
      "trainer_idle_ratio": 0.2}
  assert ("async RL (2 updates, staleness <= 1): held-out accuracy 0.625 -> 0.750; "
          "|dlogp| max 0, top-k mismatches 0 of 22, routing mismatches 1 of 40"
          ) in main_job_report.table(s)
  assert s["post_training"]["grpo_gain"] == 0.125
  # Every number outside the ranges a new machine can expect is named (eval losses of 1.0,
  # 62.5% after GRPO); with ranges around it, none.
  out = main_job_report.outside_expected(s)
  assert any(x.startswith("stages.pretrain.eval_loss = 1, outside the range [2.34, 2.63]")
             for x in out)
  assert any(x.startswith("post_training.heldout_accuracy_after_grpo = 0.625, outside")
             for x in out)
  assert not any(x.startswith("post_training.grpo_gain") for x in out)   # 0.125: inside
  assert "NOTE: post_training.heldout_accuracy_after_grpo = 0.625" in main_job_report.table(s)
  assert main_job_report.outside_expected(s, [("post_training.grpo_gain", 0.1, 0.2),
                                              ("stages.nosuch.eval_loss", 0.0, 0.1)]) == []


def test_main_job_writes_its_sft_data_first_and_a_bad_task_option_stops_it(tmp_path):
  from configs import main_job  # pylint: disable=g-import-not-at-top
  from experiments import main_job_stages  # pylint: disable=g-import-not-at-top
  c = main_job.get_config()
  with c.unlocked():
    c.post.sft_conversations = 50
  path = main_job_stages._write_sft_data(c, str(tmp_path / "ok"))
  recs = [json.loads(line) for line in open(path)]
  assert len(recs) == 50 and 0 < sum(r["messages"][-1]["reasoning"] is not None
                                     for r in recs) < 50
  with c.unlocked():
    c.post.task_options.ops = "+-"
  with pytest.raises(ValueError, match="'\\+' only"):
    main_job_stages.run_all(c, str(tmp_path / "bad"))
  assert not os.path.exists(tmp_path / "bad" / "pretrain")
