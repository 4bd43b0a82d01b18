"""Tables and figures of the long-context evaluation (glm5_jax/evals/long_context.py).

  results = {name: long_context.evaluate(cfg, params, data_dir) for ...}   # a model per name
  print(format_tables(results)); plot(results, "long_context.png")

`experiments/eval_long_context.py` writes both for workdirs; docs/long_context.md shows them.
"""

import numpy as np


def _loss_table(title: str, row_names, columns: dict) -> list[str]:
  """Rows of losses, one column per model, then the last column minus the first."""
  names = list(columns)
  change = len(names) > 1
  lines = [title, f"{'':<14}" + "".join(f"{n[:18]:>20}" for n in names)
           + (f"{'last-first':>12}" if change else "")]
  for i, r in enumerate(row_names):
    vals = [columns[n][i] for n in names]
    lines.append(f"{r:<14}" + "".join(f"{v:>20.4f}" for v in vals)
                 + (f"{vals[-1] - vals[0]:>+12.4f}" if change else ""))
  return lines


def format_tables(results: dict) -> str:
  """Loss by position, loss by window, and a passkey table per model."""
  names = list(results)
  pos, ctx = (results[names[0]][k] for k in ("loss_by_position", "loss_by_context"))
  edges = pos["edges"]
  lines = _loss_table(
      f"held-out loss by position of the predicted token (nats/token; {pos['documents']} "
      f"documents of {edges[-1]} tokens)",
      [f"[{lo}, {hi})" for lo, hi in zip(edges[:-1], edges[1:])],
      {n: results[n]["loss_by_position"]["loss"] for n in names})
  lines += [""] + _loss_table(
      f"held-out loss of the last {ctx['target_len']} of each document's first "
      f"{max(ctx['windows'])} tokens, by window length (nats/token)",
      [str(w) for w in ctx["windows"]],
      {n: results[n]["loss_by_context"]["loss"] for n in names})
  for n in names:
    pk = results[n]["passkey"]
    lines += ["", f"passkey exact match, {n} ({pk['per_cell']} documents per cell, "
              f"{pk['n_digits']} digits, {pk['decoding']})",
              f"{'length':<8}" + "".join(f"{f'depth {d:.0%}':>12}" for d in pk["depths"])
              + f"{'mean':>8}{'digits':>8}"]
    for i, length in enumerate(pk["lengths"]):
      ex = pk["exact"][i]
      lines.append(f"{length:<8}" + "".join(f"{v:>12.2f}" for v in ex)
                   + f"{np.mean(ex):>8.2f}{np.mean(pk['digits'][i]):>8.2f}")
  return "\n".join(lines)


def plot(results: dict, path: str) -> None:
  """Loss-by-position curves (all models) and one passkey exact-match heatmap per model."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = list(results)
  fig, axes = plt.subplots(1, 2 + len(names), figsize=(10 + 3.6 * len(names), 3.8),
                           layout="constrained",
                           gridspec_kw={"width_ratios": [1.3, 1.3] + [1] * len(names)})
  ax = axes[0]
  for n in names:
    r = results[n]["loss_by_position"]
    mids = [(lo + hi) / 2 for lo, hi in zip(r["edges"][:-1], r["edges"][1:])]
    ax.plot(mids, r["loss"], "o-", label=n)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("position of the predicted token (bucket middle)")
  ax.set_ylabel("held-out loss (nats/token)")
  ax.legend(fontsize=8)
  ax = axes[1]
  for n in names:
    r = results[n]["loss_by_context"]
    ax.plot(r["windows"], r["loss"], "o-", label=n)
  ax.set_xscale("log", base=2)
  ax.set_xlabel(f"window (tokens) ending at token {max(r['windows'])}")
  ax.set_ylabel(f"loss of the last {r['target_len']} tokens (nats/token)")
  ax.legend(fontsize=8)
  for k, (ax, n) in enumerate(zip(axes[2:], names)):
    pk = results[n]["passkey"]
    im = ax.imshow(np.asarray(pk["exact"]), vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for (i, j), v in np.ndenumerate(np.asarray(pk["exact"])):
      ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
              color="white" if v < 0.5 else "black")
    ax.set_xticks(range(len(pk["depths"])), [f"{d:.0%}" for d in pk["depths"]])
    ax.set_yticks(range(len(pk["lengths"])), [str(x) for x in pk["lengths"]])
    ax.set_xlabel("passkey depth")
    if k == 0:
      ax.set_ylabel("document length (tokens)")
    ax.set_title(f"passkey exact match: {n}", fontsize=9)
  fig.colorbar(im, ax=axes[2:].tolist(), shrink=0.8)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
