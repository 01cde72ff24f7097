"""Encoder disaggregation: encode workers apart from prefill/decode (issue 12, in progress)."""
