"""Pallas kernels for DeepSeek Sparse Attention (DSA), with their XLA (plain jnp) paths.

  lightning_indexer.topk_indices   indexer scores + deterministic causal top-k
  sparse_attention.sparse_mla      absorbed-MLA attention over gathered top-k rows

Each op dispatches on `impl`: "xla" is the chunked jnp path (the CPU default and
the oracle every kernel is tested against), "pallas" the TPU/GPU kernels.
"""

from pallas_kernels import lightning_indexer
from pallas_kernels import sparse_attention

__all__ = ["lightning_indexer", "sparse_attention"]
