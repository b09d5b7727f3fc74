"""h2o-local chat: chat in the terminal with a bounded KV cache that is kept across turns.

Each turn feeds only the new message (the history stays in the cache, compressed by the policy); the system prompt
is protected from eviction by default (--keep system). Ctrl-C stops the current answer and keeps the session;
Ctrl-C at the prompt twice, Ctrl-D or /quit leaves.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import List

from ..chat_session import ChatSession
from ..text import check_text
from ..sampling import CHAT_SURFACE
from .common import (Parser, PromptProgress, add_llama_cpp_compat_args, add_model_args, add_penalty_args,
                     add_sampler_args, load_llama, penalty_kwargs, read_text_file, sampler_kwargs)

HELP = """commands:
  /file PATH    attach a text file: it goes into the conversation with your next message
  /reset        forget the conversation (the system prompt stays)
  /stats        the cache and the last answer
  /save FILE    write the conversation and its KV cache to FILE
  /load FILE    continue a conversation saved with /save (same model and cache settings)
  /help         this text
  /quit         leave (also Ctrl-D, or Ctrl-C twice)"""


def parser() -> Parser:
    ap = Parser("h2o-local chat", __doc__)
    ap.add_argument("-sys", "--system-prompt", "--system", dest="system",
                    help="system prompt (default: the chat template's, if any)")
    ap.add_argument("-p", "--prompt", help="a first message, answered before you type")
    ap.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=int, default=512,
                    help="tokens per answer at most (default: %(default)s)")
    # Ollama's defaults, chosen by measurement: the fewest looping answers (results/quality/chat-sampling-smollm2.md)
    ap.add_argument("--temperature", "--temp", type=float, default=CHAT_SURFACE.temperature,
                    help=f"0 = greedy (default: {CHAT_SURFACE.temperature:g})")
    ap.add_argument("--ignore-eos", action="store_true", help="never end an answer early (tests, benchmarks)")
    ap.add_argument("--hide-thinking", "--hidethinking", action="store_true",
                    help="a thinking model's reasoning is not shown, only its answer (as Ollama's --hidethinking)")
    ap.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                    help="ask the template to think or not (its enable_thinking: Qwen3 thinks unless told not to, "
                         "Gemma 4 only when told to; as Ollama's --think); default: the template's own")
    ap.add_argument("-f", "--file", action="append", default=[], metavar="PATH",
                    help="a text file attached to the first message (repeat for several; /file in the chat)")
    add_sampler_args(ap, CHAT_SURFACE)
    add_penalty_args(ap, repeat_penalty=CHAT_SURFACE.repeat_penalty)
    add_model_args(ap, budget=512, keep_default="system", recall_default=True)
    add_llama_cpp_compat_args(ap)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    llm = load_llama(ap, args)
    try:
        # the recall setting is the command line's, which load_llama applied ("auto" keeps it, whatever its cap)
        session = ChatSession(llm, system=args.system, recall="auto" if llm.recall else False,
                              max_tokens=args.max_tokens, temperature=args.temperature,
                              ignore_eos=args.ignore_eos, **penalty_kwargs(args), **sampler_kwargs(args),
                              chat_template_kwargs=None if args.think is None else {"enable_thinking": args.think})
        llm.chat_template.render([{"role": "user", "content": "hi"}])  # a model without a template: say so now
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    _setup_readline()
    budget = "full cache" if llm.budget is None else f"budget {llm.budget} tokens"
    print(f"h2o_local chat: {llm.policy.label}, {budget}, keep={args.keep}. /help for commands, Ctrl-D to quit.",
          file=sys.stderr)
    chat = Chat(session, hide_thinking=args.hide_thinking)
    for path in args.file:
        if not chat.attach(path):
            return 2
    if args.prompt:
        print(f">>> {args.prompt}")
        chat.answer(args.prompt)
    interrupted = False
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            if interrupted:
                print(file=sys.stderr)
                return 0
            interrupted = True
            print("\n(Ctrl-C again or Ctrl-D to quit)", file=sys.stderr)
            continue
        interrupted = False
        text = line.strip()
        if not text:
            continue
        if text.startswith("/file"):
            chat.attach(text[len("/file"):].strip())
            continue
        if text.startswith("/"):
            if _command(session, text) == "quit":
                return 0
            continue
        chat.answer(line)


class Chat:
    """The terminal's side of a conversation: documents attached for the next message."""

    def __init__(self, session: ChatSession, hide_thinking: bool = False):
        self.session = session
        self.hide_thinking = hide_thinking
        self.attached: List[str] = []

    def attach(self, path: str) -> bool:
        if not path:
            print("usage: /file PATH", file=sys.stderr)
            return False
        try:
            text = read_text_file(path)
            check_text("the file", text)
        except (OSError, ValueError) as e:
            reason = f"not UTF-8 text ({e.reason} at byte {e.start})" if isinstance(e, UnicodeDecodeError) else \
                e.strerror if isinstance(e, OSError) and e.strerror else e
            print(f"error: cannot attach {path}: {reason}", file=sys.stderr)
            return False
        self.attached.append(f"Document {os.path.basename(path)}:\n{text.strip()}")
        n = len(self.session.llm.tokenize(text, add_bos=False))
        print(f"(attached {path}: {n} tokens; it goes with your next message)", file=sys.stderr)
        return True

    def answer(self, line: str) -> None:
        content = "\n\n".join(self.attached + [line])
        self.attached = []
        with _typing_unechoed():
            _answer(self.session, content, _AnswerWriter(sys.stdout, self.hide_thinking))


