"""A thinking model's reasoning told apart from its answer, as llama-server does (`reasoning_format`): the text
between the template's think tags (`<think>`...`</think>` for Qwen3, QwQ, DeepSeek-R1, GLM; `<seed:think>` for
Seed-OSS; `[THINK]` for Magistral; `<|channel>thought`...`<channel|>` for Gemma 4), or gpt-oss's `analysis` channel, goes to `message.reasoning_content` (Ollama:
`message.thinking`), the rest to `content`. A template whose generation prompt opens the tags itself (DeepSeek-R1's
distills) has the answer start inside them; a reasoning never closed (cut by max_tokens) is all reasoning.

One rule for the whole answer and for a stream (`Splitter`, `HarmonySplitter`: each holds back what may be the start
of a mark), used by `Llama.create_chat_completion` and both servers' chat routes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

# what `reasoning_format` may be: "auto" / "deepseek" (llama-server's names) split where the template has think
# tags, "none" leaves the answer as the model wrote it
REASONING_FORMATS = ("auto", "deepseek", "none")


@dataclasses.dataclass(frozen=True)
class ThinkTags:
    open: str
    close: str
    marks: Tuple[str, ...] = ()  # the control tokens they are written with (default: each tag is one)


KNOWN_TAGS = (ThinkTags("<think>", "</think>"), ThinkTags("<seed:think>", "</seed:think>"),
              ThinkTags("[THINK]", "[/THINK]"),
              ThinkTags("<|channel>thought", "<channel|>", marks=("<|channel>", "<channel|>")))


def think_tags(template_source: Optional[str]) -> Optional[ThinkTags]:
    """The think tags a chat template writes (the first known pair whose closing tag its source holds)."""
    for tags in KNOWN_TAGS:
        if template_source and tags.close in template_source:
            return tags
    return None


def check_format(reasoning_format: Any) -> str:
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {reasoning_format!r}")
    return reasoning_format


class _Split:
    """Text in as it is generated, (reasoning, content) out: `_step` moves what it can of the held text, `_flush`
    what is held at the end."""

    def __init__(self, state: str) -> None:
        self._state = state
        self._held = ""  # text that may be the start of a mark (or the whitespace before the answer)
        self.thought = False  # whether the answer had a reasoning part
        self.reasoning: List[str] = []
        self.content: List[str] = []

    def feed(self, text: str) -> Tuple[str, str]:
        """The reasoning and the content that `text` (the next piece) adds; what may be part of a mark waits."""
        before = len(self.reasoning), len(self.content)
        self._held += text
        while self._step():
            pass
        return "".join(self.reasoning[before[0]:]), "".join(self.content[before[1]:])

    def end(self) -> Tuple[str, str]:
        """What was held back, at the end of the answer."""
        before = len(self.reasoning), len(self.content)
        held, self._held = self._held, ""
        self._flush(held)
        return "".join(self.reasoning[before[0]:]), "".join(self.content[before[1]:])

    def _step(self) -> bool:
        raise NotImplementedError

    def _flush(self, held: str) -> None:
        raise NotImplementedError


class Splitter(_Split):
    """An answer with think tags. `inside`: the prompt ended with the open tag."""

    def __init__(self, tags: ThinkTags, inside: bool = False):
        super().__init__("inside" if inside else "start")
        self.tags = tags
        self.thought = inside

    def _flush(self, held: str) -> None:
        if self._state == "inside":
            self.reasoning.append(held)
        elif self._state in ("start", "content"):
            self.content.append(held)
        # "after": whitespace between the reasoning and an answer that never came

    def _step(self) -> bool:
        held, open_, close = self._held, self.tags.open, self.tags.close
        if not held:
            return False
        if self._state == "start":
            body = held.lstrip()
            if body.startswith(open_):
                self._state, self._held, self.thought = "inside", body[len(open_):], True
                return True
            if body and not open_.startswith(body):  # not a tag: the answer, as written
                self._state = "content"
                return True
            return False
        if self._state == "inside":
            at = held.find(close)
            if at >= 0:
                self.reasoning.append(held[:at])
                self._state, self._held = "after", held[at + len(close):]
                return True
            keep = _partial_suffix(held, close)
            if len(held) > keep:
                self.reasoning.append(held[:len(held) - keep])
                self._held = held[len(held) - keep:]
            return False
        if self._state == "after":
            body = held.lstrip()
            if body:
                self._state, self._held = "content", body
                return True
            self._held = ""
            return False
        self.content.append(held)
        self._held = ""
        return False


class HarmonySplitter(_Split):
    """gpt-oss's answers (OpenAI's Harmony format): messages `<|channel|>NAME<|message|>TEXT<|end|>`, each after
    `<|start|>assistant` but the first; the `analysis` channel is the reasoning, the others (`final`, `commentary`)
    the content. Text before any channel (a model that does not follow the format) is content."""

    MARKS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
    LONGEST_HEADER = 256  # characters before a first <|message|>: more (or a line break) is not a header

    def __init__(self) -> None:
        super().__init__("start")  # start | header | body
        self._channel = ""

    def _flush(self, held: str) -> None:
        if self._state == "body":
            self._emit(held)
        elif self._state == "start" or "<|channel|>" not in held:  # no message came: text as written
            self.content.append(held)

    def _emit(self, text: str) -> None:
        if text:
            (self.reasoning if self._channel == "analysis" else self.content).append(text)

    def _step(self) -> bool:
        held = self._held
        if self._state in ("start", "header"):  # the prompt ended with <|start|>assistant: a header comes first
            at = held.find("<|message|>")
            if at < 0:
                if self._state == "start" and (len(held) > self.LONGEST_HEADER or "\n" in held):
                    self._state, self._channel = "body", "final"  # not Harmony: all of it is the answer
                    return True
                return False
            header = held[:at]
            named = header.split("<|channel|>", 1)[1] if "<|channel|>" in header else ""
            self._channel = named.split()[0] if named.split() else ""
            self.thought = self.thought or self._channel == "analysis"
            if " to=" in header:  # a message to a tool (a call): kept whole in the content, for the tools' reader
                self.content.append(held[:at + len("<|message|>")])
            self._state, self._held = "body", held[at + len("<|message|>"):]
            return True
        # body: up to the end of the message, or the start of another without one
        ends = [(held.find(m), m) for m in ("<|end|>", "<|start|>", "<|channel|>") if held.find(m) >= 0]
        if ends:
            at, mark = min(ends)
            self._emit(held[:at])
            rest = held[at + len(mark):] if mark == "<|end|>" else held[at:]
            self._state, self._held = "header", rest
            return True
        keep = max((_partial_suffix(held, m) for m in self.MARKS), default=0)
        self._emit(held[:len(held) - keep])
        self._held = held[len(held) - keep:]
        return False


def split(text: str, tags: Optional[ThinkTags], inside: bool = False) -> Tuple[Optional[str], str]:
    """(the reasoning, None when there is none; the content) of a whole answer, with these think tags (None:
    nothing to split)."""
    return (None, text) if tags is None else Thinking(tags, inside).split(text)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclasses.dataclass(frozen=True)
class Thinking:
    """How one chat answer is split: its template's tags, and whether the prompt left it inside them; or the
    Harmony format's channels (`tags` None)."""

    tags: Optional[ThinkTags]
    inside: bool = False

    @property
    def marks(self) -> Tuple[str, ...]:
        """The markup the split reads (its control tokens must be shown: `Llama.preserved_tokens`)."""
        if self.tags is None:
            return HarmonySplitter.MARKS
        return self.tags.marks or (self.tags.open, self.tags.close)

    def splitter(self) -> "_Split":
        return HarmonySplitter() if self.tags is None else Splitter(self.tags, self.inside)

    def split(self, text: str) -> Tuple[Optional[str], str]:
        s = self.splitter()
        s.feed(text)
        s.end()
        return ("".join(s.reasoning) if s.thought else None), "".join(s.content)


