"""Evaluations of trained models (long_context: loss by position, passkey retrieval)."""
