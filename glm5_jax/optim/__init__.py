"""Optimizers: Muon Split (GLM-5, arXiv 2602.15763) over GLM-5 parameter trees.

  tx = optim.muon_split(learning_rate=2e-3, split_heads=True)
  state = tx.init(params)
  updates, state = tx.update(grads, state, params)
  optim.param_groups(params)            # leaves "muon_split" | "muon" | "adamw"
  optim.update_metrics(updates, params) # {"update_rms/muon_split": ..., ...}
  state = optim.reset(tx, state, params)
"""

from glm5_jax.optim.muon_split import DISTRIBUTIONS
from glm5_jax.optim.muon_split import group_norms
from glm5_jax.optim.muon_split import muon_split
from glm5_jax.optim.muon_split import reset
from glm5_jax.optim.muon_split import scale_by_shape
from glm5_jax.optim.muon_split import state_shardings
from glm5_jax.optim.muon_split import update_metrics
from glm5_jax.optim.param_groups import GROUPS
from glm5_jax.optim.param_groups import muon_dim_numbers
from glm5_jax.optim.param_groups import param_groups
from glm5_jax.optim.param_groups import path_mask

__all__ = [
    "DISTRIBUTIONS", "GROUPS", "group_norms", "muon_dim_numbers", "muon_split", "param_groups",
    "path_mask", "reset", "scale_by_shape", "state_shardings", "update_metrics",
]
