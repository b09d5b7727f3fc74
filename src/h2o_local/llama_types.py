"""OpenAI-shaped responses, as llama-cpp-python's `llama_types` has them (TypedDicts: plain dicts at run time)."""
from __future__ import annotations

import sys
from typing import Dict, List, Literal, Optional, Union

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover
    from typing_extensions import NotRequired, TypedDict

FinishReason = Literal["stop", "length"]


class LlamaStats(TypedDict):
    """`Llama.stats()`: the context's counters since it was made."""
    decodes: int        # llama_decode calls: a prompt's chunks, each generated token, each probe
    graphs_reused: int  # ubatches that reused the previous compute graph (llama.cpp's graph reuse)
    kv_bytes: int       # the KV cache's bytes, every sequence's cells allocated at once
    cells_used: int     # KV cells holding an entry now, across sequences


class CompletionLogprobs(TypedDict):
    text_offset: List[int]
    token_logprobs: List[Optional[float]]
    tokens: List[str]
    top_logprobs: List[Optional[Dict[str, float]]]


class CompletionChoice(TypedDict):
    text: str
    index: int
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[FinishReason]


class CompletionUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: NotRequired[CompletionUsage]


CompletionChunk = Completion  # a streamed piece has the same shape, without usage


class ChatCompletionRequestMessage(TypedDict):
    role: str
    content: Optional[str]
    name: NotRequired[str]


class ChatCompletionResponseMessage(TypedDict):
    role: Literal["assistant"]
    content: Optional[str]
    reasoning_content: NotRequired[str]  # llama-server's: a thinking model's reasoning (reasoning_format "auto")
    tool_calls: NotRequired[List[Dict[str, object]]]


class ChatCompletionTopLogprobToken(TypedDict):
    token: str
    logprob: float
    bytes: Optional[List[int]]


class ChatCompletionLogprobToken(ChatCompletionTopLogprobToken):
    top_logprobs: List[ChatCompletionTopLogprobToken]


class ChatCompletionLogprobs(TypedDict):
    content: Optional[List[ChatCompletionLogprobToken]]
    refusal: Optional[List[ChatCompletionLogprobToken]]


class ChatCompletionResponseChoice(TypedDict):
    index: int
    message: ChatCompletionResponseMessage
    logprobs: Optional[ChatCompletionLogprobs]
    finish_reason: Optional[FinishReason]


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: List[ChatCompletionResponseChoice]
    usage: CompletionUsage


class ChatCompletionChunkDelta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str
    reasoning_content: str
    tool_calls: List[Dict[str, object]]


class ChatCompletionChunkChoice(TypedDict):
    index: int
    delta: ChatCompletionChunkDelta
    logprobs: Optional[ChatCompletionLogprobs]
    finish_reason: Optional[FinishReason]


class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: List[ChatCompletionChunkChoice]


Response = Union[Completion, ChatCompletion]


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class Embedding(TypedDict):
    object: Literal["embedding"]
    embedding: Union[List[float], List[List[float]]]  # a row per token where pooling is none
    index: int


class CreateEmbeddingResponse(TypedDict):
    object: Literal["list"]
    model: str
    data: List[Embedding]
    usage: EmbeddingUsage
