"""Benchmark rows: one row per point, a failing point an error row, the JSON rewritten after each.

A run cut short by a time limit (the device checks in WORKSPACE.md) then still leaves
every row it finished.
"""

import json


def measure_rows(name: str, points, measure, describe, out: str, meta: dict) -> list:
  """[measure(p) for p in points], each printed by describe(row) or as an error row {name: p}.

  Writes dict(meta, rows=rows) to `out` (if given) after every row.
  """
  rows = []
  for point in points:
    try:
      row = measure(point)
      print(describe(row), flush=True)
    except Exception as e:  # pylint: disable=broad-except
      row = {name: point, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
      print(f"  {name} {point}: FAILED {row['error']}", flush=True)
    rows.append(row)
    if out:
      with open(out, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
  if out:
    print(f"wrote {out}")
  return rows
