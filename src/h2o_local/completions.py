"""The OpenAI-shaped calls of `Llama`: text and chat completions (with logprobs, echo, tools, response formats), as
llama-cpp-python has them. `Completions` holds a `Llama` and shapes what its public generation calls
(`generate_events`, `prompt_tokens`, `prompt_logits`) give into OpenAI's responses; `Llama.create_completion` and
`Llama.create_chat_completion` hand over to it."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import llama_cpp_python, reasoning, responses
from . import sampling as sampling_
from . import tools as tools_mod
from .grammar import response_format_grammar
from .llama_types import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, CompletionLogprobs
from .policies import check_int
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .llama import Llama

Prompt = Union[str, bytes, Sequence[int]]

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on the top tokens given per position

def _without_not_done(params: Dict[str, Any]) -> Dict[str, Any]:
    """`params` less llama-cpp-python's keywords that ask for nothing; one that asks for something raises."""
    return llama_cpp_python.without_not_done(params, llama_cpp_python.CALL_NOT_DONE, llama_cpp_python.CALL_IGNORED)


def completion_tokens(llm: "Llama", prompt: Prompt, suffix: Optional[str], echo: bool = False) -> List[int]:
    """A text completion's tokens: `completion_prompt`, or with a `suffix` the fill-in-the-middle prompt
    (`infill_prompt`; "" on a model without its tokens asks for nothing, as before)."""
    if suffix is None or (suffix == "" and min(llm.info.fim[:3]) < 0):
        return completion_prompt(llm, prompt)
    if not isinstance(prompt, str):
        raise ValueError("suffix needs a text prompt (the code before the gap)")
    if echo:
        raise ValueError("echo cannot be combined with suffix (the prompt is not in front of the answer)")
    return infill_prompt(llm, prompt, suffix)


def completion_prompt(llm: "Llama", prompt: Prompt) -> List[int]:
    """The tokens a text completion reads: `llm.prompt_tokens(prompt)`, and for an empty text the BOS token alone
    where the model has one (llama-cpp-python's rule: a text from nothing)."""
    if isinstance(prompt, (str, bytes)) and not prompt and llm.token_bos() >= 0:
        return [llm.token_bos()]
    return llm.prompt_tokens(prompt)


def infill_prompt(llm: "Llama", prefix: str, suffix: str, prompt: str = "",
                  extra: Sequence[Tuple[str, str]] = ()) -> List[int]:
    """The tokens of a fill-in-the-middle request, as llama-server's /infill makes them: files of `extra` ((file
    name, text) pairs: the repository's context, after its repository and file separator tokens), the BOS token,
    the prefix token, `prefix` then `prompt`, the suffix token, `suffix`, the middle token; the model writes the
    middle. Texts are read as text (special-token text spelled out). ValueError for a model without the tokens
    (code models are trained with them: Qwen2.5-Coder, CodeLlama, StarCoder, DeepSeek-Coder, Codestral)."""
    pre, suf, mid, rep, sep = llm.info.fim
    if min(pre, suf, mid) < 0:
        raise ValueError("suffix / fill-in-the-middle needs a model with fill-in-the-middle tokens (<|fim_prefix|>, "
                         "<|fim_suffix|>, <|fim_middle|>: code models such as Qwen2.5-Coder); this one has none")
    for name, value in (("prefix", prefix), ("suffix", suffix), ("prompt", prompt)):
        if not isinstance(value, str):
            raise TypeError(f"the infill's {name} must be a string, got {type(value).__name__}")

    def text(s: str) -> List[int]:
        return llm.tokenize(s, add_bos=False, special=False) if s else []

    context: List[int] = []
    if extra:
        context += [rep] + text("myproject\n") if rep >= 0 else []
        for name, body in extra:
            context += ([sep] + text(name + "\n") if sep >= 0 else text("\n\n--- snippet ---\n\n")) + text(body)
        context += [sep] + text("filename\n") if sep >= 0 else []
    bos = [llm.token_bos()] if llm.info.add_bos and llm.token_bos() >= 0 else []
    return context + bos + [pre] + text(prefix) + text(prompt) + [suf] + text(suffix) + [mid]


