"""The engine's host scheduler alone (inference/scheduler.py): admission decisions, slot choice,
block reuse and eviction, checked against block ids worked out by hand. No device: the
scheduler is pure Python, so these run in milliseconds.

Blocks of 4 rows. A request of p prompt tokens and budget n holds ceil((p + n - 1) / 4)
blocks (every row but the last token's), handed out in order from each shard's free list.
"""

import pytest

from glm5_jax.inference import scheduler as scheduler_lib
from glm5_jax.inference.sampling import SamplingParams

BLOCK = 4


def _sp(n):
  return SamplingParams(max_new_tokens=n, temperature=0.0)


def _submit(s, tokens, budget, **kw):
  return s.submit(list(tokens), _sp(budget), budget, **kw)


def _prefilled(s, r):
  """What the engine does when a request's prompt is in the cache: rows cached, prefix
  blocks registered."""
  r.cache_len = r.feed_end
  s.prompt_cached(r)


def _done(s, r):
  r.active = False
  return s.finish(r)


def _decisions(admissions):
  return [(a.request.rid, a.slot, a.shard, a.reused, a.fresh) for a in admissions]


def test_first_come_first_served_into_the_lowest_free_slot():
  s = scheduler_lib.Scheduler(max_batch=2, num_blocks=8, block_size=BLOCK)
  a, = _submit(s, range(5), 4)          # 8 rows: 2 blocks
  b, = _submit(s, range(9), 4)          # 12 rows: 3 blocks
  c, = _submit(s, range(3), 2)          # 4 rows: 1 block
  assert _decisions(s.admit()) == [(a, 0, 0, (), (0, 1)), (b, 1, 0, (), (2, 3, 4))]
  assert [r.rid for r in s.waiting] == [c] and s.admit() == []        # no free slot
  out = _done(s, s.requests[a])
  assert out.request_id == a and s.slots[0] is None
  assert _decisions(s.admit()) == [(c, 0, 0, (), (5,))]               # a's blocks freed
  assert s.pools[0].num_available == 8 - 3 - 1


def test_a_request_whose_blocks_do_not_fit_holds_the_queue():
  s = scheduler_lib.Scheduler(max_batch=3, num_blocks=5, block_size=BLOCK)
  a, = _submit(s, range(9), 4)          # 3 blocks
  b, = _submit(s, range(9), 4)          # 3 more: only 2 left
  c, = _submit(s, range(2), 1)          # 1 block would fit, but comes after b
  assert _decisions(s.admit()) == [(a, 0, 0, (), (0, 1, 2))]
  assert [r.rid for r in s.waiting] == [b, c]
  _done(s, s.requests[a])
  assert _decisions(s.admit()) == [(b, 0, 0, (), (3, 4, 0)), (c, 1, 0, (), (1,))]


def test_copies_wait_for_the_leader_then_share_its_full_prompt_blocks():
  s = scheduler_lib.Scheduler(max_batch=4, num_blocks=12, block_size=BLOCK)
  lead, c1, c2 = _submit(s, range(10), 3, n=3)      # 12 rows: 3 blocks each
  assert _decisions(s.admit()) == [(lead, 0, 0, (), (0, 1, 2))]
  assert [r.rid for r in s.waiting] == [c1, c2]     # deferred, in order
  _prefilled(s, s.requests[lead])                   # rows 0..9 cached: blocks 0, 1 are full
  got = _decisions(s.admit())
  assert got == [(c1, 1, 0, (0, 1), (3,)), (c2, 2, 0, (0, 1), (4,))]
  copy = s.requests[c1]
  assert copy.cache_len == copy.cached_prompt == 8  # two blocks of rows not prefilled again
  assert [s.pools[0].refcount(b) for b in (0, 1, 2)] == [3, 3, 1]


def test_a_short_prompt_is_not_deferred_and_keeps_a_token_to_prefill():
  """A prompt of one block (4 tokens) shares nothing: its last token must be prefilled to
  sample from it, so the copy does not wait for the leader."""
  s = scheduler_lib.Scheduler(max_batch=2, num_blocks=8, block_size=BLOCK)
  lead, copy = _submit(s, range(4), 2, n=2)         # 5 rows: 2 blocks
  assert _decisions(s.admit()) == [(lead, 0, 0, (), (0, 1)), (copy, 1, 0, (), (2, 3))]


