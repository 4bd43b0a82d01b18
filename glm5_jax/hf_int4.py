"""INT4 Hugging Face checkpoints: compressed-tensors' `pack-quantized` layout.

`hf.save_pretrained` writes a parameter tree whose INT4 weights are `quant.QArray`s (the output
of `quant.quantize_tree`, the quantizer QAT trains through) and `hf.load_pretrained(...,
quantized=True)` reads them back packed. Each quantized torch Linear `X.weight` [out, in] is
stored as three tensors, the names and layout of compressed-tensors'
`PackedQuantizationCompressor` (`pack_to_int32`, `compression_param_info`):

    X.weight_packed  int32 [out, in / 8]   eight 4-bit values per word along `in`: value 8j + i
                                           in bits 4i..4i+3 of word j, stored as q + 8
    X.weight_scale   float32 [out, in / g] one scale per g consecutive `in` entries
    X.weight_shape   int32 [2]             [out, in]

    X.weight[o, i] = (nibble(o, i) - 8) * weight_scale[o, i // g]    (a float32 product)

q and the scale are glm5_jax/quant.py's (symmetric: s = max |w| / 7, q in [-7, 7]); a reader
of compressed-tensors' symmetric INT4 (nibble - 8 in [-8, 7], times the group's scale)
dequantizes them to the same float32 values. The words are compressed-tensors' dtype; their
little-endian bytes are exactly `QArray.values` (two nibbles per byte, low nibble = even `in`
index), so the conversion is a reinterpretation of the same bytes (`words` / `nibble_bytes`),
and needs `in` % 8 == 0 (true of every GLM-5 and preset dimension).

Our leaves are views of the HF tensors (hf.py `_View`): an INT4 leaf is [*batch, R / 2, O]
packed + [*batch, R / g, O] scales, R the flattened reduction axes (HF `in`) and O the
flattened output axes in row-major order (a box of HF `out` for kv_b_proj's two views w_uk,
w_uv), which is the HF [out, in] tensor transposed; hf.py derives the views of the stored
tensors from the float weight's.

`config.json` gets a `quantization_config` (`quantization_config` below) that states the
format: compressed-tensors' fields (quant method, format, bits, type, symmetric, strategy,
group size, the targeted and the ignored modules as `re:` patterns) and, under `glm5_jax`,
what those fields leave open (scale dtype and rule, value range, rounding, packing, our target
group). transformers has no compressed-tensors path for `glm_moe_dsa` here: it does not load
these directories; `hf.load_pretrained` does.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import quant

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")   # X.weight -> X.<suffix>
PER_WORD = 8                          # INT4 values per int32 word
QUANT_METHOD, FORMAT = "compressed-tensors", "pack-quantized"


def stored_name(weight_name: str, suffix: str) -> str:
  """`X.weight` -> `X.<suffix>`."""
  if not weight_name.endswith(".weight"):
    raise ValueError(f"{weight_name}: only a Linear's `.weight` is stored quantized")
  return weight_name[:-len("weight")] + suffix


def _words(xp, values):
  r2, o = values.shape[-2:]
  if r2 % (PER_WORD // 2):
    raise ValueError(f"INT4 weight with {2 * r2} reduction (HF `in`) entries: compressed-"
                     f"tensors packs {PER_WORD} per int32 word; expected a multiple of "
                     f"{PER_WORD}")
  b = values.reshape(*values.shape[:-2], r2 // 4, 4, o).astype(xp.uint32)
  w = b[..., 0, :] | (b[..., 1, :] << 8) | (b[..., 2, :] << 16) | (b[..., 3, :] << 24)
  return w.view(np.int32) if xp is np else jax.lax.bitcast_convert_type(w, jnp.int32)


_words_jax = jax.jit(functools.partial(_words, jnp))    # keeps a global array's sharding


def words(values):
  """int32 [..., R / 8, O] compressed-tensors words of packed INT4 bytes [..., R / 2, O]
  (byte 4j + k of a column is byte k, little-endian, of word j): numpy for host arrays and
  arrays this process holds whole, else (an array sharded over processes) jitted."""
  if isinstance(values, jax.Array) and values.is_fully_addressable:
    values = np.asarray(values)
  return _words(np, values) if isinstance(values, np.ndarray) else _words_jax(values)


def nibble_bytes(words_):
  """The inverse of `words`: uint8 [..., R / 2, O] of int32 words [..., R / 8, O] (numpy)."""
  w = np.asarray(words_).view(np.uint32)
  b = np.stack([(w >> (8 * k)) & 0xFF for k in range(4)], axis=-2).astype(np.uint8)
  return b.reshape(*w.shape[:-2], 4 * w.shape[-2], w.shape[-1])


def stored(qa: quant.QArray, path: str) -> dict:
  """{suffix: the leaf stored under it} of an INT4 QArray: int32 words [*batch, R / 8, O] and
  float32 scales [*batch, R / g, O] (weight_shape is written per HF tensor by hf.py)."""
  if qa.fmt != "int4":
    raise ValueError(f"{path}: a {qa.fmt} QArray; Hugging Face checkpoints hold INT4 weights "
                     "only (quant.Scheme fmt='int4')")
  return {"weight_packed": words(qa.values), "weight_scale": qa.scales}


def _pattern(name: str) -> str:
  """`re:` pattern of a module name with its layer and expert indices left open."""
  return "re:^" + r"\.\d+\.".join(re.escape(s) for s in re.split(r"\.\d+\.", name)) + "$"


def patterns(module_names) -> list[str]:
  """Sorted `re:` patterns covering `module_names` (every layer, every expert)."""
  return sorted({_pattern(n) for n in module_names})


def quantization_config(group_size: int, targets: str, quantized, ignored) -> dict:
  """config.json's `quantization_config`.

  group_size: g; targets: our target group (optim/param_groups.QUANT_TARGETS) or "custom";
  quantized, ignored: HF module names (`X` of `X.weight`) of the INT4 Linears and of the
  Linears kept in float.
  """
  tq, ti = patterns(quantized), patterns(ignored)
  both = set(tq) & set(ti)
  if both:                          # a module kind quantized in some layers only
    raise ValueError(f"INT4 checkpoint: modules {sorted(both)} are quantized in some layers "
                     "and not in others; a target group quantizes a module kind in every layer")
  return {
      "quant_method": QUANT_METHOD,
      "format": FORMAT,
      "quantization_status": "compressed",
      "config_groups": {"group_0": {
          "targets": tq,
          "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                      "group_size": int(group_size), "dynamic": False, "actorder": None},
          "input_activations": None, "output_activations": None}},
      "ignore": ti,
      "kv_cache_scheme": None,
      "glm5_jax": {
          "targets": targets,
          "scale_dtype": "float32",
          "scale": "max |w| over the group / 7 (an all-zero group: scale 0)",
          "values": "q = clip(round_half_to_even(float32(w) / scale), -7, 7)",
          "dequantize": "(nibble - 8) * scale, float32",
          "weight_packed": ("int32 [out, in / 8]: value 8j + i of a row in bits 4i..4i+3 of "
                            "word j, as q + 8 (compressed-tensors pack_to_int32; little-endian "
                            "bytes: two nibbles per byte, low nibble first)"),
          "weight_scale": "float32 [out, in / group_size]",
          "weight_shape": "int32 [2]: [out, in]",
      },
  }


def read_group_size(hf_cfg: dict, file: str) -> int | None:
  """The INT4 group size a config.json's `quantization_config` states, None without one; a
  ValueError naming the field for any other quantization."""
  qc = hf_cfg.get("quantization_config")
  if qc is None:
    return None

  def bad(field, value, want):
    return ValueError(f"{file}: quantization_config.{field}={value!r}: glm5_jax reads "
                      f"{want} (INT4 checkpoints of hf.save_pretrained)")
  if not isinstance(qc, dict):
    raise bad("", qc, "a JSON object")
  for field, want in (("quant_method", QUANT_METHOD), ("format", FORMAT)):
    if qc.get(field) != want:
      raise bad(field, qc.get(field), repr(want))
  groups = qc.get("config_groups")
  if not isinstance(groups, dict) or len(groups) != 1:
    raise bad("config_groups", groups, "one group")
  (gname, group), = groups.items()
  w = group.get("weights") if isinstance(group, dict) else None
  if not isinstance(w, dict):
    raise bad(f"config_groups.{gname}.weights", w, "a JSON object")
  for field, want in (("num_bits", 4), ("type", "int"), ("symmetric", True),
                      ("strategy", "group")):
    if w.get(field) != want:
      raise bad(f"config_groups.{gname}.weights.{field}", w.get(field), repr(want))
  g = w.get("group_size")
  if not isinstance(g, int) or isinstance(g, bool) or g < 2 or g % 2:
    raise bad(f"config_groups.{gname}.weights.group_size", g, "an even int >= 2")
  return g


def describe(hf_cfg: dict) -> str:
  """One line naming a config.json's quantization (for errors)."""
  qc = hf_cfg.get("quantization_config") or {}
  groups = qc.get("config_groups") or {}
  w = (next(iter(groups.values()), {}) or {}).get("weights") or {}
  ours = qc.get("glm5_jax") or {}
  return (f"quant_method={qc.get('quant_method')!r}, format={qc.get('format')!r}, "
          f"num_bits={w.get('num_bits')}, group_size={w.get('group_size')}, "
          f"targets={ours.get('targets', 'see config_groups')!r}")
