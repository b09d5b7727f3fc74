"""h2o-local [generate]: H2O generation with a bounded KV cache (default model: SmolLM2-135M-Instruct).

    python -m h2o_local --budget 64 --prompt "Write a short story about a lighthouse."
"""
from __future__ import annotations

import argparse
import sys
import time

from ..backends import where_layers_run
from ..policies import OPTIONS
from ..sampling import GENERATE
from .common import (Parser, PromptProgress, add_llama_cpp_compat_args, add_model_args, add_penalty_args,
                     add_sampler_args, load_llama, penalty_kwargs, read_prompt_file, sampler_kwargs)

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def parser() -> Parser:
    ap = Parser("h2o-local", __doc__ + "\nOther commands: chat, serve, inspect, rpc-server (h2o-local COMMAND --help).")
    text = ap.add_mutually_exclusive_group()
    text.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="the prompt (default: a short story's opening)")
    text.add_argument("-f", "--file", metavar="PATH", help="a text file to read the prompt from")
    ap.add_argument("-sys", "--system-prompt", "--system", dest="system", help="a system message (with --chat)")
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                    help="wrap the prompt with the model's chat template (default: on)")
    ap.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=int, default=256,
                    help="tokens to generate at most (default: %(default)s)")
    ap.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy")
    add_sampler_args(ap, GENERATE)
    add_penalty_args(ap)
    add_model_args(ap, budget=64)
    add_llama_cpp_compat_args(ap)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    prompt = read_prompt_file(ap, args.file) if args.file else args.prompt
    if args.system is not None and not args.chat:
        ap.error("--system-prompt needs the chat template (drop --no-chat)")

    llm = load_llama(ap, args)
    progress = PromptProgress()
    try:
        if args.chat:
            system = [] if args.system is None else [{"role": "system", "content": args.system}]
            tokens, n_keep = llm.chat_tokens(system + [{"role": "user", "content": prompt}])
        else:
            tokens, n_keep = llm.tokenize(prompt, add_bos=llm.info.add_bos), None
        events = llm.generate_events(tokens, max_tokens=args.max_tokens, temperature=args.temperature, keep=n_keep,
                                     progress=progress, **penalty_kwargs(args), **sampler_kwargs(args))
    except (ValueError, TypeError) as e:
        ap.error(str(e))

    t0 = time.perf_counter()
    try:
        for e in events:
            progress.clear()
            sys.stdout.write(e.text)
            sys.stdout.flush()
    except (ValueError, RuntimeError) as e:
        progress.clear()
        print(f"\n{ap.prog}: error: {e}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    st = llm.kv_state()
    print(f"\n\n[h2o_local] policy={llm.policy.name} budget={llm.budget} (sinks={llm.sinks} heavy={llm.heavy} "
          f"recent={llm.recent}{_probe_text(llm.policy)}) prompt={len(tokens)} tokens, seen={st.n_seen}, kept={st.n_cells}, "
          f"evicted={st.n_evicted}, peak={st.peak_cells} entries, KV allocated={st.kv_bytes / 2**20:.2f} MiB "
          f"({st.kv_cells} cells) on {where_layers_run(llm.layer_devices)}, flash attention {'on' if llm.flash_attn else 'off'}, "
          f"{dt:.1f} s", file=sys.stderr)
    return 0


def _probe_text(policy) -> str:
    """The probe and each option given (OPTIONS: declared once in C++), as `probe=question/32 pool=9 reply`."""
    probe = getattr(policy, "probe", None)
    text = f" probe={probe}" + (f"/{policy.question}" if probe == "question" else "") if probe else ""
    for option in OPTIONS:
        value = getattr(policy, option["name"], None)
        if value:
            text += f" {option['name']}" + ("" if option["flag"] else f"={value}")
    return text
