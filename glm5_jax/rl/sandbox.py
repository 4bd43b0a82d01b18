"""The sandbox for untrusted Python, at its former path: `glm5_jax.rl.envs.sandbox`."""

from glm5_jax.rl.envs.sandbox import PROTECTIONS
from glm5_jax.rl.envs.sandbox import SANDBOX_UIDS
from glm5_jax.rl.envs.sandbox import STATUSES
from glm5_jax.rl.envs.sandbox import SandboxError
from glm5_jax.rl.envs.sandbox import SandboxResult
from glm5_jax.rl.envs.sandbox import run_python

__all__ = ["PROTECTIONS", "SANDBOX_UIDS", "STATUSES", "SandboxError", "SandboxResult",
           "run_python"]
