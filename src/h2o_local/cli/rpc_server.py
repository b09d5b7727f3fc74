"""h2o-local rpc-server: lend this machine's CPU to a model loaded elsewhere (llama.cpp's RPC backend).

On the machine that runs the model: `Llama(path, rpc_servers=["HOST:PORT"], n_gpu_layers=N)` (or `--rpc HOST:PORT`
with `--n-gpu-layers N`) puts N layers here; scores and eviction work as on one machine. The protocol has no
authentication or encryption: listen on 127.0.0.1 or a trusted network only. Ctrl-C stops the server; a process
using it then stops too at its next step (llama.cpp's RPC client aborts when its server goes away).
"""
from __future__ import annotations

import os
import signal
import sys

from .common import Parser


def parser() -> Parser:
    """llama.cpp's rpc-server flags (-H, -p, -t)."""
    ap = Parser("h2o-local rpc-server", __doc__)
    ap.add_argument("-H", "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    ap.add_argument("-p", "--port", type=int, default=50052, help="(default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for the layers served here")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if not 0 < args.port < 65536 or not 1 <= args.threads <= 512:
        ap.error("--port must be in 1..65535 and --threads in 1..512 (ggml's most threads)")
    from .. import rpc

    # the server loop runs in C and never returns to Python: let Ctrl-C end the process as it would any C server
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"WARNING: listening on {args.host}, not 127.0.0.1: anyone who can reach this port can run code on "
              f"this machine's backend. llama.cpp's RPC protocol has no authentication or encryption; never expose it "
              f"to an open network.", file=sys.stderr, flush=True)
    print(f"h2o-local rpc-server: serving this CPU on {args.host}:{args.port} ({args.threads} threads)", flush=True)
    rpc.serve(f"{args.host}:{args.port}", args.threads)
    return 1  # only reached when the server could not start (its reason is printed above)
