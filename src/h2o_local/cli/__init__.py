"""The `h2o-local` command (also `python -m h2o_local`).

    h2o-local [--budget 64] [--prompt TEXT]    generate once with a bounded cache (the default command)
    h2o-local chat [--system TEXT]             chat in the terminal; the cache is kept across turns
    h2o-local serve [--port 8000]              an OpenAI-compatible server (pip install "h2o_local[server]")
    h2o-local inspect TEXT|FILE --policy ...   which tokens each policy keeps, as HTML and PNG
    h2o-local rpc-server [--port 50052]        lend this machine's CPU to another one's model (llama.cpp RPC)
"""
from __future__ import annotations

import sys
import warnings
from typing import List, Optional

COMMANDS = ("generate", "chat", "serve", "inspect", "rpc-server")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "generate"
    if command == "chat":
        from .chat import main as run
    elif command == "serve":
        from .serve import main as run
    elif command == "inspect":
        from .inspect_kv import main as run
    elif command == "rpc-server":
        from .rpc_server import main as run
    else:
        from .generate import main as run
    warnings.showwarning = _one_line_warning
    try:
        return run(argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library warning as llama.cpp's tools print theirs: one line, no source location."""
    print(f"h2o-local: warning: {message}", file=sys.stderr if file is None else file)
