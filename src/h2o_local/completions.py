"""The OpenAI-shaped calls of `Llama`: text and chat completions (with logprobs, echo, tools, response formats) and
batched generation, as llama-cpp-python has them. A part of `Llama` kept in a module of its own (`Llama` inherits it);
it drives the one generation loop through `Llama`'s own helpers."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import generation, responses, sampling
from . import tools as tools_mod
from .grammar import response_format_grammar
from .llama_types import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, CompletionLogprobs
from .policies import check_int
from .sampling import SamplingParams
from .text import TextAssembler

Prompt = Union[str, bytes, Sequence[int]]
_GENERATE, _COMPLETION, _CHAT = sampling.GENERATE, sampling.COMPLETION, sampling.CHAT


class Completions:
    """create_completion (also `llm(...)`), create_chat_completion and generate_batch."""

    def create_completion(self, prompt: Prompt, *, stream: bool = False, echo: bool = False,
                          logprobs: Optional[int] = None, sampling: Optional[SamplingParams] = None,
                          **params: Any) -> Union[Completion, Iterator[CompletionChunk]]:
        """An OpenAI-style text completion, as llama-cpp-python returns it (`choices[0]["text"]`, `finish_reason`,
        `usage`; `logprobs=k` adds the k most likely tokens per position; `echo` prepends the prompt). Sampling
        keywords as in `generate` (default `max_tokens=16`)."""
        if logprobs is not None:
            check_int("logprobs", logprobs, minimum=0)
        p = self._params(_COMPLETION, sampling, params)
        prompt_tokens = self._prompt_tokens(prompt, None)
        events = self._generate_one(prompt_tokens, p, reset=True, want_logits=logprobs is not None,
                                    prompt_logits=echo and logprobs is not None)
        meta = responses.completion_meta(self.model_path)
        if stream:
            return self._completion_chunks(events, meta, prompt_tokens, echo, logprobs)
        with self._lock:
            return self._completion(events, meta, prompt_tokens, echo, logprobs)

    __call__ = create_completion

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
            text = self.detokenize(prompt_tokens).decode("utf-8", errors="replace") + text
        return responses.completion(meta, text, finish, responses.usage(len(prompt_tokens), len(tokens)), lp_out)

    def _completion_chunks(self, events, meta, prompt_tokens, echo, logprobs) -> Iterator[CompletionChunk]:
        if echo:
            yield responses.completion_chunk(meta, self.detokenize(prompt_tokens).decode("utf-8", errors="replace"))
        for e in events:
            lp = None
            if e.token is not None and logprobs is not None:
                lp = self._logprob_block([e.token], [None], [e.logits], logprobs)
            yield responses.completion_chunk(meta, e.text, e.finish_reason, lp)

    def _piece_text(self, token: int) -> str:
        return self._engine.token_to_piece(int(token), False).decode("utf-8", errors="replace")

    def _logprob_block(self, tokens: List[int], offsets: List[Optional[int]], logits: List[Optional[np.ndarray]],
                       k: int) -> CompletionLogprobs:
        return responses.logprobs(self._piece_text, tokens, offsets, logits, k)

    def _logprobs(self, echoed: List[int], generated: List[int], gen_logits: List[np.ndarray], k: int) -> CompletionLogprobs:
        """Echoed prompt tokens (logits of the prompt pass, none for the first), then the generated ones."""
        rows = self._engine.logits_all(0) if echoed else np.zeros((0, self.n_vocab()), np.float32)
        tokens = list(echoed) + list(generated)
        logits: List[Optional[np.ndarray]] = [None if i == 0 else rows[i - 1] for i in range(len(echoed))]
        logits += list(gen_logits)
        offsets, offset = [], 0
        for tok in tokens:
            offsets.append(offset)
            offset += len(self._piece_text(tok))
        return self._logprob_block(tokens, offsets, logits, k)

    # ------------------------------------------------------------------ batched generation
    def generate_batch(self, prompts: Sequence[Prompt], *, stream: bool = False, add_bos: Optional[bool] = None,
                       sampling: Optional[SamplingParams] = None,
                       **params: Any) -> Union[List[str], Iterator[Tuple[int, Optional[str]]]]:
        """Generate for several prompts decoded together: one llama_decode per step for all live sequences.

        Each sequence has its own KV budget, scores and sampler (seeded `seed + i`, so sequence i samples what
        `generate(prompts[i], seed=seed + i)` would, up to batching round-off); finished sequences leave the
        batch. At most `n_seq_max` prompts run at once; more are processed in waves. Returns the texts, or with
        `stream=True` an iterator of (index, text piece) pairs, and (index, None) when sequence `index` ends;
        `finish_reasons` then holds each prompt's. Sampling keywords as in `generate`.
        """
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of prompts (str, bytes or token lists), not one string")
        p = self._params(_GENERATE, sampling, params)
        token_lists = [self._prompt_tokens(q, add_bos) for q in prompts]
        if any(not t for t in token_lists):
            raise ValueError("a prompt is empty: pass at least one token per prompt")
        base_seed = self._rng.getrandbits(32) if p.seed is None else int(p.seed)
        it = self._batch_events(token_lists, p, base_seed)
        if stream:
            return it
        texts = [""] * len(prompts)
        with self._lock:
            for i, piece in it:
                if piece:
                    texts[i] += piece
        return texts

    def _batch_events(self, token_lists: List[List[int]], p: SamplingParams, base_seed: int) -> Iterator[Tuple[int, Optional[str]]]:
        self.finish_reasons = [None] * len(token_lists)
        for wave in range(0, len(token_lists), self.n_seq_max):
            idx = list(range(wave, min(wave + self.n_seq_max, len(token_lists))))
            runs = [generation.SeqRun(i, s, self._sampler(p, seed=base_seed + i, history=token_lists[i]),
                                      TextAssembler(p.stop), self._answer_limit(p))
                    for s, i in enumerate(idx)]
            with self._lock:
                owner = self._take_over()
                self._engine.reset()
                self._engine.eval({s: token_lists[i] for s, i in enumerate(idx)}, False)
            events = generation.run(self._engine, runs, unbounded=not self.policy.bounded, free_finished=True)
            for e in self._owned_steps(events, owner):
                if e.text:
                    yield e.index, e.text
                if e.token is None:
                    self.finish_reasons[e.index] = e.finish_reason
                    yield e.index, None

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
        plan = tools_mod.plan(self.chat_template.source, tools, tool_choice)
        messages = plan.messages(messages)
        for extra in (response_format_grammar(response_format), plan.grammar):
            if extra is not None:
                if params.get("grammar") is not None:
                    raise ValueError("give one of response_format, a forced tool call or grammar, not several")
                params = {**params, "grammar": extra}
        p = self._params(_CHAT, sampling, params)
        tokens, n_keep = self.chat_tokens(messages, tools=plan.tools, special_in_content=special_in_content)
        events = self._generate_one(tokens, p, reset=True, n_keep=n_keep)
        meta = responses.chat_meta(self.model_path)
        if stream and not plan.parses:
            return self._chat_chunks(events, meta)
        text, n, finish = [], 0, None
        with self._lock:
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
