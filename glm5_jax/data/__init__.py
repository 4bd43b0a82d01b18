"""Data: tokenizers, corpus -> ArrayRecord shards, grain pipelines with packing."""
