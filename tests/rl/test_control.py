"""The control plane of async RL: refill, staleness, routing, ledger, heartbeats.

Property tests: each loops over many random cases drawn from the test's own `rng` (seeded by
its node id, tests/seeding.py), so a failure replays from the test id.
"""

import json
import os
import subprocess
import sys
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import policy_losses as rl_losses
from glm5_jax.rl.algorithm import groups
from glm5_jax.rl.algorithm.trajectory import STATUSES
from glm5_jax.rl.algorithm.trajectory import Trajectory
from glm5_jax.rl.orchestration import control
from glm5_jax.rl.orchestration import heartbeat
from glm5_jax.rl.orchestration import ledger as ledger_lib
from glm5_jax.rl.orchestration import routing
from glm5_jax.rl.orchestration import staleness


def _rollout(rng, rid, status, reward, versions=(0,)):
  """A rollout of 1-3 segments, each with random tokens and the given loss versions."""
  segs = []
  for s in range(int(rng.integers(1, 4))):
    v = [int(x) for x in rng.choice(versions, size=int(rng.integers(1, 4)))]
    segs.append(Trajectory.from_response(
        rng.integers(0, 50, int(rng.integers(1, 5))).tolist(), rng.integers(0, 50, len(v)).tolist(),
        rng.normal(size=len(v)).tolist(), v, rollout_id=rid, group_id=rid.split("/")[0],
        segment_id=s, status=status, reward=reward,
        topk={1: rng.integers(0, 5, (2, 3))}))
  return segs


def _group(rng, g, n_valid, versions=(0,)):
  bad = [s for s in STATUSES if s not in groups.TRAINED]
  sts = ([str(rng.choice(groups.TRAINED)) for _ in range(n_valid)]      # truncated trains
         + [str(rng.choice(bad)) for _ in range(g - n_valid)])
  rng.shuffle(sts)
  return [_rollout(rng, f"g000007/{j}", st, float(rng.integers(0, 2)) if st == "ok" else 0.0,
                   versions) for j, st in enumerate(sts)]


def _same_except_ids(copy_segs, src_segs):
  assert len(copy_segs) == len(src_segs)
  for c, s in zip(copy_segs, src_segs):
    assert c.copy_of == s.rollout_id and c.rollout_id != s.rollout_id
    assert c is not s and c.tokens is not s.tokens                      # deep copies
    for f in ("tokens", "loss_mask", "rollout_logp", "versions", "group_id", "segment_id",
              "status", "reward", "finish_reason", "error", "prompt_index"):
      assert getattr(c, f) == getattr(s, f), f
    assert c.topk.keys() == s.topk.keys()
    for k in c.topk:
      assert c.topk[k] is not s.topk[k]
      np.testing.assert_array_equal(c.topk[k], s.topk[k])


