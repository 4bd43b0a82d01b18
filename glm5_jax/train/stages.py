"""The training stages as data: one `Stage` row per stage (see `train/step.py`).

Kept apart from the step so that what a stage computes can be read (e.g. by
`train/flops.py`) without the optimizer stack: this module imports nothing
but the standard library.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Stage:
  attention: str          # "dense" | "sparse"
  trains: str             # "all" | "all_but_indexer" | "indexer"
  lm_loss: bool           # next-token CE + MTP
  indexer_kl: bool        # the indexer's KL loss (dense in dense stages, sparse otherwise)
  data: str = "corpus"    # the batch source: "corpus": tokenized documents (data/corpus.py);
                          # "conversations": chat records with loss masks (data/sft.py);
                          # "rollouts": the synchronous GRPO loop (rl/orchestration/grpo.py);
                          # "streams": the asynchronous rollout workers
                          # (rl/orchestration/async_loop.py)
  loss: str = "lm"        # a key of LOSSES


STAGE_TABLE = {
    "pretrain": Stage("dense", "all_but_indexer", lm_loss=True, indexer_kl=False),
    "midtrain": Stage("dense", "all_but_indexer", lm_loss=True, indexer_kl=False),
    "dsa_warmup": Stage("dense", "indexer", lm_loss=False, indexer_kl=True),
    "dsa_sparse": Stage("sparse", "all", lm_loss=True, indexer_kl=True),
    "sft": Stage("sparse", "all", lm_loss=True, indexer_kl=True, data="conversations"),
    "rl": Stage("sparse", "all_but_indexer", lm_loss=False, indexer_kl=False, data="rollouts",
                loss="icepop_grpo"),
    "rl_async": Stage("sparse", "all_but_indexer", lm_loss=False, indexer_kl=False,
                      data="streams", loss="double_sided_is"),
}
STAGES = tuple(STAGE_TABLE)


def get_stage(stage: str) -> Stage:
  if stage not in STAGE_TABLE:
    raise ValueError(f"config.stage={stage!r}: expected one of {STAGES}")
  return STAGE_TABLE[stage]
