"""Lightning indexer (DSA): scores I[t, s] and the deterministic causal top-k."""

from pallas_kernels.lightning_indexer.api import topk_indices
from pallas_kernels.lightning_indexer.reference import causal_limit
from pallas_kernels.lightning_indexer.reference import index_scores
from pallas_kernels.lightning_indexer.reference import topk_indices_reference
from pallas_kernels.lightning_indexer.reference import deterministic_topk

__all__ = ["topk_indices", "causal_limit", "index_scores", "topk_indices_reference", "deterministic_topk"]
