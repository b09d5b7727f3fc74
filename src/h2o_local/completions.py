"""The OpenAI-shaped calls of `Llama`: text and chat completions (with logprobs, echo, tools, response formats), as
llama-cpp-python has them. `Completions` holds a `Llama` and shapes what its public generation calls
(`generate_events`, `prompt_tokens`, `prompt_logits`) give into OpenAI's responses; `Llama.create_completion` and
`Llama.create_chat_completion` hand over to it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import responses
from . import sampling as sampling_
from . import tools as tools_mod
from .grammar import response_format_grammar
from .llama_types import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, CompletionLogprobs
from .policies import check_int
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .llama import Llama

Prompt = Union[str, bytes, Sequence[int]]


class Completions:
    """create_completion (also `llm(...)`) and create_chat_completion of one `Llama`."""

    def __init__(self, llm: "Llama"):
        self.llm = llm

    def create_completion(self, prompt: Prompt, *, stream: bool = False, echo: bool = False,
                          logprobs: Optional[int] = None, sampling: Optional[SamplingParams] = None,
                          **params: Any) -> Union[Completion, Iterator[CompletionChunk]]:
        """An OpenAI-style text completion, as llama-cpp-python returns it (`choices[0]["text"]`, `finish_reason`,
        `usage`; `logprobs=k` adds the k most likely tokens per position; `echo` prepends the prompt). Sampling
        keywords as in `generate` (default `max_tokens=16`)."""
        if logprobs is not None:
            check_int("logprobs", logprobs, minimum=0)
        llm = self.llm
        p = sampling_.merge(sampling_.COMPLETION, sampling, params)
        prompt_tokens = llm.prompt_tokens(prompt)
        events = llm.generate_events(prompt_tokens, sampling=p, logits=logprobs is not None,
                                     prompt_logits=echo and logprobs is not None)
        meta = responses.completion_meta(llm.model_path)
        if stream:
            return self._completion_chunks(events, meta, prompt_tokens, echo, logprobs)
        with llm.lock:
            return self._completion(events, meta, prompt_tokens, echo, logprobs)

    def _completion(self, events, meta, prompt_tokens, echo, logprobs) -> Completion:
        pieces, tokens, gen_logits = [], [], []
        finish = None
        for e in events:
            pieces.append(e.text)
            if e.token is None:
                finish = e.finish_reason
                continue
            tokens.append(e.token)
            if logprobs is not None:
                gen_logits.append(e.logits)
        text = "".join(pieces)
        lp_out = None
        if logprobs is not None:
            lp_out = self._logprobs(prompt_tokens if echo else [], tokens, gen_logits, logprobs)
        if echo:
            text = self.llm.detokenize(prompt_tokens).decode("utf-8", errors="replace") + text
        return responses.completion(meta, text, finish, responses.usage(len(prompt_tokens), len(tokens)), lp_out)

    def _completion_chunks(self, events, meta, prompt_tokens, echo, logprobs) -> Iterator[CompletionChunk]:
        if echo:
            yield responses.completion_chunk(meta, self.llm.detokenize(prompt_tokens).decode("utf-8", errors="replace"))
        for e in events:
            lp = None
            if e.token is not None and logprobs is not None:
                lp = self._logprob_block([e.token], [None], [e.logits], logprobs)
            yield responses.completion_chunk(meta, e.text, e.finish_reason, lp)

    def _piece_text(self, token: int) -> str:
        return self.llm.token_to_piece(int(token)).decode("utf-8", errors="replace")

    def _logprob_block(self, tokens: List[int], offsets: List[Optional[int]], logits: List[Optional[np.ndarray]],
                       k: int) -> CompletionLogprobs:
        return responses.logprobs(self._piece_text, tokens, offsets, logits, k)

    def _logprobs(self, echoed: List[int], generated: List[int], gen_logits: List[np.ndarray], k: int) -> CompletionLogprobs:
        """Echoed prompt tokens (logits of the prompt pass, none for the first), then the generated ones."""
        rows = self.llm.prompt_logits() if echoed else np.zeros((0, self.llm.n_vocab()), np.float32)
        tokens = list(echoed) + list(generated)
        logits: List[Optional[np.ndarray]] = [None if i == 0 else rows[i - 1] for i in range(len(echoed))]
        logits += list(gen_logits)
        offsets, offset = [], 0
        for tok in tokens:
            offsets.append(offset)
            offset += len(self._piece_text(tok))
        return self._logprob_block(tokens, offsets, logits, k)

    # ------------------------------------------------------------------ chat
    def create_chat_completion(self, messages: Sequence[Dict[str, Any]], *, stream: bool = False,
                               sampling: Optional[SamplingParams] = None,
                               response_format: Optional[Dict[str, Any]] = None,
                               tools: Optional[List[Dict[str, Any]]] = None, tool_choice: Any = None,
                               special_in_content: bool = False,
                               **params: Any) -> Union[ChatCompletion, Iterator[ChatCompletionChunk]]:
        """An OpenAI-style chat completion with the model's own chat template (from the GGUF). Sampling keywords
        as in `generate` (defaults: `max_tokens=None`, `temperature=0.2`). `response_format`: `{"type":
        "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": {...}}}` constrains the answer with
        a grammar (`h2o_local.grammar`; or give `grammar=` GBNF text yourself). `tools` / `tool_choice`: OpenAI's,
        for templates that write calls as `<tool_call>` blocks (Hermes, Qwen2.5; `h2o_local.tools`): calls come
        back as `message.tool_calls` with `finish_reason` "tool_calls"; "required" or a named tool forces a call
        with a grammar. A template without that format raises ValueError. Messages' contents are text: their
        special-token text stays text unless `special_in_content=True` (`Llama.chat_tokens`)."""
        llm = self.llm
        plan = tools_mod.plan(llm.chat_template.source, tools, tool_choice)
        messages = plan.messages(messages)
        for extra in (response_format_grammar(response_format), plan.grammar):
            if extra is not None:
                if params.get("grammar") is not None:
                    raise ValueError("give one of response_format, a forced tool call or grammar, not several")
                params = {**params, "grammar": extra}
        p = sampling_.merge(sampling_.CHAT, sampling, params)
        tokens, n_keep = llm.chat_tokens(messages, tools=plan.tools, special_in_content=special_in_content)
        events = llm.generate_events(tokens, keep=n_keep, sampling=p)
        meta = responses.chat_meta(llm.model_path)
        if stream and not plan.parses:
            return self._chat_chunks(events, meta)
        text, n, finish = [], 0, None
        with llm.lock:
            for e in events:
                text.append(e.text)
                if e.token is None:
                    finish = e.finish_reason
                else:
                    n += 1
        content, calls = plan.parse("".join(text))
        out = responses.chat_completion(meta, content, "tool_calls" if calls else finish,
                                        responses.usage(len(tokens), n), tool_calls=calls)
        return responses.chat_completion_chunks(meta, out) if stream else out

    def _chat_chunks(self, events, meta) -> Iterator[ChatCompletionChunk]:
        yield responses.chat_chunk(meta, {"role": "assistant", "content": ""})
        for e in events:
            if e.text:
                yield responses.chat_chunk(meta, {"content": e.text})
            if e.token is None:
                yield responses.chat_chunk(meta, {}, e.finish_reason)
