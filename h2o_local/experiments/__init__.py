"""Reproductions of the H2O experiments on GGUF models (see docs/experiments.md)."""
