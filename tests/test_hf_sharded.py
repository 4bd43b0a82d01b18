"""HF checkpoints on a mesh: sharded load and save, the orbax converter, damaged files.

Sharded runs go through subprocesses with fake CPU devices (tests/fake_devices.py); the
multi-process ones use `jax.distributed` over gloo, each process with 4 devices. Values
must be bit-identical to the single-process load (the same bytes are read and cast).
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from glm5_jax import hf
from tests import fake_devices

ROOT = fake_devices.ROOT


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny_cfg, tiny_params):
  path = tmp_path_factory.mktemp("tiny_hf")
  hf.save_pretrained(tiny_cfg, tiny_params, str(path))
  return path


@pytest.fixture
def ckpt(tmp_path, tiny_ckpt):
  """A fresh copy of the tiny checkpoint to damage."""
  shutil.copytree(tiny_ckpt, tmp_path / "ck")
  return tmp_path / "ck"


def _edit(path, fn):
  f = os.path.join(path, "model.safetensors")
  t = load_file(f)
  fn(t)
  save_file(t, f)


# ---- damaged files: each error names the file and the tensor or field -------------------

def test_truncated_safetensors_names_the_file_and_tensor(ckpt):
  f = ckpt / "model.safetensors"
  os.truncate(f, os.path.getsize(f) - 100)
  with pytest.raises(ValueError, match=rf"{f} is truncated: tensor '.+' needs bytes up to"):
    hf.load_pretrained(str(ckpt))


def test_broken_config_json_names_the_file(ckpt):
  (ckpt / "config.json").write_text('{"model_type": "glm_moe_dsa", "hidden_size": 64,')
  with pytest.raises(ValueError, match=rf"{ckpt / 'config.json'} is not valid JSON"):
    hf.load_pretrained(str(ckpt))


def test_hidden_size_inconsistent_with_tensors_names_tensor_and_field(ckpt):
  conf = json.loads((ckpt / "config.json").read_text())
  (ckpt / "config.json").write_text(json.dumps(dict(conf, hidden_size=48)))
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'lm_head\.weight' has shape "
                     r"\[384, 64\], config\.json implies \[384, 48\]; dim 1 is 64, config\.json "
                     r"gives 48 \(hidden_size\)"):
    hf.load_pretrained(str(ckpt))


def test_nan_tensor_is_rejected_by_name(ckpt):
  name = "model.layers.2.mlp.experts.5.up_proj.weight"
  _edit(ckpt, lambda t: t[name].__setitem__((3, 7), np.nan))
  with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' holds non-finite"):
    hf.load_pretrained(str(ckpt))


def test_integer_lm_head_is_rejected_with_its_dtype(ckpt):
  _edit(ckpt, lambda t: t.update({"lm_head.weight": t["lm_head.weight"].astype(np.int32)}))
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'lm_head\.weight' has dtype "
                     r"I32; expected one of \('F64', 'F32', 'F16', 'BF16'\)"):
    hf.load_pretrained(str(ckpt))


# ---- one process, 8 devices ---------------------------------------------------------------

# Both scripts: the single-process load of `src` is the reference; check(params) compares.
_PREAMBLE = r"""
import numpy as np, jax
from safetensors.numpy import load_file, save_file
from glm5_jax import convert, hf, sharding
src, tmp = {src!r}, {tmp!r}
leaves = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
cfg, ref = hf.load_pretrained(src, to_device=False)

def check(params):
  for (k, a), b in zip(leaves(params), jax.tree_util.tree_leaves(ref)):
    assert a.shape == b.shape and a.dtype == b.dtype, k
    np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(k))
