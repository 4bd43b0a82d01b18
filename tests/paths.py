"""The repository root, found from any test file however deep it sits (subprocess tests run
`python -m ...` there)."""

import pathlib

ROOT = next(str(p) for p in pathlib.Path(__file__).resolve().parents
            if (p / "setup.py").exists())