def test_a_session_continues_on_its_blocks_and_idle_sessions_are_evicted_lru_first():
  s = scheduler_lib.Scheduler(max_batch=1, num_blocks=6, block_size=BLOCK)
  old, new = s.new_session(), s.new_session()
  for sid, tokens, blocks in ((old, range(6), (0, 1)), (new, range(10, 16), (2, 3))):
    rid, = _submit(s, tokens, 2, session=s.session(sid))     # 7 rows: 2 blocks
    assert _decisions(s.admit()) == [(rid, 0, 0, (), blocks)]
    _prefilled(s, s.requests[rid])
    s.requests[rid].emit(7, -0.5, 5, 0)
    _done(s, s.requests[rid])
  assert s.sessions[old].blocks == [0, 1] and s.sessions[old].cache_len == 6
  # `new`'s next turn: 7 tokens + 4 + budget 2 - 1 = 12 rows, 3 blocks: its own 2 (6 cached
  # rows), then 1 fresh (4 and 5 are free).
  rid, = _submit(s, s.session(new).tokens + [1, 2, 3, 4], 2, session=s.session(new))
  assert _decisions(s.admit()) == [(rid, 0, 0, (2, 3), (4,))]
  assert s.requests[rid].cached_prompt == 6 and s.stats["sessions_evicted"] == 0
  _done(s, s.requests[rid])
  # 11 rows need 3 blocks; only 5 is free: the least recently used session (`old`) goes,
  # its blocks 1 (free) and 0 (a cached prefix) taken in that order; `new` stays.
  rid, = _submit(s, range(100, 110), 2)
  assert _decisions(s.admit()) == [(rid, 0, 0, (), (5, 1, 0))]
  assert s.stats["sessions_evicted"] == 1
  assert s.sessions[old].blocks == [] and s.sessions[new].blocks == [2, 3, 4]


def test_sharded_slots_go_to_the_emptiest_shard_and_a_session_stays_on_its_own():
  s = scheduler_lib.Scheduler(max_batch=4, num_blocks=16, block_size=BLOCK, n_shards=2)
  assert [s.shard_of(i) for i in range(4)] == [0, 0, 1, 1]
  assert [p.first for p in s.pools] == [0, 8]
  a, = _submit(s, range(9), 4)                      # 3 blocks; shards tie: lowest slot
  b, = _submit(s, range(5), 4)                      # 2 blocks; shard 1 has 8 to shard 0's 5
  c, = _submit(s, range(2), 3)                      # 1 block; shard 1 has 6 to 5
  assert _decisions(s.admit()) == [(a, 0, 0, (), (0, 1, 2)), (b, 2, 1, (), (8, 9)),
                                   (c, 3, 1, (), (10,))]
  _done(s, s.requests[c])                           # 10 goes to the back of shard 1's list
  sid = s.new_session()
  rid, = _submit(s, range(5), 2, session=s.session(sid))
  assert _decisions(s.admit()) == [(rid, 3, 1, (), (11, 12))]
  _prefilled(s, s.requests[rid])
  s.requests[rid].emit(7, -0.5, 4, 0)
  _done(s, s.requests[rid])
  _done(s, s.requests[a])                           # shard 0 (8 available) is the emptiest,
  rid, = _submit(s, [1], 2, session=s.session(sid))  # but the session's rows are on shard 1
  assert _decisions(s.admit()) == [(rid, 3, 1, (11, 12), ())]


def test_static_scheduling_admits_only_into_an_empty_batch():
  s = scheduler_lib.Scheduler(max_batch=2, num_blocks=8, block_size=BLOCK,
                              scheduling="static")
  a, b, c = (_submit(s, range(3), 2)[0] for _ in range(3))
  assert [x[0] for x in _decisions(s.admit())] == [a, b]
  _done(s, s.requests[a])
  assert s.admit() == []                            # b still runs
  _done(s, s.requests[b])
  assert [x[0] for x in _decisions(s.admit())] == [c]


def test_a_speculative_session_hands_its_mtp_state_to_the_engine_once():
  s = scheduler_lib.Scheduler(max_batch=1, num_blocks=8, block_size=BLOCK, speculative=True)
  sid = s.new_session()
  rid, = _submit(s, range(6), 2, session=s.session(sid))
  (first,) = s.admit()
  assert first.h_last is None and not first.request.h_valid
  _prefilled(s, s.requests[rid])
  s.requests[rid].emit(7, -0.5, 5, 0)
  s.requests[rid].active = False
  s.finish(s.requests[rid], h_last="h-row")         # the engine's host copy of the row
  rid, = _submit(s, s.session(sid).tokens + [3], 2, session=s.session(sid))
  (again,) = s.admit()
  assert again.h_last == "h-row" and again.request.h_valid
  assert s.sessions[sid].h_last is None             # written once, into the new slot's row


def test_new_weights_requeue_running_requests_in_submission_order_and_free_every_block():
  s = scheduler_lib.Scheduler(max_batch=2, num_blocks=8, block_size=BLOCK)
  a, b, c = (_submit(s, range(5), 2)[0] for _ in range(3))
  s.admit()
  s.new_weights(1)
  assert [r.rid for r in s.waiting] == [a, b, c] and s.slots == [None, None]
  assert all(r.blocks == [] and r.cache_len == 0 for r in s.waiting)
  assert s.pools[0].num_available == 8 and s.version == 1


def test_cancel_releases_a_waiting_or_running_request():
  s = scheduler_lib.Scheduler(max_batch=1, num_blocks=8, block_size=BLOCK)
  a, b = (_submit(s, range(5), 2)[0] for _ in range(2))
  s.admit()
  s.cancel(b)                                        # waiting
  s.cancel(a)                                        # running
  assert s.slots == [None] and not s.waiting and s.pools[0].num_available == 8
  with pytest.raises(ValueError, match="unknown or already finished"):
    s.cancel(a)
