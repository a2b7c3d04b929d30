"""Attention backends over cascade plans."""
