"""h2o-local serve: an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health).

Requests run in slots decoded together, each with its own bounded cache; a conversation that a client resends with
new messages continues its saved cache (only the new messages are fed). Listens on 127.0.0.1 by default.
"""
from __future__ import annotations

import argparse

from .common import add_model_args, load_llama


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="h2o-local serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--slots", type=int, default=4, help="requests decoded at once (default: 4)")
    ap.add_argument("--max-waiting", type=int, default=16, help="requests that may wait for a slot; more get 429")
    ap.add_argument("--session-mib", type=float, default=256,
                    help="memory for saved conversations continued by later requests, MiB (0: off; default 256)")
    ap.add_argument("--model-id", help="the model name /v1/models shows (default: the file name)")
    ap.add_argument("--max-prompt-tokens", type=int,
                    help="longer prompts get HTTP 400 (default: the model's trained context)")
    add_model_args(ap, budget=512, keep_default="system")
    args = ap.parse_args(argv)
    try:
        import uvicorn

        from ..server import create_app
    except ImportError as e:
        ap.error(f"the server needs its extra: pip install \"h2o_local[server]\" ({e})")
    if args.slots < 1 or args.max_waiting < 0 or args.session_mib < 0:
        ap.error("--slots must be >= 1, --max-waiting and --session-mib >= 0")
    if not 0 <= args.port <= 65535:
        ap.error(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    llm = load_llama(ap, args, n_seq_max=args.slots, kv_unified=False)
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        ap.error("--max-prompt-tokens must be >= 1")
    app = create_app(llm, model_id=args.model_id, max_waiting=args.max_waiting,
                     session_bytes=int(args.session_mib * 2**20), max_prompt_tokens=args.max_prompt_tokens)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
