"""experiments/aot_post_training.py: rows from the shardings (fast, 8 fake CPU devices) and a
2-layer compile of both parts for a described v5p-8 (`aot`: needs libtpu).

  bash launch/local.sh aot python -m pytest -q -m aot tests/test_aot_post_training.py
"""

import pytest

from tests import fake_devices

# Rows from the shardings only (`do_compile=False`), GLM-5 shapes at 2 layers, on 8 CPU
# devices (one process, so one "host"): the bytes every row reports add up.
_ROWS = r"""
import math
import jax, numpy as np
from experiments import aot_post_training as apt
from glm5_jax.nn import kv_cache

devs = np.array(jax.devices())
kw = dict(num_layers=2, dispatch="all_to_all")
t = apt.train_row("cpu", devs, {"fsdp": 2, "context": 2, "expert": 2}, "rl_async", 256,
                  param_dtype="float32", rule_name="lora_over_fsdp", capacity_factor=1.25,
                  hbm=95.0, do_compile=False, **kw)
batch = 256 * (3 * 4 + 2 * 4) + 4      # per device: one row of 3 int + 2 float [., 256], advantages
assert t["state_bytes"] == t["param_bytes"] + t["opt_state_bytes"] + batch + 4 + 8, t
assert t["global_batch"] == 4 and t["tokens_per_device"] == 128 and t["ok"] is None
icepop = apt.train_row("cpu", devs, {"fsdp": 2, "context": 2, "expert": 2}, "rl", 256,
                       param_dtype="float32", rule_name="lora_over_fsdp", capacity_factor=1.25,
                       hbm=95.0, do_compile=False, **kw)
assert icepop["state_bytes"] == t["state_bytes"] + 256 * 4             # + old_logp

ctx, n, bs = 1000, 8, 16
d = apt.decode_row("cpu", devs, {"expert": 4, "tensor": 2}, ctx, n, param_dtype="bfloat16",
                   rule_name="default", hbm=95.0, block_size=bs, do_compile=False, **kw)
rows_per_shard = n // 4 * math.ceil(ctx / bs) * bs
assert d["kv_pool_bytes"] == rows_per_shard * d["kv_bytes_per_token"], d
assert d["kv_bytes_per_token"] == 2 * (576 * 2 + 128 * 4)
assert d["table_blocks"] == 64 and d["requests_per_shard"] == 2
assert 0 < d["mtp_param_bytes"] < d["param_bytes"] / 2, d      # one MoE layer of 2 + the MTP's
assert d["kv_room_requests"] == int((95 * 2**30 - d["param_bytes"]) // (d["kv_pool_bytes"] / 2)) * 4
try:
  apt.decode_row("cpu", devs, {"expert": 4, "tensor": 2}, ctx, 6, param_dtype="bfloat16",
                 rule_name="default", hbm=95.0, do_compile=False, **kw)
  raise AssertionError("no error")
except ValueError as e:
  assert "--requests" in str(e) and "4" in str(e), e
try:           # a context axis: the MoE dispatch splits the decode tokens over it too
  apt.decode_row("cpu", devs, {"fsdp": 2, "context": 2, "expert": 2}, ctx, 4,
                 param_dtype="bfloat16", rule_name="default", hbm=95.0, do_compile=False, **kw)
  raise AssertionError("no error")
except ValueError as e:
  assert "context x expert = 8" in str(e), e

p = apt.push_row("cpu", devs, {"fsdp": 2, "context": 2, "expert": 2}, {"expert": 4, "tensor": 2},
                 trainer_dtype="float32", trainer_rules="lora_over_fsdp", serve_dtype="bfloat16",
                 serve_rules="default", capacity_factor=1.25, replicas=2,
                 ici_topology="v5p:4x4x4", **kw)
assert p["colocated"] == {"bytes": 0, "seconds": 0.0}
assert p["rollout_param_bytes"] == d["param_bytes"]
pushed, trained = p["trainer_pushed_bytes"], p["trainer_param_bytes"]   # float32 -> bfloat16
assert trained <= 2 * pushed <= 1.001 * trained, (pushed, trained)      # (+ float32 biases)
# One host: the replica-0 writers write one copy of the model, the host reads one copy.
assert p["dcn"]["write_bytes_per_host_max"] == p["model_bytes"], p["dcn"]
assert p["dcn"]["read_bytes_per_host_max"] == p["model_bytes"], p["dcn"]
ici = p["ici"]
assert ici["cut_links"] == 32 and ici["bytes_total"] == 2 * 8 * p["rollout_param_bytes"]
want = max(ici["recv_bytes_per_chip"] / 600e9, ici["bytes_total"] / 8 / 600e9,
           ici["bytes_total"] / (32 * 100e9))
assert abs(ici["seconds"] - want) < 1e-12, (ici, want)
# Write, commit, then read: one host writes and reads one copy each.
assert abs(p["dcn"]["write_seconds"] - p["model_bytes"] / 25e9) < 1e-12, p["dcn"]
assert abs(p["dcn"]["seconds"] - 2 * p["model_bytes"] / 25e9) < 1e-12, p["dcn"]
print(apt.decode_table([d]))
print(apt.push_table([p]))
print("OK")
"""


def test_rows_from_shardings():
  fake_devices.run_script(_ROWS, devices=8, timeout=600)


_COMPILE = r"""
import jax, numpy as np
from jax.experimental import topologies
from experiments import aot_post_training as apt

devs = np.array(topologies.get_topology_desc("v5p:2x2x1", "tpu").devices)
kw = dict(num_layers=2, dispatch="all_to_all", hbm=95.0)
d = apt.decode_row("v5p:2x2x1", devs, {"expert": 2, "tensor": 2}, 4096, 4,
                   param_dtype="bfloat16", rule_name="default", **kw)
assert d["ok"], d
# The compiled arguments are the parameters, the pool and the small per-slot inputs, less the
# MTP layer's parameters (unused without speculative decoding: jit drops them); the engine
# holds those too, so they count in the resident total.
used = d["param_bytes"] - d["mtp_param_bytes"] + d["kv_pool_bytes"]
assert used <= d["argument_bytes"] <= 1.01 * d["state_bytes"], d
assert d["pruned_argument_bytes"] <= d["mtp_param_bytes"], d
assert d["resident_total_bytes"] == d["total_bytes"] + d["pruned_argument_bytes"], d
assert d["resident_peak_bytes"] == d["peak_bytes"] + d["pruned_argument_bytes"], d
assert apt.with_resident(d) == d                                        # idempotent (--merge)
assert d["resident_total_bytes"] >= d["param_bytes"] + d["kv_pool_bytes"] + d["temp_bytes"], d
assert d["alias_bytes"] >= d["kv_pool_bytes"], d                       # the pool is donated
t = apt.train_row("v5p:2x2x1", devs, {"fsdp": 2, "expert": 2}, "rl_async", 1024,
                  param_dtype="bfloat16", rule_name="lora_over_fsdp", capacity_factor=1.25, **kw)
assert t["ok"] and t["total_bytes"] <= t["hbm_bytes"], t
assert abs(t["argument_bytes"] - t["state_bytes"]) <= 0.01 * t["state_bytes"], t
print("OK")
"""


@pytest.mark.aot
def test_two_layer_probes_compile_for_v5p():
  pytest.importorskip("libtpu", reason="needs libtpu: bash launch/local.sh aot ...")
  fake_devices.run_script(_COMPILE, devices=1, timeout=1800)
