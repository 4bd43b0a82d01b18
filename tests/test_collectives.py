"""glm5_jax.collectives: collective counts and bytes from HLO text, loops' trips included.

The HLO below is hand-written in XLA's text format (the shapes of a compiled CPU / TPU
program), small enough to count by hand.
"""

from glm5_jax import collectives

# A CPU-style while (known_trip_count 3) holding a tuple all-to-all (2 x 1x1x8x8 f32 = 512
# bytes), a TPU-style while (no trip count, `i < 7` in its condition) holding an all-reduce of
# f32[16] (64 bytes), and one all-gather of bf16[4,8] (64 bytes) in ENTRY.
HLO = """\
HloModule jit_f, entry_computation_layout={()->f32[]}

%body.cpu (p: (s32[], f32[2,8,8])) -> (s32[], f32[2,8,8]) {
  %p = (s32[], f32[2,8,8]{2,1,0}) parameter(0)
  %all-to-all.4 = (f32[1,1,8,8]{3,2,1,0}, f32[1,1,8,8]{3,2,1,0}) all-to-all(%a, %b), channel_id=1, replica_groups={{0,1}}
  ROOT %t = (s32[], f32[2,8,8]{2,1,0}) tuple(%i, %x)
}

%cond.cpu (p: (s32[], f32[2,8,8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body.tpu (q: (s32[], f32[16])) -> (s32[], f32[16]) {
  %q = (s32[], f32[16]{0}) parameter(0)
  %all-reduce.1 = f32[16]{0:T(256)} all-reduce(%y), channel_id=2, to_apply=%add
  ROOT %t2 = (s32[], f32[16]{0}) tuple(%j, %all-reduce.1)
}

%cond.tpu (q: (s32[], f32[16])) -> pred[] {
  %constant.10.clone.1 = s32[]{:T(128)} constant(7)
  %gte = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt.3 = pred[]{:T(512)} compare(%gte, %constant.10.clone.1), direction=LT
}

ENTRY %main (x: f32[2,8,8]) -> f32[] {
  %while.8 = (s32[], f32[2,8,8]{2,1,0}) while(%tuple.7), condition=%cond.cpu, body=%body.cpu, backend_config={"known_trip_count":{"n":"3"}}
  %while.9 = (s32[], f32[16]{0}) while(%tuple.8), condition=%cond.tpu, body=%body.tpu
  %all-gather.2 = bf16[4,8]{1,0} all-gather(%z), channel_id=3, dimensions={0}
  ROOT %r = f32[] constant(0)
}
"""


def test_collective_stats_weights_ops_by_their_loops_trip_counts():
  stats = collectives.collective_stats(HLO)
  assert stats["all-to-all"] == {"ops": 1, "count": 3, "bytes": 3 * 512}
  assert stats["all-reduce"] == {"ops": 1, "count": 7, "bytes": 7 * 64}
  assert stats["all-gather"] == {"ops": 1, "count": 1, "bytes": 64}
  assert stats["reduce-scatter"] == stats["collective-permute"] == {"ops": 0, "count": 0,
                                                                    "bytes": 0}


def test_async_start_counts_its_outputs_only():
  hlo = """\
ENTRY %main () -> f32[] {
  %all-gather-start = (f32[2,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%x), dimensions={0}
  %all-gather-done = f32[8,4]{1,0} all-gather-done(%all-gather-start)
  ROOT %r = f32[] constant(0)
}
"""
  assert collectives.collective_stats(hlo)["all-gather"] == {"ops": 1, "count": 1,
                                                             "bytes": 8 * 4 * 4}