"""

_SHARDED = _PREAMBLE + r"""
mesh = sharding.make_mesh({{"fsdp": 2, "expert": 2, "tensor": 2}})
_, p = hf.load_pretrained(src, mesh=mesh)
check(p)
specs = {{jax.tree_util.keystr(k): a.sharding.spec for k, a in leaves(p)}}
w_up = "['moe_layers']['layer_0']['moe']['experts']['w_up']"
assert tuple(specs[w_up]) == (None, "expert", "fsdp", "tensor")
shards = p["moe_layers"]["layer_0"]["moe"]["experts"]["w_up"].addressable_shards
assert shards[0].data.shape == (2, 4, 32, 16)

hf.save_pretrained(cfg, p, tmp + "/resaved", max_shard_bytes=100_000)       # from sharded arrays
_, back = hf.load_pretrained(tmp + "/resaved", to_device=False)
check(back)

t = load_file(src + "/model.safetensors")                                   # fused experts
for layer in (1, 2):
  x = f"model.layers.{{layer}}.mlp.experts"
  g = np.stack([t.pop(f"{{x}}.{{e}}.gate_proj.weight") for e in range(8)])
  u = np.stack([t.pop(f"{{x}}.{{e}}.up_proj.weight") for e in range(8)])
  t[f"{{x}}.gate_up_proj"] = np.concatenate([g, u], axis=1)
  t[f"{{x}}.down_proj"] = np.stack([t.pop(f"{{x}}.{{e}}.down_proj.weight") for e in range(8)])
import shutil; shutil.copytree(src, tmp + "/fused"); save_file(t, tmp + "/fused/model.safetensors")
check(hf.load_pretrained(tmp + "/fused", mesh=mesh)[1])

