"""A conversation that keeps its KV cache across turns: each turn feeds only what is new.

The cache holds (compressed by the policy) everything fed so far: the rendered prompt of the first turn, each answer,
and each later turn. A new turn renders the whole conversation with the chat template; when that text extends what
was fed, only the extension is tokenized and fed (`reset=False`); when it does not (a template that rewrites
history), the conversation is fed again from the start.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from . import reasoning
from .backends import where_layers_run
from .chat_template import Message, check_variables, normalize_messages
from .completions import answer_markup, prompt_end
from .llama import RECALL_DEFAULT_BYTES, Llama, Snapshot
from .sampling import CHAT
from .sessions import Session, common_prefix, continues
from .text import check_text

SESSION_FORMAT = 2  # 1: "fed_text" instead of "tokens" (loaded, then fed again from the start)
MAX_SESSION_JSON_BYTES = 256 * 2**20  # the conversation's text


@dataclass
class TurnStats:
    """What the last turn did."""

    prompt_tokens: int = 0        # tokens fed for this turn's prompt
    reused_tokens: int = 0        # tokens of the conversation already in the cache (not fed again)
    completion_tokens: int = 0
    seconds: float = 0.0          # the answer's wall time, prompt included
    first_token_seconds: float = 0.0  # until the first token was drawn: the prompt read (time to first token)
    finish_reason: Optional[str] = None

    @property
    def tokens_per_second(self) -> float:
        """The answer's decoding speed, the prompt left out (llama.cpp's "eval" rate): the tokens after the first
        over the time after it."""
        decoding = self.seconds - self.first_token_seconds
        return (self.completion_tokens - 1) / decoding if self.completion_tokens > 1 and decoding > 0 else 0.0


class ChatSession:
    """A chat with one `Llama` (its sequence 0), whose cache is reused from turn to turn.

    system: the system prompt (None: the template's default, if any).
    recall: what the conversation's cache evicts is kept in host memory and each new message brings back what it
        asks about (`Llama(recall=...)`, docs/recall.md), on the conversation's sequence: "auto" (the default, as
        `h2o-local chat`) where the Llama's policy can recall and the Llama keeps no recall setting of its own, True
        (ValueError where the policy cannot), an int (that many tokens), False (evicted entries are gone). Host
        memory: up to `Llama.kv_bytes_per_cell` bytes per evicted token, with "auto" or True at most the trained
        context's worth of tokens and 256 MiB (RECALL_DEFAULT_BYTES; SmolLM2-135M: 22.5 KiB a token, 8,192 tokens),
        the oldest dropped first beyond it.
    reasoning_format: how `send_split` tells a thinking model's reasoning from its answer, as the server's option:
        "auto" (the default) by the template's think tags or gpt-oss's channels, "none" not at all.
    chat_template_kwargs: more variables the template reads at every turn (`{"enable_thinking": False}` for Qwen3).
    Sampling keywords (`temperature`, `max_tokens`, ...) given here apply to every turn.
    """

    def __init__(self, llm: Llama, *, system: Optional[str] = None, recall: Union[bool, int, str] = "auto",
                 reasoning_format: str = "auto", chat_template_kwargs: Optional[Dict[str, Any]] = None,
                 **sampling: Any):
        if system is not None:
            if not isinstance(system, str):
                raise TypeError(f"system must be a string or None, got {type(system).__name__}")
            check_text("the system prompt", system)
        CHAT.replace(**sampling)  # a bad value or name raises here, not at every answer
        self.reasoning_format = reasoning.check_format(reasoning_format)
        self.chat_template_kwargs = check_variables(chat_template_kwargs)
        self.llm = llm
        self.recall: bool = self._set_recall(recall)  # whether the conversation recalls
        self.system = system
        self.sampling = dict(sampling)
        self.messages: List[Message] = []
        self.last = TurnStats()
        self._live: Optional[Session] = None    # what the cache holds now, when it holds this conversation
        self._prompt: Optional[Session] = None  # a snapshot of the last turn's prompt
        self._turn = 0  # bumped by every send / reset / load: an older answer stream may not rewrite the history
        self._stream: Optional[Iterator[str]] = None  # the last answer stream `send` returned
        self.thinking: Optional[reasoning.Thinking] = None  # how the last turn's answer splits (`send_split`)
        self.reset()

    @property
    def answer_stream(self) -> Optional[Iterator[str]]:
        """The answer stream `send` returned last (None before the first): a newer `send` ends it where it stands."""
        return self._stream

    def _set_recall(self, recall: Union[bool, int, str]) -> bool:
        if recall == "auto":
            if self.llm.recall:
                return True
            if not self.llm.policy.bounded:
                return False
            try:
                self.llm.set_recall(True, seq_id=0)
            except ValueError:  # a policy that cannot recall (no question probe, per-head cells, rolling)
                return False
            return True
        if isinstance(recall, str):
            raise ValueError(f"recall must be 'auto', True, False or a number of tokens, got {recall!r}")
        self.llm.set_recall(recall, seq_id=0)
        return bool(recall)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self._live = self._prompt = None
        self._turn += 1
        self.last = TurnStats()

    def send(self, content: str, *, progress: Optional[Callable[[int, int], None]] = None,
             **sampling: Any) -> Iterator[str]:
        """Add a user message and stream the answer's text pieces. Breaking off (Ctrl-C, `close()`) keeps the part
        of the answer already shown in the conversation, and the cache in step with it. A new `send` ends the
        previous answer's stream where it stands (its shown part stays in the history), so user and assistant
        messages alternate; a stream left open across a `reset` or `load` changes nothing when it is closed.
        A message that is not text raises here, before anything changes. `progress(fed, total)` is called between
        the pieces of a long prompt (`Llama.generate_events`)."""
        if not isinstance(content, str):
            raise TypeError(f"a message is a string, got {type(content).__name__}")
        check_text("the message", content)
        if self._stream is not None:
            self._stream.close()
        self._stream = stream = self._answer(content, {**self.sampling, **sampling}, progress)
        return stream

    def send_split(self, content: str, *, progress: Optional[Callable[[int, int], None]] = None,
                   **sampling: Any) -> Iterator[Tuple[str, str]]:
        """As `send`, each piece as (reasoning, answer text), one of them empty: a thinking model's reasoning (between
        its template's think tags, gpt-oss's analysis channel) apart from its answer, as the server's
        `reasoning_content`, which the history keeps apart too (templates drop old reasoning or place it)."""
        stream = self.send(content, progress=progress, **sampling)
        return self._split(stream)

    def _split(self, stream: Iterator[str]) -> Iterator[Tuple[str, str]]:
        splitter = None
        try:
            for piece in stream:
                if splitter is None:  # the turn's prompt is known once its first piece came
                    splitter = self.thinking.splitter() if self.thinking is not None else False
                for part in self._parts(reasoning.pieces(splitter or None, piece)):
                    yield part
            if splitter:
                for part in self._parts(splitter.end()):
                    yield part
        finally:
            stream.close()

    @staticmethod
    def _parts(pair: Tuple[str, str]) -> Iterator[Tuple[str, str]]:
        if pair[0]:
            yield pair[0], ""
        if pair[1]:
            yield "", pair[1]

    def _answer(self, content: str, params: Dict[str, Any],
                progress: Optional[Callable[[int, int], None]] = None) -> Iterator[str]:
        messages = self.messages + [{"role": "user", "content": content}]
        tokens, n_keep = self.llm.chat_tokens(messages, chat_template_kwargs=self.chat_template_kwargs)
        self.thinking = reasoning.thinking(self.reasoning_format, self.llm.chat_template.source,
                                           prompt_end(self.llm, tokens))
        shown = answer_markup(self.llm, None, self.thinking)  # the marks the split reads, as text in the answer
        params = {**params, "preserved_tokens": tuple(params.get("preserved_tokens") or ()) + shown}
        n_keep = n_keep if n_keep is not None else self.llm.keep if isinstance(self.llm.keep, int) else 0
        base = self._continued(tokens, n_keep)  # the cache state this turn goes on from, or None (from scratch)
        feed = tokens if base is None else tokens[len(base.tokens):]  # the Llama feeds its pending token first
        self.messages = messages
        self._live = None  # until this turn is in the cache as far as we know it
        self._turn += 1
        turn = self._turn
        stats = TurnStats(prompt_tokens=len(tokens) - (0 if base is None else base.n_fed),
                          reused_tokens=0 if base is None else base.n_fed)
        self.last = stats
        answer: List[str] = []
        generated: List[int] = []
        t0 = time.perf_counter()
        events = self.llm.generate_events(feed, reset=base is None, keep=n_keep if base is None else None,
                                          sampling=CHAT, progress=progress, **params)
        try:
            for e in events:
                if self._prompt is None or self._prompt.tokens != tuple(tokens):
                    self._save_prompt(tokens, n_keep)  # the cache holds the prompt, the first token not fed yet
                if e.token is not None:
                    stats.completion_tokens += 1
                    generated.append(e.token)
                    if stats.completion_tokens == 1:
                        stats.first_token_seconds = time.perf_counter() - t0
                if e.token is None:
                    stats.finish_reason = e.finish_reason
                if e.text:
                    answer.append(e.text)
                    yield e.text
        finally:
            events.close()
            if turn != self._turn:
                return  # a newer turn (or a reset, a load) owns the history and the cache now
            stats.seconds = time.perf_counter() - t0
            self.messages = messages + [self._said("".join(answer))]
            if stats.finish_reason is not None or stats.completion_tokens > 0:
                held = tuple(tokens + generated)  # what the cache holds, the pending token last
                self._live = Session(held, len(held) - len(self.llm.pending), n_keep, None, 0)

    def _said(self, text: str) -> Message:
        """The answer as the history keeps it: a thinking model's reasoning apart (`reasoning_content`, as a client of
        the server sends it back; templates drop or place it), else as written."""
        thought, content = (None, text) if self.thinking is None else self.thinking.split(text)
        return {"role": "assistant", "content": content,
                **({"reasoning_content": thought} if thought is not None else {})}

    def _continued(self, tokens: List[int], n_keep: int) -> Optional[Session]:
        """What this turn's prompt continues (`sessions.continues`): the cache as the last turn left it, else the
        last turn's prompt (restored: its answer did not tokenize back to the tokens generated, or a stop string cut
        it), else the part of the cache the prompt has in common with it (the rest forgotten, `Llama.truncate`: an
        answer that starts with spaces or newlines tokenizes together with the template's newline before it, so
        neither the cache nor the last prompt is a prefix of the history rendered again), else nothing."""
        live = self._live
        if live is not None and continues(live.tokens, live.n_keep, tokens, n_keep):
            return live
        if self._prompt is not None and continues(self._prompt.tokens, self._prompt.n_keep, tokens, n_keep):
            self.llm.load_state(self._prompt.snapshot)
            return self._prompt
        if live is not None and live.n_keep == n_keep:
            common = common_prefix(live.tokens[:live.n_fed], tokens)
            if max(n_keep, 0) < common < len(tokens):
                try:
                    self.llm.truncate(common)
                except ValueError:  # per-head cells
                    return None
                return Session(tuple(tokens[:common]), common, n_keep, None, 0)
        return None

    def _save_prompt(self, tokens: List[int], n_keep: int) -> None:
        """Keep a snapshot of the prompt just fed (bounded caches only: a full cache's could be the whole context)."""
        self._prompt = None
        if self.llm.budget is not None:
            snap = self.llm.save_state()
            self._prompt = Session(tuple(tokens), len(tokens), n_keep, snap, int(snap.nbytes))

    # ------------------------------------------------------------------ state on disk
    def save(self, path: Union[str, Path]) -> int:
        """Write the conversation and its KV cache to `path` (a zip: session.json + kv.bin). Returns bytes written.

        Atomic: the file is written beside `path`, flushed to disk and renamed over it, so a save that fails half
        way leaves the previous file as it was. An answer being streamed ends where it stands first (its shown
        part is saved as the assistant's message)."""
        if self._stream is not None:
            self._stream.close()
        snap = self.llm.save_state()
        live = self._live
        meta = {"format": SESSION_FORMAT, "messages": self.messages, "system": self.system,
                "tokens": None if live is None else list(live.tokens), "n_keep": None if live is None else live.n_keep,
                "model": snap.origin, "policy": self.llm.policy.label}
        buf = io.BytesIO()
        prompt = self._prompt
        if prompt is not None:
            meta["prompt_tokens"], meta["prompt_n_keep"] = list(prompt.tokens), prompt.n_keep
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("session.json", json.dumps(meta))
            z.writestr("kv.bin", snap.to_bytes())
            if prompt is not None:  # so that the loaded chat goes on as this one would
                z.writestr("prompt.bin", prompt.snapshot.to_bytes())
        data = buf.getvalue()
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"cannot save to {path}: it is a directory")
        if not path.parent.is_dir():
            raise FileNotFoundError(f"cannot save to {path}: no directory {path.parent}")
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return len(data)

    def load(self, path: Union[str, Path]) -> None:
        """Replace the conversation and the cache with a file written by `save` on the same model and policy.

        All or nothing: the whole file is read and checked first (its sizes before anything is inflated, every field,
        the snapshot), then the cache is restored; a file that is not a session, is damaged, or comes from another
        model, cache layout or policy raises ValueError and changes nothing (the token shown last included)."""
        meta, snap = self._read_session(Path(path))
        try:
            self.llm.load_state(snap)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{path}: {e}") from None
        self.messages = meta["messages"]
        self.system = meta["system"]
        tokens = meta["tokens"]
        self._live = None if tokens is None else Session(tuple(tokens), len(tokens) - len(snap.pending),
                                                         meta["n_keep"], None, 0)
        self._prompt = meta["prompt"]
        self._turn += 1

    def _snapshot_limit(self) -> int:
        """The most bytes a snapshot of this chat can take: its cells, scores and logits are never more than the
        whole allocated cache's, and what recall keeps in host memory never more than a store's cap (this chat's
        recall setting, or the default one: a chat saved with recall loads into one without), its entries counted
        at the cache's own width (the widest a saved store can have) with their scores."""
        llm = self.llm
        st = llm.kv_state()
        n_head = llm.info.n_head
        device = 2 * st.kv_bytes + 16 * st.kv_cells * (n_head + 4) + 8 * llm.n_vocab()
        entries = max(llm.recall, llm.info.n_ctx_train)
        host = max(llm.recall * llm.kv_bytes_per_cell, RECALL_DEFAULT_BYTES) + entries * (8 * n_head + 32)
        return device + host + 2**20

    def _read_session(self, path: Path):
        """The checked parts of a session file: (meta, snapshot). Raises ValueError for anything else."""
        def bad(why: str) -> ValueError:
            return ValueError(f"{path}: not a session file of this chat ({why})")

        snapshot_limit = self._snapshot_limit()
        limits = {"session.json": MAX_SESSION_JSON_BYTES, "kv.bin": snapshot_limit, "prompt.bin": snapshot_limit}
        try:
            with zipfile.ZipFile(path) as z:
                parts = {}
                for name, limit in limits.items():
                    if name == "prompt.bin" and name not in z.namelist():
                        continue
                    info = z.getinfo(name)
                    if info.file_size > limit:
                        raise bad(f"{name} declares {info.file_size} bytes, more than the {limit} this cache can hold")
                    with z.open(info) as f:
                        parts[name] = f.read(limit + 1)  # zipfile stops at the declared size and checks the CRC
                meta = json.loads(parts["session.json"].decode("utf-8"))
                snap = Snapshot.from_bytes(parts["kv.bin"])
                prompt_snap = Snapshot.from_bytes(parts["prompt.bin"]) if "prompt.bin" in parts else None
        except ValueError as e:
            raise e if str(e).startswith(str(path)) else bad(str(e)) from None
        except (OSError, KeyError, EOFError, RuntimeError, NotImplementedError, zipfile.BadZipFile, zlib.error) as e:
            raise bad(f"{type(e).__name__}: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") not in (1, SESSION_FORMAT):
            raise bad(f"expected format {SESSION_FORMAT}")
        try:
            messages = normalize_messages(meta.get("messages"))
            for i, m in enumerate(messages):
                for key, value in m.items():
                    if not isinstance(value, str):
                        raise TypeError(f"message {i}: {key} is not a string")
                    check_text(f"message {i}'s {key}", value)
            if meta.get("system") is not None:
                if not isinstance(meta["system"], str):
                    raise TypeError("system is not a string")
                check_text("system", meta["system"])
            tokens = meta.get("tokens") if meta["format"] == SESSION_FORMAT else None  # format 1: fed again
            if tokens is not None:
                if not isinstance(tokens, list):
                    raise TypeError("tokens is not a list of token ids")
                tokens = self.llm.check_token_ids(tokens, "a saved token")
                if type(meta.get("n_keep")) is not int or meta["n_keep"] < 0 or len(tokens) < len(snap.pending):
                    raise TypeError("n_keep is not a number of tokens")
            prompt = None
            if prompt_snap is not None and meta["format"] == SESSION_FORMAT:
                p_tokens, p_keep = meta.get("prompt_tokens"), meta.get("prompt_n_keep")
                if not isinstance(p_tokens, list) or type(p_keep) is not int or p_keep < 0 \
                        or prompt_snap.origin != snap.origin:
                    raise TypeError("the saved prompt's tokens do not match it")
                p_tokens = self.llm.check_token_ids(p_tokens, "a saved prompt's token")
                prompt = Session(tuple(p_tokens), len(p_tokens), p_keep, prompt_snap, int(prompt_snap.nbytes))
        except (TypeError, ValueError) as e:
            raise bad(str(e)) from None
        if meta.get("policy") != self.llm.policy.label:
            raise ValueError(f"{path}: saved with policy {meta.get('policy')!r}, this chat uses "
                             f"{self.llm.policy.label!r}")
        return {"messages": messages, "system": meta.get("system"), "tokens": tokens, "n_keep": meta.get("n_keep"),
                "prompt": prompt}, snap

    # ------------------------------------------------------------------ status
    def stats(self) -> Dict[str, Any]:
        """The cache and the last turn: entries held / budget, evicted, tokens seen, KV bytes, the answer's decoding
        speed (tokens/s, the prompt left out) and its time to the first token (seconds: the prompt read)."""
        st = self.llm.kv_state()
        recall = {} if not self.recall else {"host_entries": int(len(st.host_positions)),
                                                    "host_bytes": st.host_bytes, "recalled": st.n_recalled,
                                                    "dropped_text_tokens": int(len(st.text_origins))}
        return {"kv_entries": st.n_cells, "budget": self.llm.budget, "n_keep": st.n_keep, "evicted": st.n_evicted,
                **recall,
                "seen": st.n_seen, "kv_bytes": st.kv_bytes, "turns": sum(m["role"] == "user" for m in self.messages),
                "prompt_tokens": self.last.prompt_tokens, "reused_tokens": self.last.reused_tokens,
                "completion_tokens": self.last.completion_tokens,
                "tokens_per_second": round(self.last.tokens_per_second, 1),
                "first_token_seconds": round(self.last.first_token_seconds, 2),
                "device": where_layers_run(self.llm.layer_devices),
                "flash_attn": "on" if self.llm.flash_attn else "off"}