def test_refill_fills_majority_valid_groups_with_even_copies_and_zero_mean_advantages(rng):
  for case in range(300):
    g = int(rng.integers(1, 12))
    n_valid = int(rng.integers(g // 2 + 1, g + 1))
    group = _group(rng, g, n_valid)
    filled = groups.refill(group, rng)
    assert len(filled) == g
    ids = [groups.rollout_id(r) for r in filled]
    assert len(set(ids)) == g
    assert all(groups.status(r) in groups.TRAINED for r in filled)
    sources = {groups.rollout_id(r): r for r in group}
    originals = [r for r in filled if r[0].copy_of is None]
    assert [groups.rollout_id(r) for r in originals] == [
        groups.rollout_id(r) for r in group if groups.status(r) in groups.TRAINED]
    counts = {i: 0 for i in ids if sources.get(i) is not None}
    for r in filled:
      if r[0].copy_of is not None:
        _same_except_ids(r, sources[r[0].copy_of])
        counts[r[0].copy_of] += 1
    assert max(counts.values()) - min(counts.values()) <= 1
    assert {i for i, _ in groups.invalid(group)} == set(sources) - set(counts)
    for normalize_std in (False, True):
      adv = groups.advantages(filled, normalize_std)
      assert abs(float(adv.mean())) < 1e-5
      if case < 10:                                       # the trainer's own formula
        rewards = np.asarray([groups.reward(r) for r in filled], np.float32)
        want = rl_losses.group_advantages(jnp.asarray(rewards[None]),
                                          normalize_std=normalize_std)
        np.testing.assert_allclose(adv, np.asarray(want)[0], atol=1e-5)
    trajs, per_traj = groups.flatten(filled, adv)
    assert len(trajs) == len(per_traj) == sum(len(r) for r in filled)


def test_refill_drops_groups_with_at_most_half_valid(rng):
  for _ in range(300):
    g = int(rng.integers(1, 12))
    group = _group(rng, g, int(rng.integers(0, g // 2 + 1)))
    assert groups.refill(group, rng) is None
    assert len(groups.invalid(group)) >= g - g // 2


def test_refill_copy_choice_follows_the_rng_and_keeps_bare_trajectories(rng):
  group = [Trajectory.from_response([1], [2], [-1.0], 0, rollout_id=f"g000001/{j}",
                                    status="ok" if j < 5 else "timeout", reward=float(j))
           for j in range(8)]
  picks = {tuple(r.copy_of for r in groups.refill(group, np.random.default_rng(s))[5:])
           for s in range(20)}
  assert len(picks) > 1                                   # which sources get copies is drawn
  filled = groups.refill(group, rng)
  assert all(isinstance(r, Trajectory) for r in filled)
  assert [r.rollout_id for r in filled[5:]] == [f"{r.copy_of}c1" for r in filled[5:]]
  with pytest.raises(ValueError, match="unique and non-empty"):
    groups.refill(group + group[:1], rng)


def test_staleness_span_stale_and_future_versions(rng):
  for _ in range(300):
    now = int(rng.integers(0, 20))
    versions = rng.integers(0, now + 1, int(rng.integers(1, 6)))
    group = [_rollout(rng, f"g000001/{j}", "ok", 0.0, versions.tolist()) for j in range(3)]
    seen = [v for r in group for s in r for v, m in zip(s.versions, s.loss_mask) if m]
    tau = int(rng.integers(0, 6))
    assert staleness.span(group, now) == now - min(seen)
    assert staleness.stale(group, now, tau) == (now - min(seen) > tau)
    assert not staleness.from_future(group, now)
    assert staleness.from_future(group, max(seen) - 1)
  no_loss = Trajectory([1, 2], [0.0, 0.0], [0.0, 0.0], [-1, -1])
  assert staleness.span([no_loss], 5) == 0 and not staleness.from_future([no_loss], 0)


def test_admission_never_lets_consumed_plus_running_exceed_the_staleness_bound(rng):
  for _ in range(200):
    tau, b = int(rng.integers(0, 4)), int(rng.integers(1, 5))
    max_running = int(rng.integers(1, 12))
    version = consumed = running = 0
    for step in range(60):
      cap = staleness.admission_capacity(version=version, tau=tau, groups_per_version=b,
                                         consumed=consumed, running=running,
                                         max_running=max_running)
      assert cap >= 0
      running += int(rng.integers(0, cap + 1))             # admit up to the capacity
      assert consumed + running <= (tau + version + 1) * b
      assert running <= max_running
      done = int(rng.integers(0, running + 1))
      dropped = int(rng.integers(0, done + 1))             # stale: re-queued, not consumed
      running -= done
      consumed += done - dropped
      if consumed >= (version + 1) * b:                    # the trainer publishes
        version += 1
      if step == 30:              # restart: in-flight work re-queued, counters from the checkpoint
        running = 0
        assert staleness.consumed_after_restore(version, b) <= consumed
  # AReaL #1388: a counter restarted at 0 with the version restored over-admits.
  kw = dict(version=5, tau=1, groups_per_version=4, running=0, max_running=100)
  assert staleness.admission_capacity(consumed=0, **kw) == 28
  assert staleness.admission_capacity(consumed=staleness.consumed_after_restore(5, 4),
                                      **kw) == 8
  with pytest.raises(ValueError, match="groups_per_version=0"):
    staleness.admission_capacity(**{**kw, "groups_per_version": 0}, consumed=0)


def test_router_is_sticky_and_never_exceeds_its_load_bound(rng):
  for _ in range(20):
    n, bound = int(rng.integers(1, 7)), float(rng.choice([1.0, 1.1, 1.25, 2.0]))
    router = routing.Router(n, load_bound=bound, seed=int(rng.integers(0, 100)))
    live = {}
    for k in range(300):
      if live and rng.random() < 0.3:                      # an episode ends
        rid = str(rng.choice(sorted(live)))
        router.release(rid)
        del live[rid]
      elif live and rng.random() < 0.5:                    # a later turn of a live episode
        rid = str(rng.choice(sorted(live)))
        assert router.route(rid) == live[rid]
      else:
        rid = f"g{k:06d}/{int(rng.integers(0, 4))}"
        before = len(live)
        live[rid] = router.route(rid)
        if len(live) > before:
          loads = router.loads()
          assert loads[live[rid]] <= router.cap(len(live))
          assert loads[live[rid]] <= np.ceil(bound * len(live) / n)
    assert sum(router.loads().values()) == len(live)
    assert router.assignments() == live


def test_router_remove_moves_only_the_dead_replicas_ids_and_add_moves_none(rng):
  for _ in range(10):
    n = int(rng.integers(3, 8))
    router = routing.Router(n, load_bound=1.25, seed=int(rng.integers(0, 100)))
    ids = [f"g{k:06d}/{j}" for k in range(40) for j in range(4)]
    before = {i: router.route(i) for i in ids}
    dead = int(rng.integers(0, n))
    moved = router.remove(dead)
    assert set(moved) == {i for i, r in before.items() if r == dead}
    assert dead not in moved.values() and dead not in router.loads()
    after = router.assignments()
    assert {i: r for i, r in after.items() if i not in moved} == {
        i: r for i, r in before.items() if r != dead}
    assert max(router.loads().values()) <= router.cap(len(ids))
    router.add(dead)
    assert router.assignments() == after                   # adding moves no assigned id
    fresh = [f"h{k}" for k in range(4000)]
    small = routing.Router(n, seed=router.seed)
    small.remove(dead)
    changed = np.mean([router.home(i) != small.home(i) for i in fresh])
    assert changed == pytest.approx(1 / n, abs=0.6 / n)    # ~1/n of homes move to the new one
    assert all(router.home(i) == dead for i in fresh if router.home(i) != small.home(i))


def test_router_is_deterministic_across_processes():
  code = ("from glm5_jax.rl.orchestration import routing; r = routing.Router(5, seed=3); "
          "print([r.route(f'g{k:06d}/{j}') for k in range(30) for j in range(4)])")
  outs = []
  for hashseed in ("1", "2"):
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "JAX_PLATFORMS": "cpu"}
    outs.append(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                               capture_output=True, text=True, timeout=60).stdout)
  r = routing.Router(5, seed=3)
  here = str([r.route(f"g{k:06d}/{j}") for k in range(30) for j in range(4)])
  assert outs[0].strip() == outs[1].strip() == here


def test_prefix_stats_hit_rate():
  s = routing.PrefixStats()
  assert s.hit_rate == 0.0
  s.record(0, 10)
  s.record(30, 30)
  assert s.hit_rate == 0.75
  with pytest.raises(ValueError, match="cached_tokens=5"):
    s.record(5, 4)


def _clean_run(led):
  led.admitted("g000000", prompt_index=0)
  for j in range(2):
    led.finished(f"g000000/{j}#0")
  led.finished("g000000/0c1#0", copy_of="g000000/0")
  led.finished("g000000/1#1")
  for i in ("g000000/0#0", "g000000/1#0", "g000000/1#1", "g000000/0c1#0"):
    led.consumed(i, "trajectory")
  led.consumed("g000000", "group")
  led.admitted("g000001", prompt_index=1)
  led.dropped("g000001/0#0", "trajectory", "worker_dead")     # in flight when its worker died
  led.dropped("g000001", "group", "worker_dead")
  led.admitted("g000002", prompt_index=1)                     # the same prompt, re-queued
  led.finished("g000002/0#0")
  led.dropped("g000002/0#0", "trajectory", "stale")
  led.dropped("g000002", "group", "stale")


def test_ledger_audit_is_clean_for_a_clean_run_and_finds_each_fault(tmp_path):
  path = str(tmp_path / "rollouts.jsonl")
  t = iter(range(1000))
  with ledger_lib.Ledger(path, clock=lambda: next(t)) as led:
    _clean_run(led)
  assert ledger_lib.audit(path) == []
  lines = open(path).read().splitlines()
  assert json.loads(lines[0]) == {"t": 0, "id": "g000000", "kind": "group",
                                  "event": "admitted", "reason": None, "run": 0,
                                  "prompt_index": 0}

  def audit_with(edit):
    bad = str(tmp_path / "bad.jsonl")
    with open(bad, "w") as f:
      f.writelines(json.dumps(e) + "\n" for e in edit([json.loads(x) for x in lines]))
    return ledger_lib.audit(bad)

  lost = audit_with(lambda es: [e for e in es if (e["id"], e["event"]) != ("g000001", "dropped")])
  assert lost and all("g000001" in p and "lost" in p for p in lost)
  lost_traj = audit_with(lambda es: [e for e in es if (e["id"], e["event"]) !=
                                     ("g000000/1#1", "consumed")])
  assert len(lost_traj) == 1 and "g000000/1#1" in lost_traj[0]
  unfinished = audit_with(lambda es: [e for e in es if (e["id"], e["event"]) !=
                                      ("g000000/1#1", "finished")])
  assert len(unfinished) == 1 and "g000000/1#1 consumed but never finished" in unfinished[0]
  twice = audit_with(lambda es: es + [{**es[5], "t": 99}])     # a trajectory consumed again
  assert len(twice) == 1 and "trajectory g000000/0#0 consumed after it was already consumed" \
      in twice[0]
  no_reason = audit_with(lambda es: [{**e, "reason": None} if e["event"] == "dropped" else e
                                     for e in es])
  assert len(no_reason) == 4 and all("reason None" in p for p in no_reason)
  same_id = audit_with(lambda es: [{**e, "id": "g000000/0#0"} if e.get("copy_of") else e
                                   for e in es])
  assert any("copy with its source's id" in p for p in same_id)
  with pytest.raises(ValueError, match="reason='tired'"):
    ledger_lib.Ledger(str(tmp_path / "x.jsonl")).dropped("g1", "group", "tired")


def test_ledger_open_resumes_after_a_torn_line_and_audit_reports_it(tmp_path):
  path = str(tmp_path / "rollouts.jsonl")
  with ledger_lib.Ledger(path) as led:
    led.admitted("g000000")
  with open(path, "a") as f:
    f.write('{"t": 1, "id": "g0000')                          # killed mid-write
  assert ledger_lib.pending(path) == {"group": ["g000000"], "trajectory": []}
  with ledger_lib.Ledger.open(path) as led:
    led.write("g000000", "group", "dropped", reason="shutdown")
  assert ledger_lib.pending(path) == {"group": [], "trajectory": []}
  problems = ledger_lib.audit(path)
  assert len(problems) == 1 and ":2: not a JSON line" in problems[0]
  with ledger_lib.Ledger(path) as led:                        # a new ledger replaces it
    led.admitted("g000009")
  assert [e["id"] for e in ledger_lib.read(path)] == ["g000009"]


def _killed_after_checkpoint(path):
  """Run 0: groups of prompts 0, 1, 2; a checkpoint after update 1 (g0 consumed, g1 in
  flight); after it, updates 2 and 3 consume g1 and g2, then SIGKILL. Returns the line count
  the checkpoint saved."""
  led = ledger_lib.Ledger.open(path)
  led.begin(0, 0)
  for g in range(3):
    led.admitted(f"g{g}", prompt_index=g)
  for g in range(2):
    led.finished(f"g{g}/0#0")
  led.consumed("g0/0#0", "trajectory", update=0)
  led.consumed("g0", "group", update=0)
  keep = led.lines                                      # checkpoint of update 1
  led.consumed("g1/0#0", "trajectory", update=1)
  led.consumed("g1", "group", update=1)
  led.finished("g2/0#0")
  led.consumed("g2/0#0", "trajectory", update=2)
  led.consumed("g2", "group", update=2)
  led.close()                                           # killed: nothing ledgered dropped
  return keep


def _resume(path, keep, update=1):
  """Run 1 from the checkpoint of `update`: what is open at it dropped, prompts 1 and 2
  admitted again (g3, g4) and consumed by updates 1 and 2."""
  led = ledger_lib.Ledger.open(path)
  led.begin(update, keep)
  for kind, ids in ledger_lib.pending(path).items():
    for i in ids:
      led.dropped(i, kind, "shutdown")
  for g, p in ((3, 1), (4, 2)):
    led.admitted(f"g{g}", prompt_index=p)
    led.finished(f"g{g}/0#0")
    led.consumed(f"g{g}/0#0", "trajectory", update=g - 2)
    led.consumed(f"g{g}", "group", update=g - 2)
  return led


def test_ledger_resume_rolls_back_the_killed_runs_work_and_audit_names_each_fault(tmp_path):
  path = str(tmp_path / "rollouts.jsonl")
  keep = _killed_after_checkpoint(path)
  assert ledger_lib.pending(path) == {"group": [], "trajectory": []}
  led = _resume(path, keep)
  led.close()
  assert ledger_lib.audit(path) == []
  live = ledger_lib.live(path)
  assert [e["id"] for e in live if e["event"] == "consumed" and e["kind"] == "group"] == [
      "g0", "g3", "g4"]
  assert sorted((e["id"], e["reason"]) for e in live if e["event"] == "dropped") == [
      ("g1", "shutdown"), ("g1/0#0", "shutdown"), ("g2", "shutdown")]
  total = sum(1 for _ in open(path))
  assert ledger_lib.summary(path)["rolled_back"] == 5 and ledger_lib.summary(path)["runs"] == 2
  assert len(ledger_lib.read(path)) == total            # nothing truncated

  # The resume that did not roll back (the bug this fixes): prompts 1 and 2 consumed twice,
  # updates 1 and 2 in two runs.
  bad = str(tmp_path / "no_rollback.jsonl")
  keep = _killed_after_checkpoint(bad)
  _resume(bad, keep=sum(1 for _ in open(bad))).close()
  problems = ledger_lib.audit(bad)
  assert any("prompt 1 consumed 2 times: group g1" in p and "group g3" in p for p in problems)
  assert any("prompt 2 consumed 2 times" in p for p in problems)
  assert any("update 1 consumed groups in runs [0, 1]" in p for p in problems)

  # A process of the rolled-back run still writing after run 1 started.
  zombie = str(tmp_path / "zombie.jsonl")
  keep = _killed_after_checkpoint(zombie)
  led = _resume(zombie, keep)
  led.close()
  with open(zombie, "a") as f:
    f.write(json.dumps({"t": 9, "id": "g2", "kind": "group", "event": "dropped",
                        "reason": "stale", "run": 0}) + "\n")
  problems = ledger_lib.audit(zombie)
  assert len(problems) == 1 and "group g2 dropped of run 0, written while run 1 runs" in \
      problems[0]

  # Markers that do not make sense: keeping lines past the marker, runs not increasing.
  odd = str(tmp_path / "odd.jsonl")
  lines = open(path).read().splitlines()
  marker = [i for i, x in enumerate(lines) if '"kind": "run"' in x][1]
  with open(odd, "w") as f:
    for i, x in enumerate(lines):
      e = json.loads(x)
      if i == marker:
        e = {**e, "keep": len(lines) + 5}
      f.write(json.dumps(e) + "\n")
  assert any("malformed run marker" in p for p in ledger_lib.audit(odd))
  with open(odd, "w") as f:
    for i, x in enumerate(lines):
      f.write(json.dumps({**json.loads(x), "run": 0} if i == marker else json.loads(x)) + "\n")
  assert any("run 0 starts after run 0" in p for p in ledger_lib.audit(odd))
  with pytest.raises(ValueError, match="keep=99"):
    ledger_lib.Ledger.open(path).begin(0, 99)


def test_ledger_without_a_finished_checkpoint_keeps_the_file_and_rolls_it_all_back(tmp_path):
  """SIGKILL before the first checkpoint was finished: the rerun starts from update 0 with
  keep=0; the killed run's events stay in the file, rolled back, and ids continue."""
  path = str(tmp_path / "rollouts.jsonl")
  _killed_after_checkpoint(path)
  before = open(path).read()
  led = ledger_lib.Ledger.open(path)
  assert led.run == 1 and led.lines == before.count("\n")
  led.begin(0, 0)
  assert ledger_lib.pending(path) == {"group": [], "trajectory": []}
  led.admitted("g5", prompt_index=0)
  led.finished("g5/0#0")
  led.consumed("g5/0#0", "trajectory", update=0)
  led.consumed("g5", "group", update=0)
  led.close()
  assert open(path).read().startswith(before)
  assert ledger_lib.audit(path) == []
  assert [e["id"] for e in ledger_lib.live(path)] == ["g5", "g5/0#0", "g5/0#0", "g5"]


def test_control_round_trips_the_ledger_length_and_running_totals():
  ctl = control.Control(seed=3)
  totals = {"counts": {"status_ok": 7, "dropped_stale": 2}, "spans": {"0": 3, "1": 4},
            "wall_s": 12.5, "wait_s": 1.5, "busy_s": [3.0], "prefix_tokens": [10, 40],
            "compile_s": 4.0, "compiles": 9}
  d = json.loads(json.dumps(ctl.to_json([5, 6], 123, totals)))
  back = control.Control(seed=3)
  back.load(d)
  assert back.ledger_lines == 123 and back.totals == totals
  assert list(back.requeue) == [5, 6]
  old = {k: v for k, v in d.items() if k not in ("ledger_lines", "totals")}
  back.load(old)                         # a checkpoint from before the fields: keep all
  assert back.ledger_lines is None and back.totals == {}


def test_ledger_concurrent_writers_write_whole_json_lines(tmp_path):
  path = str(tmp_path / "rollouts.jsonl")
  led = ledger_lib.Ledger(path)

  def worker(w):
    for k in range(200):
      gid = f"g{w}{k:05d}"
      led.admitted(gid, payload="x" * 300)
      led.consumed(gid, "group")

  threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  led.close()
  events = ledger_lib.read(path)
  assert len(events) == 8 * 200 * 2
  assert ledger_lib.audit(path) == []
  assert ledger_lib.summary(path) == {"group/admitted": 1600, "group/consumed": 1600}


def test_heartbeat_monitor_finds_the_silent_worker_and_fences_its_old_epoch():
  now = [0.0]
  mon = heartbeat.Monitor(timeout_s=5.0, clock=lambda: now[0])
  assert mon.register("w0") == 0 and mon.register("w1") == 0
  now[0] = 4.0
  assert mon.beat("w0", 0) and mon.beat("w1", 0) and mon.dead() == []
  now[0] = 9.0
  assert mon.beat("w1", 0)
  assert mon.dead() == []                                     # w0 silent exactly 5 s
  now[0] = 9.5
  assert mon.dead() == ["w0"]
  assert mon.fence("w0") == 1
  assert mon.dead() == []                                     # the restart gets a timeout
  assert not mon.accepts("w0", 0) and mon.accepts("w0", 1) and mon.accepts("w1", 0)
  assert not mon.beat("w0", 0)                                # the fenced incarnation
  now[0] = 15.0
  assert mon.dead() == ["w0", "w1"]                           # its beat did not count
  assert mon.beat("w0", 1) and mon.dead() == ["w1"]
  mon.forget("w1")
  assert mon.dead() == [] and mon.epoch("w0") == 1
  with pytest.raises(ValueError, match="timeout_s=0"):
    heartbeat.Monitor(0)
