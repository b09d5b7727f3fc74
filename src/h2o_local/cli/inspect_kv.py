"""h2o-local inspect: which tokens each policy keeps, as a self-contained HTML page and a PNG heat map.

    h2o-local inspect article.txt --policies h2o-64 sink-64 tova-64 --html kept.html --png kept.png
"""
from __future__ import annotations

import os
import re
import sys

from ..inspector import inspect_text, to_html, to_png
from ..models import default_model_path
from .common import Parser, PromptProgress, add_llama_cpp_compat_args


def parser() -> Parser:
    ap = Parser("h2o-local inspect", __doc__)
    ap.add_argument("text", help="the prompt, or a text file to read it from")
    ap.add_argument("-m", "--model", help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--policies", nargs="+", default=["h2o-64", "sink-64"],
                    help="policy labels NAME-BUDGET[+sS] (default: h2o-64 sink-64)")
    ap.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=int, default=0, help="greedy tokens generated after the text (default: 0)")
    ap.add_argument("--chat", action="store_true", help="wrap the text in the chat template as a user message")
    ap.add_argument("--recall", action="store_true", help="evicted entries wait in host memory (shown underlined); "
                    "needs a policy with the question probe, such as the default's label")
    ap.add_argument("--question", help="a prompt fed after the text (and the generated tokens): with --recall it "
                    "brings back what it asks about")
    ap.add_argument("--html", default="kept.html", help="HTML page to write (default: kept.html)")
    ap.add_argument("--png", default="kept.png", help="PNG heat map to write (default: kept.png; needs matplotlib)")
    ap.add_argument("-t", "--threads", type=int, help="CPU threads (default: the physical cores)")
    add_llama_cpp_compat_args(ap)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    text = args.text
    try:
        if os.path.isfile(text):
            path = text
            with open(path, encoding="utf-8") as f:
                try:
                    text = f.read()
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        elif os.path.isdir(text):
            raise ValueError(f"{text} is a directory: give a text file (or the text itself)")
        elif _looks_like_a_path(text):
            raise ValueError(f"{text}: no such file (to inspect this text itself, add a space or a newline to it)")
        if args.max_tokens < 0:
            raise ValueError("--max-tokens must be >= 0")
        progress = PromptProgress()
        inspections = inspect_text(args.model or default_model_path(), text, args.policies, max_tokens=args.max_tokens,
                                   n_threads=args.threads, chat=args.chat, recall=args.recall,
                                   question=args.question,
                                   progress=lambda label, fed, total: progress(fed, total, f"the text with {label}"))
        progress.clear()
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(to_html(inspections, title=f"h2o_local inspect: {', '.join(i.label for i in inspections)}"))
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        ap.error(str(e))
    print(f"wrote {args.html}", file=sys.stderr)
    if args.png:
        try:
            to_png(inspections, args.png)
            print(f"wrote {args.png}", file=sys.stderr)
        except ImportError:
            print('no PNG: matplotlib is not installed (pip install "h2o_local[inspect]")', file=sys.stderr)
        except OSError as e:
            print(f"h2o-local inspect: error: no PNG: {e}", file=sys.stderr)
            return 1
    for ins in inspections:
        held = " (held by at least one layer's KV head)" if ins.head_share is not None else ""
        host = f", {int(ins.in_host.sum())} in host memory" if ins.in_host is not None else ""
        print(f"{ins.label}: kept {int(ins.kept.sum())} of {ins.n_tokens} tokens{held}, evicted {ins.n_evicted}{host}")
    return 0


def _looks_like_a_path(text: str) -> bool:
    """One word that names a file (a folder in it, or an extension): a misspelt file name, not a prompt."""
    return bool(re.fullmatch(r"\S+", text)) and ("/" in text or os.sep in text or bool(re.search(r"\.[A-Za-z0-9]{1,5}$", text)))
