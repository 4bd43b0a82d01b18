"""Shared fixtures: one tiny model, compiled once per session."""

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # before JAX starts (see glm5_jax/numerics.py)

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from tests import seeding
from tests.seeding import pytest_runtest_makereport  # noqa: F401  (prints a failing test's seed)


@pytest.fixture(scope="session")
def tiny_cfg():
  return config_lib.get_preset("tiny")


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
  return gnn.init_params(tiny_cfg, jax.random.PRNGKey(0))


@pytest.fixture(scope="session")
def tiny_tokens(tiny_cfg):
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (2, 24)), jnp.int32)


@pytest.fixture(scope="session")
def tiny_forward(tiny_cfg):
  """jit(params, tokens) -> ModelOutput with indexer KL and top-k indices."""
  model = gnn.GLM5(tiny_cfg)
  return jax.jit(lambda p, t: model.apply({"params": p}, t, with_indexer_loss=True,
                                          return_topk=True))


@pytest.fixture
def rng(request):
  """A numpy Generator seeded by the test's node id, so any failure replays (tests/seeding.py);
  a failing test's report prints the seed."""
  return np.random.default_rng(seeding.seed_of(request.node.nodeid))
