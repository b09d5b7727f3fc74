"""Reproductions of the H2O experiments on GGUF models (docs/experiments.md). They use only h2o_local's public API
and run from the repository root: `python -m experiments.summarization --help`."""