@contextlib.contextmanager
def _typing_unechoed():
    """While an answer streams, what the user types is not echoed into it (the terminal's echo is off); it stays
    typed ahead for the next prompt, as in a shell."""
    before = None
    try:
        import termios
    except ImportError:  # not a POSIX terminal (Windows)
        termios = None
    if termios is not None:
        try:
            fd = sys.stdin.fileno()
            before = termios.tcgetattr(fd) if os.isatty(fd) else None
        except (OSError, ValueError, termios.error):  # stdin closed or replaced
            before = None
    if before is None:
        yield
        return
    quiet = list(before)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, before)


class _AnswerWriter:
    """The answer on stdout; a thinking model's reasoning before it between "Thinking..." and "...done thinking.",
    dimmed in a terminal (as Ollama's chat shows it), or left out."""

    def __init__(self, out, hide_thinking: bool):
        self.out = out
        self.hide_thinking = hide_thinking
        self.dim = out.isatty() and os.environ.get("TERM") != "dumb"
        self.thinking = False

    def write(self, thought: str, text: str) -> None:
        if thought and not self.hide_thinking:
            if not self.thinking:
                self._aside("Thinking...\n")
                self.thinking = True
            self._aside(thought)
        if text:
            self.end_thinking()
            self.out.write(text)
        self.out.flush()

    def end_thinking(self) -> None:
        if self.thinking:
            self._aside("\n...done thinking.\n\n")
            self.thinking = False

    def _aside(self, text: str) -> None:
        self.out.write(f"\033[2m{text}\033[0m" if self.dim else text)


def _answer(session: ChatSession, line: str, out: _AnswerWriter) -> None:
    pieces = iter(())
    progress = PromptProgress()
    try:
        pieces = session.send_split(line, progress=progress)
        for thought, text in pieces:
            progress.clear()
            out.write(thought, text)
        note = ""
    except KeyboardInterrupt:
        progress.clear()
        note = " · stopped"
    except (ValueError, RuntimeError) as e:
        note = ""
        print(f"\nerror: {e}", file=sys.stderr)
    finally:
        getattr(pieces, "close", lambda: None)()
        out.end_thinking()
    print()
    s = session.stats()
    budget = "" if s["budget"] is None else f"/{s['budget']}"
    host = f" · host {s['host_entries']} · recalled {s['recalled']}" if "host_entries" in s else ""
    print(f"[kv {s['kv_entries']}{budget} · evicted {s['evicted']}{host} · {s['completion_tokens']} tokens, "
          f"{s['tokens_per_second']} tok/s · prompt {s['prompt_tokens']} fed, {s['reused_tokens']} reused{note}]",
          file=sys.stderr)


def _command(session: ChatSession, text: str) -> str:
    name, _, arg = text.partition(" ")
    arg = arg.strip()
    try:
        if name in ("/quit", "/exit", "/bye"):
            return "quit"
        if name == "/help":
            print(HELP, file=sys.stderr)
        elif name == "/reset":
            session.reset()
            print("(conversation forgotten)", file=sys.stderr)
        elif name == "/stats":
            for key, value in session.stats().items():
                shown = f"{value / 2**20:.1f} MiB" if key.endswith("_bytes") else value
                print(f"  {key.removesuffix('_bytes')}: {shown}", file=sys.stderr)
        elif name in ("/save", "/load"):
            if not arg:
                print(f"usage: {name} FILE", file=sys.stderr)
            elif name == "/save":
                n = session.save(arg)
                s = session.stats()
                held = f", {s['host_entries']} entries waiting in host memory for recall" if "host_entries" in s else ""
                print(f"(saved {len(session.messages)} messages, {s['kv_entries']} KV entries{held} to {arg}: "
                      f"{n / 2**20:.1f} MiB)", file=sys.stderr)
            else:
                session.load(arg)
                print(f"(loaded {arg}: {len(session.messages)} messages, {session.stats()['kv_entries']} KV entries)",
                      file=sys.stderr)
        else:
            print(f"unknown command {name}: /help lists them", file=sys.stderr)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
    return ""


def _setup_readline() -> None:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