print("OK")
"""


@pytest.mark.slow
def test_sharded_load_and_save_on_8_devices(tiny_ckpt, tmp_path):
  """Loads onto fsdp x expert x tensor = 2x2x2 (and the fused expert layout); saves from the
  sharded arrays."""
  fake_devices.run_script(_SHARDED.format(src=str(tiny_ckpt), tmp=str(tmp_path)), devices=8,
                          timeout=300)


_ORBAX = _PREAMBLE + r"""
mesh = sharding.make_mesh({{"fsdp": 2, "expert": 2, "tensor": 2}})
convert.hf_to_workdir(src, tmp + "/wd", mesh=sharding.make_mesh({{"expert": 2}}, jax.devices()[:2]))
_, restored = convert.restore_sharded(tmp + "/wd", mesh)
check(restored)
assert tuple(restored["embed"]["embedding"].sharding.spec) == ("tensor", "fsdp")
convert.workdir_to_hf(tmp + "/wd", tmp + "/from_wd", mesh=mesh)
check(hf.load_pretrained(tmp + "/from_wd", to_device=False)[1])
print("OK")
"""


@pytest.mark.slow
def test_orbax_conversion_restores_on_another_mesh(tiny_ckpt, tmp_path):
  """HF -> workdir on expert=2 (2 devices: orbax compiles one slice per replica and array,
  ~40 s for 8 CPU replicas), restored on fsdp x expert x tensor = 2x2x2, back to HF."""
  fake_devices.run_script(_ORBAX.format(src=str(tiny_ckpt), tmp=str(tmp_path)), devices=8,
                          timeout=600)


def test_conversion_refuses_a_destination_in_its_source_and_locks_the_workdir(tiny_ckpt,
                                                                              tmp_path):
  from glm5_jax import convert  # pylint: disable=g-import-not-at-top
  from glm5_jax.train import workdir  # pylint: disable=g-import-not-at-top
  for dst in (str(tiny_ckpt), os.path.join(str(tiny_ckpt), "wd")):
    with pytest.raises(ValueError, match=r"--dst=.* (is|is inside) --src="):
      convert.hf_to_workdir(str(tiny_ckpt), dst)
  with pytest.raises(ValueError, match=r"contains --src="):
    convert.workdir_to_hf(str(tmp_path / "a" / "wd"), str(tmp_path / "a"))
  assert not os.path.exists(os.path.join(str(tiny_ckpt), "wd"))
  wd = str(tmp_path / "wd")
  with workdir.lock(wd):                     # this process writes it: re-entrant, succeeds
    convert.hf_to_workdir(str(tiny_ckpt), wd)
  assert open(os.path.join(wd, "run.lock")).read() == ""


# ---- two processes (slow) -----------------------------------------------------------------

def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_two(script: str, *args, devices: int = 4, timeout: int = 900):
  """Runs `script` in 2 processes (argv: port, process id, *args) with `devices` each."""
  env = dict(os.environ, PYTHONPATH=ROOT,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  port = _port()
  procs = [subprocess.Popen([sys.executable, "-c", script, str(port), str(i), *map(str, args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  outs = [p.communicate(timeout=timeout) for p in procs]
  assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
  return [o[0] for o in outs]


_INIT = r"""
import sys, jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = sys.argv[1:3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(pid))
"""

_SAVE_TWO = _INIT + r"""
from glm5_jax import hf, sharding
src, dst = sys.argv[3:5]
cfg, params = hf.load_pretrained(src, mesh=sharding.make_mesh({"fsdp": 2, "expert": 4}))
hf.save_pretrained(cfg, params, dst, max_shard_bytes=100_000)
print("OK")
"""


@pytest.mark.slow
@pytest.mark.hf
def test_transformers_loads_what_two_processes_saved(tmp_path, tiny_cfg):
  """fsdp=2 spans the processes, so most tensors are held by no single process and are
  gathered one at a time; the files come from both processes."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from glm5_jax import nn as gnn  # pylint: disable=g-import-not-at-top
  cfg = tiny_cfg.replace(index_n_heads=16, num_nextn_predict_layers=0, mtp_num_steps=0)
  hf.save_pretrained(cfg, gnn.init_params(cfg, 7), str(tmp_path / "src"))
  _run_two(_SAVE_TWO, tmp_path / "src", tmp_path / "dst")
  index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 2
  _, want = hf.load_pretrained(str(tmp_path / "src"), to_device=False)
  _, got = hf.load_pretrained(str(tmp_path / "dst"), to_device=False)
  for a, b in zip(jax_leaves(got), jax_leaves(want)):
    np.testing.assert_array_equal(a, b)
  model = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(tmp_path / "dst")).eval()
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.numpy()
  ours = gnn.GLM5(cfg).apply({"params": want}, jnp.asarray(tokens, jnp.int32)).logits
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def jax_leaves(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree_util.tree_leaves(tree)


# A config whose routed experts are 99% of its 2.4 GB (float32): 6 MoE layers x 128 experts.
_BIG = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
            num_hidden_layers=7, first_k_dense_replace=1, n_routed_experts=128,
            num_experts_per_tok=4, num_nextn_predict_layers=0, mtp_num_steps=0)

_WRITE_BIG = r"""
import sys, numpy as np, jax
from glm5_jax import config as config_lib, hf, nn as gnn
cfg = config_lib.get_preset("tiny", **{big})
shapes, _ = gnn.abstract_params(cfg)
rng = np.random.default_rng(0)
def draw(s):                                        # random bytes, exponent < 128: finite
  u = rng.integers(0, 2**32, s.shape, dtype=np.uint32) & np.uint32(0xBFFFFFFF)
  return u.view(np.float32)
params = jax.tree.map(draw, shapes)
hf.save_pretrained(cfg, params, sys.argv[1], max_shard_bytes=2**29)
print("OK")
"""

