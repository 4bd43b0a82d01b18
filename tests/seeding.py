"""Test inputs seeded from the test's own name, and the seed printed when a test fails.

`seed()` is crc32 of the running test's node id (`tests/test_x.py::test_name[param]`), so a
failing test replays by running it again by that id, and the printed seed rebuilds its inputs
outside pytest: `np.random.default_rng(SEED)`. The `rng` fixture (tests/conftest.py) and
`rng()` here give the same Generator.
"""

import os
import zlib

import numpy as np
import pytest


def seed_of(nodeid: str) -> int:
  return zlib.crc32(nodeid.encode())


def _current_nodeid() -> str:
  current = os.environ.get("PYTEST_CURRENT_TEST")
  if not current:
    raise RuntimeError("tests.seeding.seed(): called outside a running pytest test")
  return current.rsplit(" (", 1)[0]          # drop the " (setup)" / " (call)" phase


def seed() -> int:
  """The running test's seed."""
  return seed_of(_current_nodeid())


def rng() -> np.random.Generator:
  """A numpy Generator seeded by the running test's node id."""
  return np.random.default_rng(seed())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  if report.failed:
    report.sections.append((
        "seed", f"inputs seeded by the test id: seed {seed_of(item.nodeid)} "
        f"(np.random.default_rng({seed_of(item.nodeid)})); replay: "
        f"python -m pytest '{item.nodeid}'"))
  return report
