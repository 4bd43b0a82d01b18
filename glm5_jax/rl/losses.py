"""The RL policy losses, at their former path: `glm5_jax.policy_losses` (the training runner's
`train_step` computes them, so they live below both `train/` and `rl/`)."""

from glm5_jax.policy_losses import check_hparams
from glm5_jax.policy_losses import cispo_loss
from glm5_jax.policy_losses import double_sided_is_loss
from glm5_jax.policy_losses import group_advantages
from glm5_jax.policy_losses import grpo_clip_loss
from glm5_jax.policy_losses import icepop_grpo_loss
from glm5_jax.policy_losses import LOG_RATIO_CLAMP
from glm5_jax.policy_losses import opd_advantages
from glm5_jax.policy_losses import tis_grpo_loss
from glm5_jax.policy_losses import token_mean

__all__ = ["LOG_RATIO_CLAMP", "check_hparams", "cispo_loss", "double_sided_is_loss",
           "group_advantages", "grpo_clip_loss", "icepop_grpo_loss", "opd_advantages",
           "tis_grpo_loss", "token_mean"]
