"""Reproductions of the H2O experiments on GGUF models (see docs/experiments.md)."""
from __future__ import annotations

import argparse


def experiment_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The command line every experiment starts from: `--input-path` (a jsonl of ../shared/data) and `--model` (a
    GGUF file; default SmolLM2-135M-Instruct), with the module's docstring as its help."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-path", required=True)
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct, fetched with pip)")
    return ap