def thinks(template_source: Optional[str]) -> bool:
    """Whether a chat template has a reasoning part to split (think tags or Harmony's channels)."""
    return harmony(template_source) or think_tags(template_source) is not None


def harmony(template_source: Optional[str]) -> bool:
    """Whether a chat template writes OpenAI's Harmony format (gpt-oss: `<|channel|>`), as llama.cpp tells it."""
    return bool(template_source) and "<|channel|>" in template_source


def thinking(reasoning_format: Any, template_source: Optional[str], prompt_end: str) -> Optional[Thinking]:
    """How a chat's answer is split (`reasoning_format`; `prompt_end`: the last characters of its prompt, special
    tokens written out); None where it is not (format "none", or a template without think tags or channels)."""
    if check_format(reasoning_format) == "none":
        return None
    if harmony(template_source):
        return Thinking(None)
    tags = think_tags(template_source)
    if tags is None:
        return None
    return Thinking(tags, prompt_end.rstrip().endswith(tags.open))


def pieces(splitter: Optional[_Split], text: str, end: bool = False) -> Tuple[str, str]:
    """(reasoning, content) that a streamed piece of text adds (`end`: the answer's last), as `Splitter.feed`;
    without a splitter all of it is content."""
    if splitter is None:
        return "", text
    reasoning, content = splitter.feed(text)
    if end:
        more = splitter.end()
        reasoning, content = reasoning + more[0], content + more[1]
    return reasoning, content
