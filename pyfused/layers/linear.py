"""Tensor-parallel linear layers (written next)."""
