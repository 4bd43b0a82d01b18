"""absl entry points whose config overrides name what is wrong.

`_CONFIG = cli.define_config("configs/x.py", lock_config=True)` and
`app.run(main, flags_parser=cli.parse_flags)`: an override of a field the config does not
have (`--config.rl.task_options.nosuch=1`) stops with one line naming the flag and the
fields that exist there, instead of ml_collections' bare `AttributeError: "'nosuch'"`.
"""

from __future__ import annotations

import sys

from absl import flags


def _missing(config, path: list[str]) -> str | None:
  node, where = config, "config"
  for k in path:
    if not hasattr(node, "keys"):
      return f"{where} is a {type(node).__name__}, not a section with fields"
    if k not in node:
      return f"{where} has no field {k!r}; its fields: {sorted(node.keys())}"
    node, where = node[k], f"{where}.{k}"
  return None


def _load(argv: list[str]):
  """The config of the command's --config=FILE[:ARG] (ml_collections' own loader), or None."""
  from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if spec is None:                              # the flag's default: its file's config
    return flags.FLAGS["config"].default if "config" in flags.FLAGS else None
  try:
    return config_flags._ConfigFileParser(name="config").parse(spec)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return None


def _explain(argv: list[str], config, e: Exception):
  for arg in argv[1:]:
    name = arg.split("=", 1)[0].lstrip("-")
    if config is not None and name.startswith("config."):
      why = _missing(config, name.split(".")[1:])
      if why:
        sys.exit(f"{arg}: {why}")
  sys.exit(f"bad --config override ({type(e).__name__}: {e})")


def define_config(default: str, **kwargs):
  """`config_flags.DEFINE_config_file("config", default, ...)`, which already applies the
  command line's overrides when it has no --config (ml_collections reads sys.argv then)."""
  from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top
  try:
    return config_flags.DEFINE_config_file("config", default, **kwargs)
  except (AttributeError, KeyError) as e:
    _explain(sys.argv, config_flags._ConfigFileParser(name="config").parse(default), e)  # pylint: disable=protected-access


def parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    _explain(argv, _load(argv), e)
