"""Sparse MLA attention (DSA) in the absorbed (MQA) form over gathered top-k rows."""

from pallas_kernels.sparse_attention.api import sparse_mla
from pallas_kernels.sparse_attention.reference import sparse_mla_reference
from pallas_kernels.sparse_attention.reference import sparse_mla_dense_oracle

__all__ = ["sparse_mla", "sparse_mla_reference", "sparse_mla_dense_oracle"]
