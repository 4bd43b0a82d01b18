"""Helpers shared by config files (big_vision style `get_config(arg)`)."""

from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'k1=v1,k2=v2' into a ConfigDict, typed by `defaults`; unknown keys fail.

  Example: `--config=configs/model_summary.py:model=glm5`.
  """
  out = ml_collections.ConfigDict(defaults)
  if not arg:
    return out
  for item in arg.split(","):
    if "=" not in item:
      raise ValueError(f"config argument {item!r}: expected key=value (known keys: "
                       f"{sorted(defaults)})")
    k, v = item.split("=", 1)
    if k not in defaults:
      raise ValueError(f"config argument {k!r} is unknown; expected one of {sorted(defaults)}")
    d = defaults[k]
    if isinstance(d, bool):
      if v not in ("True", "False", "true", "false", "1", "0"):
        raise ValueError(f"config argument {k}={v!r}: expected True or False")
      out[k] = v in ("True", "true", "1")
    else:
      out[k] = type(d)(v)
  return out