_LOAD_BIG = _INIT + r"""
import json, resource, time, zlib
import numpy as np
from glm5_jax import hf, sharding
src, out = sys.argv[3], sys.argv[4].replace("load0", f"load{pid}")
t = time.time()
cfg, params = hf.load_pretrained(src, mesh=sharding.make_mesh({"expert": 8}))
jax.block_until_ready(params)
seconds = time.time() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
held, crcs = 0, {}
for k, x in jax.tree_util.tree_flatten_with_path(params)[0]:
  for s in x.addressable_shards:
    held += s.data.nbytes
    box = tuple(i.indices(n)[:2] for i, n in zip(s.index, x.shape))
    crcs[jax.tree_util.keystr(k) + "|" + json.dumps(box)] = zlib.crc32(np.asarray(s.data).tobytes())
json.dump(dict(peak=peak, held=held, seconds=seconds, crcs=crcs), open(out, "w"))
print("OK")
"""

_CHECK_BIG = r"""
import sys, json, zlib, numpy as np, jax
from glm5_jax import convert, hf, safetensors_io, sharding
src, wd, *outs = sys.argv[1:]
cfg, ref = hf.load_pretrained(src, to_device=False)
flat = {{jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_flatten_with_path(ref)[0]}}
n = 0
for out in outs:
  for key, crc in json.load(open(out))["crcs"].items():
    path, box = key.split("|")
    block = flat[path][tuple(slice(a, b) for a, b in json.loads(box))]
    assert zlib.crc32(np.ascontiguousarray(block).tobytes()) == crc, key
    n += 1
full = {{k: zlib.crc32(np.ascontiguousarray(x).tobytes()) for k, x in flat.items()}}
del ref, flat
_, restored = convert.restore_sharded(wd, sharding.make_mesh({{"expert": 4, "tensor": 2}}))
for k, x in jax.tree_util.tree_flatten_with_path(restored)[0]:
  assert zlib.crc32(np.asarray(x).tobytes()) == full[jax.tree_util.keystr(k)], k
print(json.dumps(dict(blocks=n, leaves=len(full))))
print("OK")
"""


def _run(script: str, *args, devices: int, timeout: int = 900) -> str:
  env = dict(os.environ, PYTHONPATH=ROOT,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  p = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=timeout)
  assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stderr[-3000:]
  return p.stdout


@pytest.mark.slow
def test_two_processes_load_a_2gb_checkpoint_within_their_share_of_memory(tmp_path):
  """Each process's peak RSS <= 1.2 x (its arrays + the largest tensor) + 1 GiB; the blocks
  equal a single-process load; the orbax conversion restores them on another mesh."""
  from glm5_jax import safetensors_io  # pylint: disable=g-import-not-at-top
  ck, wd = tmp_path / "big", tmp_path / "wd"
  try:
    _run(_WRITE_BIG.format(big=_BIG), ck, devices=1)
    files = [ck / f for f in os.listdir(ck) if f.endswith(".safetensors")]
    infos = {k: v for f in files for k, v in safetensors_io.read_header(str(f)).items()}
    total = sum(v.end - v.begin for v in infos.values())
    largest = max(v.end - v.begin for v in infos.values())
    assert total >= 2e9
    outs = [tmp_path / f"load{i}.json" for i in range(2)]
    _run_two(_LOAD_BIG, ck, outs[0])       # each process writes load{pid}.json: see below
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    subprocess.run([sys.executable, "-m", "experiments.convert_checkpoint", f"--src={ck}",
                    f"--dst={wd}", "--mesh=expert=8"], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=900)
    stdout = _run(_CHECK_BIG.format(), ck, wd, *outs, devices=8)
    report = {"total_bytes": total, "largest_tensor": largest,
              "check": json.loads(stdout.strip().splitlines()[-2])}
    for i, out in enumerate(outs):
      r = json.loads(out.read_text())
      bound = 1.2 * (r["held"] + largest) + 2**30
      report[f"process_{i}"] = {k: r[k] for k in ("peak", "held", "seconds")} | {"bound": bound}
      assert r["peak"] <= bound, report
    print(json.dumps(report))
    assert report["check"]["blocks"] > 0
  finally:
    shutil.rmtree(ck, ignore_errors=True)
    shutil.rmtree(wd, ignore_errors=True)
