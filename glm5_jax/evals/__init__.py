"""Evaluations of trained models (long_context: loss by position, passkey retrieval;
mtp_acceptance: how many MTP drafts greedy speculative decoding accepts)."""