class Completions:
    """create_completion (also `llm(...)`) and create_chat_completion of one `Llama`."""

    def __init__(self, llm: "Llama"):
        self.llm = llm

    def create_completion(self, prompt: Prompt, *, stream: bool = False, echo: bool = False,
                          logprobs: Optional[int] = None, sampling: Optional[SamplingParams] = None,
                          model: Optional[str] = None, suffix: Optional[str] = None,
                          **params: Any) -> Union[Completion, Iterator[CompletionChunk]]:
        """An OpenAI-style text completion, as llama-cpp-python returns it (`choices[0]["text"]`, `finish_reason`,
        `usage`; `logprobs=k` adds the k most likely tokens per position; `echo` prepends the prompt). Sampling
        keywords as in `generate` (default `max_tokens=16`). `model`: the name the response gives (default: the
        model's path). `suffix`: the text after the completion, for a model with fill-in-the-middle tokens
        (`infill_prompt`: the answer is what goes between `prompt` and `suffix`; "" or None on another model:
        no suffix)."""
        if logprobs is not None:
            check_int("logprobs", logprobs, minimum=0)
        llm = self.llm
        p = sampling_.merge(sampling_.COMPLETION, sampling, _without_not_done(params))
        prompt_tokens = completion_tokens(llm, prompt, suffix, echo)
        events = llm.generate_events(prompt_tokens, sampling=p, logits=logprobs is not None,
                                     prompt_logits=echo and logprobs is not None)
        meta = responses.completion_meta(_model_name(llm, model))
        if stream:
            return self._completion_chunks(events, meta, prompt_tokens, echo, logprobs)
        with llm.lock:
            return self._completion(events, meta, prompt_tokens, echo, logprobs)

    def _completion(self, events, meta, prompt_tokens, echo, logprobs) -> Completion:
        pieces, tokens, entries = [], [], []
        finish = None
        for e in events:
            pieces.append(e.text)
            if e.token is None:
                finish = e.finish_reason
                continue
            tokens.append(e.token)
            if logprobs is not None:
                entries.append(responses.token_logprob(e.logits, e.token, logprobs))
        text = "".join(pieces)
        lp_out = None
        if logprobs is not None:
            echoed = prompt_tokens if echo else []
            shown = responses.shown_logprobs(self.llm.token_to_piece, entries, text)
            lp_out = self._logprobs(list(echoed) + [e.token for e in shown],
                                    self._prompt_entries(echoed, logprobs) + shown)
        if echo:
            text = self.llm.detokenize(prompt_tokens).decode("utf-8", errors="replace") + text
        return responses.completion(meta, text, finish, responses.usage(len(prompt_tokens), len(tokens)), lp_out)

    def _completion_chunks(self, events, meta, prompt_tokens, echo, logprobs) -> Iterator[CompletionChunk]:
        first = next(events, None)  # the prompt is read here: its logits are there for the echo
        events = itertools.chain([] if first is None else [first], events)
        if echo:
            lp = None if logprobs is None else \
                self._logprobs(prompt_tokens, self._prompt_entries(prompt_tokens, logprobs), offsets=False)
            yield responses.completion_chunk(meta, self.llm.detokenize(prompt_tokens).decode("utf-8", errors="replace"),
                                             logprobs=lp)
        shown = responses.ShownLogprobs(self.llm.token_to_piece)
        for e in events:
            lp = None
            if logprobs is not None:
                if e.token is not None:
                    shown.drawn([responses.token_logprob(e.logits, e.token, logprobs)])
                out = shown.shown(e.text, end=e.token is None)
                lp = self._logprobs([x.token for x in out], out, offsets=False) if out else None
            yield responses.completion_chunk(meta, e.text, e.finish_reason, lp)

    def _piece_text(self, token: int) -> str:
        return self.llm.token_to_piece(int(token)).decode("utf-8", errors="replace")

    def _prompt_entries(self, echoed: Sequence[int], k: int) -> List[Optional[responses.TokenLogprob]]:
        """The echoed prompt's logprobs, from the prompt pass's logits (none for its first token)."""
        return responses.prompt_logprobs(self.llm.prompt_logits(), echoed, k) if len(echoed) else []

    def _logprobs(self, tokens: Sequence[int], entries: List[Optional[responses.TokenLogprob]],
                  offsets: bool = True) -> CompletionLogprobs:
        """The logprobs block of `tokens`; with `offsets`, where each token's text starts (characters)."""
        starts: Optional[List[int]] = None
        if offsets:
            starts = list(itertools.accumulate((len(self._piece_text(t)) for t in tokens[:-1]), initial=0)) \
                if len(tokens) else []
        return responses.completion_logprobs(self._piece_text, list(tokens), entries, starts)

    # ------------------------------------------------------------------ chat
    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any) -> Any:
        """`create_chat_completion` answered as the openai package's types (`ChatCompletion`, or with `stream=True`
        an iterator of `ChatCompletionChunk`), as llama-cpp-python's (libraries such as instructor call it);
        ImportError without the openai package."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError:
            raise ImportError("create_chat_completion_openai_v1 needs the openai package: pip install openai") from None
        out = self.create_chat_completion(*args, **kwargs)
        if kwargs.get("stream"):
            return (ChatCompletionChunk.model_validate(chunk) for chunk in out)
        return ChatCompletion.model_validate(out)

    def create_chat_completion(self, messages: Sequence[Dict[str, Any]], *, stream: bool = False,
                               sampling: Optional[SamplingParams] = None,
                               response_format: Optional[Dict[str, Any]] = None,
                               tools: Optional[List[Dict[str, Any]]] = None, tool_choice: Any = None,
                               special_in_content: bool = False, logprobs: Optional[bool] = None,
                               top_logprobs: Optional[int] = None, model: Optional[str] = None,
                               chat_template_kwargs: Optional[Dict[str, Any]] = None, reasoning_format: str = "none",
                               **params: Any) -> Union[ChatCompletion, Iterator[ChatCompletionChunk]]:
        """An OpenAI-style chat completion with the model's own chat template (from the GGUF). Sampling keywords
        as in `generate` (defaults: `max_tokens=None`, `temperature=0.2`). `response_format`: `{"type":
        "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": {...}}}` constrains the answer with
        a grammar (`h2o_local.grammar`; or give `grammar=` GBNF text yourself). `tools` / `tool_choice`: OpenAI's,
        for templates whose call format `h2o_local.tool_formats` reads (`<tool_call>` JSON as Qwen2.5,
        `<function=...>` tags as Qwen3.5, `<arg_key>` pairs as GLM, bare JSON as Llama 3.1, `[TOOL_CALLS]` as
        Mistral, Harmony's as gpt-oss; `h2o_local.tools`): calls come back as `message.tool_calls` with
        `finish_reason` "tool_calls"; "required" or a named tool forces a call with a grammar. A template without
        that format raises ValueError. Messages' contents are text: their special-token text stays text unless `special_in_content=True` (`Llama.chat_tokens`). `logprobs=True`:
        `choices[0]["logprobs"]["content"]` gives each answer token's log-probability, with the `top_logprobs`
        (0-20) most likely tokens at its position, as OpenAI's. `model`: the name the response gives.
        `chat_template_kwargs`: more variables the template reads, as llama-server takes them
        (`{"enable_thinking": False}` for Qwen3). `reasoning_format="auto"`: a thinking model's reasoning (between
        its template's think tags) comes as `message["reasoning_content"]` (streamed as `delta["reasoning_content"]`)
        and the rest as `content`, as llama-server gives them (`h2o_local.reasoning`); "none" (the default, as
        llama-cpp-python) leaves the answer as written."""
        k = chat_logprobs_k(logprobs, top_logprobs)
        params = _without_not_done(params)
        llm = self.llm
        plan = tools_mod.plan(llm.chat_template, tools, tool_choice)
        for extra in (response_format_grammar(response_format), plan.grammar):
            if extra is not None:
                if params.get("grammar") is not None:
                    raise ValueError("give one of response_format, a forced tool call or grammar, not several")
                params = {**params, "grammar": extra}
        p = sampling_.merge(sampling_.CHAT, sampling, params)
        tokens, n_keep = llm.chat_tokens(plan.messages(messages), tools=plan.template_tools,
                                         special_in_content=special_in_content,
                                         chat_template_kwargs=chat_template_kwargs)
        thinking = reasoning.thinking(reasoning_format, llm.chat_template.source, prompt_end(llm, tokens))
        p = p.replace(preserved_tokens=p.preserved_tokens + answer_markup(llm, plan, thinking))
        events = llm.generate_events(tokens, keep=n_keep, sampling=p, logits=k is not None)
        meta = responses.chat_meta(_model_name(llm, model))
        if stream and not plan.parses:
            return self._chat_chunks(events, meta, k, thinking)
        text, entries, n, finish = [], [], 0, None
        with llm.lock:
            for e in events:
                text.append(e.text)
                if e.token is None:
                    finish = e.finish_reason
                    continue
                n += 1
                if k is not None:
                    entries.append(responses.token_logprob(e.logits, e.token, k))
        thought, answer = (None, "".join(text)) if thinking is None else thinking.split("".join(text))
        content, calls = plan.parse(answer)
        lp = None if k is None else responses.chat_logprobs(
            self.llm.token_to_piece, responses.shown_logprobs(self.llm.token_to_piece, entries, "".join(text)))
        out = responses.chat_completion(meta, content, "tool_calls" if calls else finish,
                                        responses.usage(len(tokens), n), tool_calls=calls, logprobs=lp,
                                        reasoning=thought)
        return responses.chat_completion_chunks(meta, out) if stream else out

    def _chat_chunks(self, events, meta, k: Optional[int],
                     thinking: Optional[reasoning.Thinking]) -> Iterator[ChatCompletionChunk]:
        yield responses.chat_chunk(meta, {"role": "assistant", "content": ""})
        shown = responses.ShownLogprobs(self.llm.token_to_piece)
        splitter = None if thinking is None else thinking.splitter()
        for e in events:
            lp = None
            if k is not None:  # a token's entry comes with its text
                if e.token is not None:
                    shown.drawn([responses.token_logprob(e.logits, e.token, k)])
                out = shown.shown(e.text, end=e.token is None)
                lp = responses.chat_logprobs(self.llm.token_to_piece, out) if out else None
            delta = responses.chat_delta(*reasoning.pieces(splitter, e.text, end=e.token is None))
            if delta or lp is not None:
                yield responses.chat_chunk(meta, delta or {"content": ""}, logprobs=lp)
            if e.token is None:
                yield responses.chat_chunk(meta, {}, e.finish_reason)


def answer_markup(llm: "Llama", plan: Optional[tools_mod.ToolPlan],
                  thinking: Optional[reasoning.Thinking]) -> Tuple[int, ...]:
    """The control tokens a chat's answer must show to be read: its tool-call format's tags (when calls are parsed;
    `plan` None: a chat without tools), its think tags (when the reasoning is split) and Harmony's marks always
    (without them gpt-oss's answer runs its channels' names into its text)."""
    marks = thinking.marks if thinking is not None else \
        reasoning.HarmonySplitter.MARKS if reasoning.harmony(llm.chat_template.source) else ()
    texts = (plan.format.tags if plan is not None and plan.parses else ()) + marks
    return llm.preserved_tokens(texts) if texts else ()


def prompt_end(llm: "Llama", tokens: Sequence[int]) -> str:
    """The last characters of a prompt, its special tokens written out (whether it opened a think tag)."""
    return llm.detokenize(list(tokens[-8:]), special=True).decode("utf-8", errors="replace")


def _model_name(llm: "Llama", model: Optional[str]) -> str:
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model is the name the response gives (a str), got {model!r}")
    return llm.model_path if model is None else model


def chat_logprobs_k(logprobs: Optional[bool], top_logprobs: Optional[int]) -> Optional[int]:
    """OpenAI's chat fields as the number of top tokens to give per position (None: no logprobs): `top_logprobs`
    (0-20) needs `logprobs` true."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise TypeError(f"logprobs is true or false, got {logprobs!r}")
    if top_logprobs is not None:
        check_int("top_logprobs", top_logprobs, minimum=0, maximum=MAX_TOP_LOGPROBS)
        if not logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
    return (top_logprobs or 0) if logprobs else None
