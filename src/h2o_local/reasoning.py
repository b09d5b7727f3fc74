"""A thinking model's reasoning told apart from its answer, as llama-server does (`reasoning_format`): the text
between the template's think tags (`<think>`...`</think>` for Qwen3, QwQ, DeepSeek-R1, GLM; `<seed:think>` for
Seed-OSS; `[THINK]` for Magistral) goes to `message.reasoning_content` (Ollama: `message.thinking`), the rest to
`content`. A template whose generation prompt opens the tags itself (DeepSeek-R1's distills) has the answer start
inside them; a reasoning never closed (cut by max_tokens) is all reasoning.

One rule for the whole answer and for a stream (`Splitter`, which holds back what may be the start of a tag), used by
`Llama.create_chat_completion` and both servers' chat routes.
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


KNOWN_TAGS = (ThinkTags("<think>", "</think>"), ThinkTags("<seed:think>", "</seed:think>"),
              ThinkTags("[THINK]", "[/THINK]"))


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


class Splitter:
    """Text in as it is generated; (reasoning, content) out. `inside`: the prompt ended with the open tag."""

    def __init__(self, tags: ThinkTags, inside: bool = False):
        self.tags = tags
        self._state = "inside" if inside else "start"
        self.thought = inside  # whether the answer had a reasoning part
        self._held = ""  # text that may be the start of a tag (or the whitespace before the answer)
        self.reasoning: List[str] = []
        self.content: List[str] = []

    def feed(self, text: str) -> Tuple[str, str]:
        """The reasoning and the content that `text` (the next piece) adds; what may be part of a tag waits."""
        before = len(self.reasoning), len(self.content)
        self._held += text
        while self._step():
            pass
        return "".join(self.reasoning[before[0]:]), "".join(self.content[before[1]:])

    def end(self) -> Tuple[str, str]:
        """What was held back, at the end of the answer."""
        before = len(self.reasoning), len(self.content)
        held, self._held = self._held, ""
        if self._state == "inside":
            self.reasoning.append(held)
        elif self._state in ("start", "content"):
            self.content.append(held)
        else:  # "after": whitespace between the reasoning and an answer that never came
            pass
        return "".join(self.reasoning[before[0]:]), "".join(self.content[before[1]:])

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


def split(text: str, tags: Optional[ThinkTags], inside: bool = False) -> Tuple[Optional[str], str]:
    """(the reasoning, None when there is none; the content) of a whole answer."""
    if tags is None:
        return None, text
    s = Splitter(tags, inside)
    s.feed(text)
    s.end()
    return ("".join(s.reasoning) if s.thought else None), "".join(s.content)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclasses.dataclass(frozen=True)
class Thinking:
    """How one chat answer is split: its template's tags, and whether the prompt left it inside them."""

    tags: ThinkTags
    inside: bool

    def splitter(self) -> Splitter:
        return Splitter(self.tags, self.inside)

    def split(self, text: str) -> Tuple[Optional[str], str]:
        return split(text, self.tags, self.inside)


def thinking(reasoning_format: Any, template_source: Optional[str], prompt_end: str) -> Optional[Thinking]:
    """How a chat's answer is split (`reasoning_format`; `prompt_end`: the last characters of its prompt, special
    tokens written out); None where it is not (format "none", or a template without think tags)."""
    if check_format(reasoning_format) == "none":
        return None
    tags = think_tags(template_source)
    if tags is None:
        return None
    return Thinking(tags, prompt_end.rstrip().endswith(tags.open))


def pieces(splitter: Optional[Splitter], text: str, end: bool = False) -> Tuple[str, str]:
    """(reasoning, content) that a streamed piece of text adds (`end`: the answer's last), as `Splitter.feed`;
    without a splitter all of it is content."""
    if splitter is None:
        return "", text
    reasoning, content = splitter.feed(text)
    if end:
        more = splitter.end()
        reasoning, content = reasoning + more[0], content + more[1]
    return reasoning, content
