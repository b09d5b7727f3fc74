"""The embedding routes: OpenAI's `/v1/embeddings`, llama-server's `/embedding(s)` and Ollama's `/api/embed` and
`/api/embeddings`, all through `Llama.embed` (its own context: the slots' caches are untouched). Their work is
bounded as a prompt's: at most MAX_INPUTS inputs, each within the embedding context (`Llama.embed`'s n_ctx), all
together within max_prompt_tokens; they run one request at a time on a thread of their own (so chats are prepared
and decoded meanwhile), at most max_waiting waiting (more get 429)."""
from __future__ import annotations

import asyncio
import base64
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import numpy as np
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from .. import embeddings
from . import requests
from .protocol import APIError
from .answers import json_body, ollama_error, server_state
from .state import ServerState
from .translated import validated

router = APIRouter()

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # user, ...

    input: Any
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None


class LlamaServerEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    content: Any = None
    input: Any = None
    # llama-server's: -1 none, 0 max absolute (int16), 1 taxicab, 2 Euclidean, > 2 p-norm (an int, as its)
    embd_normalize: int = Field(2, ge=-(2**31), le=2**31 - 1)


class OllamaEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # keep_alive, options

    model: str = ""
    input: Any = None
    prompt: Any = None  # /api/embeddings' (the legacy route)
    truncate: bool = True
    dimensions: Optional[int] = None


async def embedded(state: ServerState, raw: Any, *, param: str, truncate: bool, pooled: bool = True
                   ) -> Tuple[List[Any], int]:
    """The vectors of a request's inputs (unnormalized) and the tokens read; every fault a 400 naming `param`."""
    llm = state.llm
    try:
        inputs, _ = embeddings.as_inputs(raw)
    except TypeError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
    if not inputs:
        raise APIError(400, f"{param} must not be empty", param=param)
    for i, x in enumerate(inputs):
        if len(x) == 0:
            raise APIError(400, f"{param}.{i} is empty: give a text or token ids to embed", param=param)
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"{param} has {len(inputs)} inputs, more than the {MAX_INPUTS} a request may have",
                       param=param)
    requests.check_prompt_bytes(state, sum(len(x.encode("utf-8", errors="surrogatepass")) if isinstance(x, str)
                                           else len(x) for x in inputs), param)

    def work() -> Tuple[List[Any], int]:
        if pooled and llm.pooling_type() == 0:  # here: the first call makes the embedding context
            raise APIError(400, "this server's pooling is 'none' (a vector per token), which this API cannot answer: "
                                "start it with --pooling mean, cls or last, or use /embeddings", param=param)
        n_ctx = llm.embedding_max_tokens
        token_lists = [llm.tokenize(x) if isinstance(x, str) else x for x in inputs]
        for i, tokens in enumerate(token_lists):
            if len(tokens) > n_ctx and not truncate:
                raise APIError(400, f"{param}.{i} is too large to embed: {len(tokens)} tokens, more than the {n_ctx} "
                                    f"an embedding of this server takes", param=param, code="context_length_exceeded")
        n_tokens = sum(min(len(t), n_ctx) for t in token_lists)
        if n_tokens > state.max_prompt_tokens:
            raise APIError(400, f"{param} is {n_tokens} tokens in all, more than the {state.max_prompt_tokens} this "
                                f"server reads for one request", param=param, code="context_length_exceeded")
        try:
            return llm.embed(token_lists, return_count=True, truncate=True)
        except (TypeError, ValueError) as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        except RuntimeError as e:  # llama.cpp could not make or run the embedding context (device memory, ...)
            raise APIError(500, f"cannot embed: {e}", kind="server_error") from None

    return await state.embedding.run(work)


def check_dimensions(state: ServerState, dimensions: Optional[int]) -> None:
    if dimensions is not None and dimensions != state.llm.n_embd():
        raise APIError(400, f"dimensions: this model's embeddings have {state.llm.n_embd()} values; it cannot give "
                            f"{dimensions}", param="dimensions")


@router.post("/v1/embeddings")
async def openai_embeddings(request: Request, state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """OpenAI's embeddings: one vector per input (a text, texts, token ids or lists of them), of length 1, as
    floats or as base64 of little-endian float32 (`encoding_format`, the official client's default)."""
    body = validated(OpenAIEmbeddingRequest, await json_body(request))
    check_dimensions(state, body.dimensions)
    vectors, n_tokens = await embedded(state, body.input, param="input", truncate=False)
    data = []
    for i, v in enumerate(vectors):
        unit = embeddings.normalized(v, 2)
        out: Union[List[float], str] = unit if body.encoding_format == "float" else \
            base64.b64encode(np.asarray(unit, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": out})
    return {"object": "list", "data": data, "model": body.model or state.model_id,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


@router.post("/embeddings", include_in_schema=False)
@router.post("/embedding", include_in_schema=False)
async def llama_server_embeddings(request: Request, state: ServerState = Depends(server_state)) -> List[Dict[str, Any]]:
    """llama-server's: `content` (or `input`), each input's rows (one pooled row, or one per token with pooling
    none) normalized by `embd_normalize`."""
    body = validated(LlamaServerEmbeddingRequest, await json_body(request))
    raw = body.content if body.content is not None else body.input
    param = "content" if body.content is not None else "input"
    if raw is None:
        raise APIError(400, "content: give the text to embed", param="content")
    vectors, _ = await embedded(state, raw, param=param, truncate=False, pooled=False)
    rows_of = (lambda v: v) if state.llm.pooling_type() == 0 else (lambda v: [v])
    return [{"index": i, "embedding": [embeddings.normalized(r, body.embd_normalize) for r in rows_of(v)]}
            for i, v in enumerate(vectors)]


@router.post("/api/embed")
@router.post("/api/embeddings")
async def ollama_embed_route(request: Request, state: ServerState = Depends(server_state)):
    """Texts' embeddings: /api/embed's (`input`, each of length 1) and the older /api/embeddings' (`prompt`, one
    text's vector as it is); ollama_embed below."""
    try:
        return await ollama_embed(request, state, legacy=request.url.path.endswith("/embeddings"))
    except APIError as e:
        return ollama_error(e)


async def ollama_embed(request: Request, state: ServerState, *, legacy: bool) -> Dict[str, Any]:
    """Ollama's /api/embed (`input`: a text or texts; vectors of length 1, cut to fit unless `truncate` is false)
    and /api/embeddings (`prompt`: one text; its vector as it is)."""
    body = validated(OllamaEmbedRequest, await json_body(request))
    check_dimensions(state, body.dimensions)
    model = body.model or state.model_id
    if legacy:
        if not isinstance(body.prompt, str):
            raise APIError(400, "prompt must be the text to embed", param="prompt")
        if not body.prompt:  # Ollama's answer to an empty prompt
            return {"embedding": []}
        vectors, _ = await embedded(state, body.prompt, param="prompt", truncate=True)
        return {"embedding": vectors[0]}
    if body.input is None:  # Ollama's way to load a model
        return {"model": model, "embeddings": []}
    t0 = asyncio.get_running_loop().time()
    vectors, n_tokens = await embedded(state, body.input, param="input", truncate=body.truncate)
    took = int((asyncio.get_running_loop().time() - t0) * 1e9)
    return {"model": model, "embeddings": [embeddings.normalized(v, 2) for v in vectors], "total_duration": took,
            "load_duration": 0, "prompt_eval_count": n_tokens}
