r"""Converts a Hugging Face GLM-5 checkpoint to an orbax workdir, or any workdir to HF.

  python -m experiments.convert_checkpoint --src=path/to/hf_dir --dst=workdir --mesh=expert=8
  python -m experiments.convert_checkpoint --src=workdir --dst=out_hf_dir --mesh=expert=8

The direction follows `--src`: a directory with config.json is a Hugging Face
checkpoint, anything else a workdir (docs/checkpoints.md). On a pod, run the same
command on every host with `--distributed`.

With `--quantize=int4`, any float source (HF dir or workdir) is written as an INT4 HF
checkpoint in compressed-tensors' pack-quantized layout (glm5_jax/hf_int4.py):

  python -m experiments.convert_checkpoint --src=sft_workdir --dst=int4_dir --quantize=int4 \
      --quantize_targets=experts --quantize_group_size=32
"""

from absl import app
from absl import flags
import jax

from glm5_jax import convert
from glm5_jax import sharding
from glm5_jax.train import checkpoint

_SRC = flags.DEFINE_string("src", None, "HF checkpoint dir or workdir", required=True)
_DST = flags.DEFINE_string("dst", None, "output workdir or HF dir", required=True)
_MESH = flags.DEFINE_string("mesh", "", "mesh sizes, e.g. expert=8,fsdp=-1 (empty: one device "
                            "for a workdir source, all devices replicated for an HF source)")
_STEP = flags.DEFINE_integer("step", 0, "step of the written workdir checkpoint")
_MAX_SHARD = flags.DEFINE_integer("max_shard_bytes", 5 * 2**30, "HF output shard size")
_QUANTIZE = flags.DEFINE_string("quantize", "", "'int4': write an INT4 HF checkpoint "
                                 "(the target weights quantized; empty: no quantization)")
_TARGETS = flags.DEFINE_string("quantize_targets", "experts", "weights --quantize quantizes: "
                               "experts, attention or all_linear")
_GROUP = flags.DEFINE_integer("quantize_group_size", 32, "INT4 values per scale along each "
                              "weight's input dimension (must divide it)")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() "
                                 "(its arguments from the environment, e.g. on a TPU pod)")


def main(argv):
  del argv
  checkpoint.quiet_orbax()
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  mesh = sharding.make_mesh(convert.parse_mesh(_MESH.value)) if _MESH.value else None
  if _QUANTIZE.value:
    convert.quantize_to_hf(_SRC.value, _DST.value, quantize=_QUANTIZE.value,
                           targets=_TARGETS.value, group_size=_GROUP.value, mesh=mesh,
                           max_shard_bytes=_MAX_SHARD.value)
  elif convert.is_hf_dir(_SRC.value):
    convert.hf_to_workdir(_SRC.value, _DST.value, mesh=mesh or sharding.make_mesh({"data": -1}),
                          step=_STEP.value)
  else:
    convert.workdir_to_hf(_SRC.value, _DST.value, mesh=mesh, max_shard_bytes=_MAX_SHARD.value)


if __name__ == "__main__":
  app.run(main)
