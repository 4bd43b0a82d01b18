"""A relaxed-ordering float atomic add for Pallas Triton kernels.

`pltr.atomic_add` always lowers to an acquire-release `tt.atomic_rmw`: on sm_90
each vector atomic becomes `MEMBAR.ALL.GPU; ATOMG`, a GPU-wide fence per 16
bytes added. The sparse-MLA backward's dkv accumulation needs atomicity only
(nothing in the kernel reads dkv), so `atomic_add_relaxed` is the same op with
relaxed ordering (`REDG`, no fence; `experiments/aot_gpu_kernels.py` counts the
fences). Its abstract eval and its interpret-mode discharge are jax's own
`atomic_rmw` rules for an add. It uses private jax modules (jax 0.10.2);
`gpu.py` falls back to `pltr.atomic_add` if they move.
"""

from __future__ import annotations

import functools

# pylint: disable=protected-access
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import primitives as triton_primitives
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as state_primitives

_ADD = triton_primitives.AtomicOpType.ADD
atomic_add_relaxed_p = jax_core.Primitive("atomic_add_relaxed")
atomic_add_relaxed_p.def_effectful_abstract_eval(
    functools.partial(triton_primitives._atomic_abstract_eval, atomic_type=_ADD))
state_discharge.register_discharge_rule(atomic_add_relaxed_p)(
    functools.partial(triton_primitives._atomic_rmw_discharge_rule, atomic_type=_ADD))


@triton_lowering.register_lowering(atomic_add_relaxed_p)
def _atomic_add_relaxed_lowering(ctx, *args_flat, args_tree):
  ptr, (indexer,), val, _ = args_tree.unflatten(args_flat)
  val_aval = args_tree.unflatten(ctx.avals_in)[2]
  ptr = triton_lowering._compute_pointers_from_indices(ptr, ctx.block_infos[0], indexer)
  return triton_lowering._atomic_rmw(
      tt_dialect.RMWOp.FADD, ptr, triton_lowering._ensure_ir_value(val, val_aval),
      semantic=tt_dialect.MemSemantic.RELAXED)


def atomic_add_relaxed(ref, idx, val):
  """`pltr.atomic_add(ref, idx, val)` (float) with relaxed memory ordering."""
  ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "atomic_add_relaxed")
  args_flat, args_tree = tree_util.tree_flatten((ref, transforms, val, None))
  return atomic_add_relaxed_p.bind(*args_flat, args_tree=args_tree)
