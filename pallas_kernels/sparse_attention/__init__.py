"""Sparse MLA attention (DSA) in the absorbed (MQA) form over gathered top-k rows."""

from pallas_kernels.sparse_attention.api import sparse_mla
from pallas_kernels.sparse_attention.xla import attend_logits
from pallas_kernels.sparse_attention.xla import sparse_mla_dense_oracle
from pallas_kernels.sparse_attention.xla import sparse_mla_xla

__all__ = ["sparse_mla", "sparse_mla_xla", "sparse_mla_dense_oracle", "attend_logits"]
