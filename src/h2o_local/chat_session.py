"""A conversation that keeps its KV cache across turns: each turn feeds only what is new.

The cache holds (compressed by the policy) everything fed so far: the rendered prompt of the first turn, each answer,
and each later turn. A new turn renders the whole conversation with the chat template; when that text extends what
was fed, only the extension is tokenized and fed (`reset=False`); when it does not (a template that rewrites
history), the conversation is fed again from the start.
"""
from __future__ import annotations

import io
import json
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

from . import _engine
from .chat_template import Message, normalize_messages
from .llama import Llama
from .sampling import CHAT


@dataclass
class TurnStats:
    """What the last turn did."""

    prompt_tokens: int = 0        # tokens fed for this turn's prompt
    reused_tokens: int = 0        # tokens of the conversation already in the cache (not fed again)
    completion_tokens: int = 0
    seconds: float = 0.0          # the answer's wall time, prompt included
    finish_reason: Optional[str] = None

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


class ChatSession:
    """A chat with one `Llama` (its sequence 0), whose cache is reused from turn to turn.

    system: the system prompt (None: the template's default, if any).
    Sampling keywords (`temperature`, `max_tokens`, ...) given here apply to every turn.
    """

    def __init__(self, llm: Llama, *, system: Optional[str] = None, **sampling: Any):
        self.llm = llm
        self.system = system
        self.sampling = dict(sampling)
        self.messages: List[Message] = []
        self.last = TurnStats()
        self._fed_text: Optional[str] = None  # the text the cache holds, when it holds this conversation
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self._fed_text = None
        self.last = TurnStats()

    def send(self, content: str, **sampling: Any) -> Iterator[str]:
        """Add a user message and stream the answer's text pieces. Breaking off (Ctrl-C, `close()`) keeps the part
        of the answer already shown in the conversation, and the cache in step with it."""
        if not isinstance(content, str):
            raise TypeError(f"a message is a string, got {type(content).__name__}")
        params = {**self.sampling, **sampling}
        messages = self.messages + [{"role": "user", "content": content}]
        prompt_text = self.llm.apply_chat_template(messages)
        tokens, n_keep = self.llm.chat_tokens(messages)
        fed_text = self._fed_text
        continuing = fed_text is not None and prompt_text.startswith(fed_text) and len(prompt_text) > len(fed_text)
        if continuing:
            feed = self.llm.tokenize(prompt_text[len(fed_text):], add_bos=False, special=True)
            reused = len(tokens) - len(feed)
        else:
            feed, reused = tokens, 0
        self.messages = messages
        self._fed_text = None  # until this turn is in the cache as far as we know it
        stats = TurnStats(prompt_tokens=len(feed), reused_tokens=max(reused, 0))
        self.last = stats
        answer: List[str] = []
        generated: List[int] = []
        t0 = time.perf_counter()
        events = self.llm.generate_events(feed, reset=not continuing, keep=None if continuing else n_keep,
                                          sampling=CHAT, **params)
        try:
            for e in events:
                if e.token is not None:
                    stats.completion_tokens += 1
                    generated.append(e.token)
                if e.token is None:
                    stats.finish_reason = e.finish_reason
                if e.text:
                    answer.append(e.text)
                    yield e.text
        finally:
            events.close()
            stats.seconds = time.perf_counter() - t0
            text = "".join(answer)
            self.messages = messages + [{"role": "assistant", "content": text}]
            if stats.finish_reason is not None or stats.completion_tokens > 0:
                # the cache holds the prompt and every token shown (a session that goes on feeds the last first);
                # when a stop string cut the text shown, the next turn starts again from the whole conversation
                held = self.llm.detokenize(generated).decode("utf-8", errors="replace")
                stop_cut = stats.finish_reason == "stop" and self.llm.last_eog_token is None
                if held != text and not stop_cut:
                    # a character cut short by max_tokens or Ctrl-C: the history keeps what the cache holds
                    self.messages[-1]["content"] = text = held
                self._fed_text = prompt_text + text if held == text else None

    # ------------------------------------------------------------------ state on disk
    def save(self, path: Union[str, Path]) -> int:
        """Write the conversation and its KV cache to `path` (a zip: session.json + kv.bin). Returns bytes written."""
        snap = self.llm.save_state()
        meta = {"format": 1, "messages": self.messages, "system": self.system, "fed_text": self._fed_text,
                "model": snap.origin, "policy": self.llm.policy.label}
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("session.json", json.dumps(meta))
            z.writestr("kv.bin", snap.to_bytes())
        Path(path).write_bytes(buf.getvalue())
        return len(buf.getvalue())

    def load(self, path: Union[str, Path]) -> None:
        """Replace the conversation and the cache with a file written by `save` on the same model. A file that is
        not a session, or one from another model or cache layout, raises ValueError and changes nothing."""
        try:
            with zipfile.ZipFile(Path(path)) as z:
                meta = json.loads(z.read("session.json"))
                snap = _engine.SeqSnapshot.from_bytes(z.read("kv.bin"))
            messages = normalize_messages(meta["messages"])
            fed_text = meta.get("fed_text")
            if fed_text is not None and not isinstance(fed_text, str):
                raise ValueError("fed_text is not text")
        except (OSError, KeyError, TypeError, zipfile.BadZipFile, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a session file ({type(e).__name__}: {e})") from None
        self.llm.load_state(snap)
        self.messages = messages
        self.system = meta.get("system")
        self._fed_text = fed_text

    # ------------------------------------------------------------------ status
    def stats(self) -> Dict[str, Any]:
        """The cache and the last turn: entries held / budget, evicted, tokens seen, KV bytes, speed."""
        st = self.llm.kv_state()
        return {"kv_entries": st.n_cells, "budget": self.llm.budget, "n_keep": st.n_keep, "evicted": st.n_evicted,
                "seen": st.n_seen, "kv_bytes": st.kv_bytes, "turns": sum(m["role"] == "user" for m in self.messages),
                "prompt_tokens": self.last.prompt_tokens, "reused_tokens": self.last.reused_tokens,
                "completion_tokens": self.last.completion_tokens,
                "tokens_per_second": round(self.last.tokens_per_second, 1)}

