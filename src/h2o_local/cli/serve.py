"""h2o-local serve: an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/responses,
/v1/embeddings, /v1/models, /health), with Anthropic's /v1/messages, Ollama's /api/* and llama-server's /completion and /infill, and a chat page
at /.

Requests run in slots decoded together, each with its own bounded cache; a conversation that a client resends with
new messages continues its saved cache (only the new messages are fed). Listens on 127.0.0.1 by default. Every
server option can also be set as H2O_LOCAL_<OPTION> in the environment (H2O_LOCAL_SLOTS=8).
"""
from __future__ import annotations

import logging
import os
import sys
import typing

from ..backends import where_layers_run

from ..embeddings import POOLING_NAMES
from .common import Parser, add_llama_cpp_compat_args, add_model_args, load_llama


# llama-server's spellings of the same settings
LLAMA_SERVER_FLAGS = {"slots": ("-np", "--parallel"), "model_id": ("-a", "--alias"), "max_tokens": ("-n", "--n-predict"),
                      "seed": ("-s",)}


def parser() -> Parser:
    ap = Parser("h2o-local serve", __doc__)
    try:
        import uvicorn  # noqa: F401

        from ..server import ServerSettings
    except ImportError as e:
        ap.error(f"the server needs its extra: pip install \"h2o_local[server]\" ({e})")
    g = ap.add_argument_group("server")
    for name, field in ServerSettings.model_fields.items():
        kind = next((t for t in typing.get_args(field.annotation) if t is not type(None)), field.annotation)
        shown = "" if "default" in field.description else f" (default: {field.default})"
        flags = ["--" + name.replace("_", "-"), *LLAMA_SERVER_FLAGS.get(name, ())]
        g.add_argument(*flags, dest=name, type=kind, default=None, help=field.description + shown)
    add_model_args(ap, budget=512, keep_default="system", recall_default=True, seed_flag=False)  # --seed: settings
    ap.add_argument("--export-scores", action="store_true", help="export attention scores even when the policy does "
                    "not rank by them: conversations may then choose a scoring policy (kv_cache.policy), and the web "
                    "page shades what a policy that keeps no scores kept (a few percent of speed)")
    ap.add_argument("--pooling", choices=list(POOLING_NAMES), help="how the embedding routes pool a text's last "
                    "hidden states (llama.cpp's --pooling; default: the model's own, mean where it names none; none: "
                    "a vector per token, answered by /embeddings only)")
    ap.add_argument("--metrics", action="store_true", help="llama-server's flag, accepted: /metrics is always served "
                    "here (behind the API key when one is set)")
    add_llama_cpp_compat_args(ap)
    return ap


def main(argv=None) -> int:
    ap = parser()
    from pydantic import ValidationError

    from ..server import ServerSettings, create_app, listener

    args = ap.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k in ServerSettings.model_fields and v is not None}
    try:
        settings = ServerSettings(**given)
    except ValidationError as e:
        first = e.errors()[0]
        ap.error(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}")
    llm = load_llama(ap, args, n_seq_max=settings.slots, kv_unified=False, export_scores=args.export_scores,
                     pooling_type=POOLING_NAMES.get(args.pooling, -1))
    app = create_app(llm, settings)
    _log_requests()
    print(banner(llm, settings), file=sys.stderr, flush=True)
    listener.serve(app, host=settings.host, port=settings.port, log_level="info")
    return 0


def banner(llm, settings) -> str:
    """What is served, where, and with what cache: the first lines a server prints (as llama-server's)."""
    budget = "the full cache" if llm.budget is None else f"budget {llm.budget} tokens per conversation"
    recall = ", recall on" if llm.recall else ""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    where = f"http://{host}:{settings.port}/" if settings.port else f"http://{host}:<a free port, named below>/"
    return (f"h2o-local serve: {os.path.basename(llm.model_path)} on {where_layers_run(llm.layer_devices)}, "
            f"policy {llm.policy.label}, {budget}{recall}, {settings.slots} slots, "
            f"KV {llm.kv_state().kv_bytes / 2**20:.1f} MiB\n"
            f"h2o-local serve: the chat page at {where}, APIs under {where}v1 (OpenAI, Anthropic), {where}api "
            f"(Ollama), {where}completion (llama-server)")


def _log_requests() -> None:
    """The server's own lines (one per finished request, warnings) beside uvicorn's, in its format."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("h2o_local")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
