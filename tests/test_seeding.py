"""A failing test prints a seed that rebuilds its random inputs (tests/seeding.py)."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np

from tests import seeding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rng_fixture_and_helper_agree(rng, request):
  assert seeding.seed() == seeding.seed_of(request.node.nodeid)
  np.testing.assert_array_equal(rng.random(4), seeding.rng().random(4))


def test_a_failing_test_prints_the_seed_that_replays_it(tmp_path):
  test = tmp_path / "test_fails_on_purpose.py"
  test.write_text(textwrap.dedent("""
      from tests import seeding

      def test_draw():
        value = seeding.rng().random()
        assert value < 0, f"drew {value!r}"
  """))
  p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.seeding", str(test)],
                     cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 1, p.stdout + p.stderr
  seed = int(re.search(r"inputs seeded by the test id: seed (\d+)", p.stdout).group(1))
  drawn = float(re.search(r"drew ([0-9.e-]+)", p.stdout).group(1))
  assert np.random.default_rng(seed).random() == drawn
  assert "replay: python -m pytest 'test_fails_on_purpose.py::test_draw'" in p.stdout
