"""Lightning indexer (DSA): scores I[t, s] and the deterministic causal top-k."""

from pallas_kernels.lightning_indexer.api import topk_indices
from pallas_kernels.lightning_indexer.xla import causal_limit
from pallas_kernels.lightning_indexer.xla import deterministic_topk
from pallas_kernels.lightning_indexer.xla import index_scores
from pallas_kernels.lightning_indexer.xla import topk_indices_xla

__all__ = ["topk_indices", "causal_limit", "index_scores", "topk_indices_xla", "deterministic_topk"]
