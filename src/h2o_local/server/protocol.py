"""The requests the server takes and the errors it gives, in OpenAI's shapes: pydantic request models (with the
limits and the fields it refuses), and `APIError` / `error_response` ({"error": {"message", "type", "param",
"code"}})."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator


# the roles OpenAI's chat API knows
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


# OpenAI request fields this server does not implement, with the values that ask for nothing (accepted, since
# many clients send them with their defaults); any other value is a 400 naming the field
UNSUPPORTED = {"functions": (None, []), "function_call": (None, "none"), "best_of": (None, 1),
               # llama-server's samplers this server does not have (its tfs_z is ignored, as llama-server ignores it:
               # llama.cpp removed tail-free sampling)
               "xtc_probability": (None, 0, 0.0), "dry_multiplier": (None, 0, 0.0),
               "top_n_sigma": (None, -1, -1.0, 0, 0.0), "n_probs": (None, 0),
               # llama-server's probabilities after its sampling chain (n_probs gives the model's own)
               "post_sampling_probs": (None, False)}


# stop strings are searched in the text after every token: bounded, as OpenAI bounds them (it takes 4; clients that
# send a few more to llama-server keep working here)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024  # OpenAI takes 300


class KVCacheRequest(BaseModel):
    """The request's own cache (an extension field, `kv_cache`): a policy and budget for this conversation, inside
    the cells a slot has, and the live view of what the cache keeps."""

    model_config = ConfigDict(extra="forbid")

    policy: Optional[str] = Field(default=None, min_length=1, max_length=128,
                                  description="a policy name (h2o, tova, sink, ...; 'default': the default policy) or "
                                              "a label (h2o-128+s4); default: the server's")
    budget: Optional[StrictInt] = Field(default=None, ge=1, description="KV entries kept (tokens); default: the server's")
    view: bool = Field(default=False, description="streamed chunks carry what the cache holds (kv_cache)")
    recall: Optional[bool] = Field(default=None, description="keep what this conversation evicts in host memory and "
                                   "recall it for each new message (default: the server's --recall, where the "
                                   "conversation's policy can)")


class RequestFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are kept to be checked against UNSUPPORTED

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=100.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    typical_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)  # llama-server's locally typical sampling
    # Mirostat (llama-server's `mirostat`; llama-cpp-python's server: `mirostat_mode`): 0 off, 1 or 2
    mirostat: Optional[StrictInt] = Field(default=None, ge=0, le=2)
    mirostat_mode: Optional[StrictInt] = Field(default=None, ge=0, le=2)
    mirostat_tau: Optional[float] = Field(default=None, gt=0.0, le=100.0)
    mirostat_eta: Optional[float] = Field(default=None, gt=0.0, le=100.0)
    # OpenAI's penalties and bias (its ranges), llama-server's repeat_penalty (vLLM's name: repetition_penalty) and
    # repeat_last_n
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repeat_penalty: Optional[float] = Field(default=None, gt=0.0, le=10.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=10.0)
    repeat_last_n: Optional[int] = Field(default=None, ge=0, le=4096)
    # OpenAI's {"<token id>": bias}, and llama-server's forms: [[id, bias]], [["text", bias]], {"text": bias}; a
    # text's bias goes to each of its tokens, a bias of false bans them (normalized to [(id or text, bias)])
    logit_bias: Union[Dict[str, Union[StrictBool, float]], List[List[Any]], None] = None
    ignore_eos: bool = False  # llama-server's: never end at an end-of-generation token (needs max_tokens)
    # structured output: OpenAI's response_format, llama-server's grammar (GBNF) and json_schema
    response_format: Optional[Dict[str, Any]] = None
    grammar: Optional[str] = None  # bounded by the server's grammar limits (grammar_max_bytes, ...)
    json_schema: Optional[Dict[str, Any]] = None
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[Dict[str, Any]] = None
    n: int = Field(default=1, ge=1, le=1)
    kv_cache: Optional[KVCacheRequest] = None
    # llama-server's: the longest this request may generate, ms (then finish_reason "length"); the server's
    # request_time_limit_s caps it
    t_max_predict_ms: Optional[StrictInt] = Field(default=None, ge=1)
    # vLLM's: saved conversations (and shared system prompts) are continued only by requests with the same salt, so
    # that clients that do not trust each other cannot learn what the others sent (`cached_tokens`)
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=256)

    @field_validator("logit_bias")
    @classmethod
    def _bounded_bias(cls, bias):
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(bias)}")
        pairs = list(bias.items()) if isinstance(bias, dict) else bias
        out = []
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"logit_bias entries are [token id or text, bias], got {pair!r}")
            key, value = pair
            if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9:
                key = int(key)
            if isinstance(key, bool) or not isinstance(key, (int, str)) or isinstance(key, int) and key < 0:
                raise ValueError(f"logit_bias keys are token ids or text, got {key!r}")
            if isinstance(key, str) and not 0 < len(key) <= MAX_STOP_CHARS:
                raise ValueError(f"a logit_bias text has 1 to {MAX_STOP_CHARS} characters")
            if value is False:
                value = float("-inf")  # llama-server's: never this token
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values are in [-100, 100] (or false: never), got {value!r} for {key!r}")
            out.append((key, float(value)))
        return out

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(len(x) > MAX_STOP_CHARS for x in strings):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return stop

    def refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not any(value == ok and type(value) is type(ok) or (value is ok)
                                               for ok in UNSUPPORTED[name]):
                raise APIError(400, f"{name} is not supported by this server (got {value!r})", param=name,
                               code="unsupported_parameter")


# the most top tokens a request may ask for at each position (OpenAI's bound for chat)
MAX_TOP_LOGPROBS = 20


class CompletionRequest(RequestFields):
    # a text, token ids (a JSON true is not token 1), or a batch of one of either (OpenAI's list forms; evaluation
    # harnesses send [[ids]])
    prompt: Union[str, List[str], List[StrictInt], List[List[StrictInt]]]
    echo: bool = False
    # each answer token's logprob and this many top tokens; with echo, the prompt's tokens' too (the prompt is then
    # read whole, its logits kept: bounded by the server's echo_logprobs_mib)
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # the text after the completion: a fill-in-the-middle prompt, for a model with its tokens (completions.infill_prompt)
    suffix: Optional[str] = None
    n: int = Field(default=1, ge=1, le=16)  # answers per prompt (whole, not streamed, when more than one in all)

    def prompts(self) -> List[Union[str, List[int]]]:
        """The prompts: one, or each of a batch (OpenAI's list forms)."""
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            return list(p)
        return [p]


class ChatCompletionRequest(RequestFields):
    messages: List[Dict[str, Any]] = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=16)  # choices (whole, not streamed, when more than one)
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    tools: Optional[List[Dict[str, Any]]] = Field(default=None, max_length=128)
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None  # False: at most the first call is returned
    # messages' contents are text (OpenAI): special-token text in them stays text, it cannot close a turn or open
    # another; true parses it (llama-server's and Ollama's behaviour), for a client that writes turns on purpose
    special_in_content: bool = False
    logprobs: Optional[StrictBool] = None  # choices[0].logprobs.content: each answer token's logprob
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # with logprobs: true
    # llama-server's and vLLM's: more variables the chat template reads ({"enable_thinking": false} for Qwen3)
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    # llama-server's: "auto" (the default here, as there) gives a thinking model's reasoning as
    # message.reasoning_content, apart from its content; "none" leaves the answer as written
    reasoning_format: Optional[str] = None
    # vLLM's and transformers': a final assistant message is continued (a prefill) with continue_final_message
    # true or add_generation_prompt false, instead of a new answer after it
    continue_final_message: StrictBool = False
    add_generation_prompt: StrictBool = True


class InfillChunk(BaseModel):
    """One file of the project as context (llama-server's: its text is required, its name optional)."""
    model_config = ConfigDict(extra="forbid")

    filename: str = "tmp"
    text: str


class _LlamaServerAnswer(RequestFields):
    """What llama-server's /completion and /infill take beyond the sampling fields: n_predict (-1: until the end,
    within the server's max_tokens), each generated token's id in `tokens` (return_tokens), the n most likely
    tokens' log-probabilities (n_probs, as `completion_probabilities`) and id_slot (accepted: a conversation's saved
    cache is found by its tokens here, in whatever slot)."""
    n_predict: Optional[StrictInt] = None
    return_tokens: StrictBool = False
    n_probs: StrictInt = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    id_slot: StrictInt = -1


class LlamaServerCompletionRequest(_LlamaServerAnswer):
    """llama-server's own /completion: a prompt (text, special tokens parsed, or token ids)."""
    prompt: Union[str, List[StrictInt]]


class InfillRequest(_LlamaServerAnswer):
    """llama-server's /infill (code editors' completion: llama.vscode, llama.vim): the code before the cursor and
    after it, `input_extra` files of the project as context, `prompt` (text after the prefix)."""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: List[InfillChunk] = Field(default_factory=list, max_length=256)
    prompt: str = ""


class TokenizeRequest(BaseModel):
    """llama-server's /tokenize."""
    model_config = ConfigDict(extra="forbid")

    content: str
    add_special: StrictBool = False  # the model's BOS, where it adds one
    parse_special: StrictBool = True  # special-token text as its tokens (False: as plain text)
    with_pieces: StrictBool = False  # each id with its text: a string, or its bytes where they are not whole UTF-8


class ExtrasTokenizeRequest(BaseModel):
    """llama-cpp-python's /extras/tokenize and /extras/tokenize/count (BOS added, special-token text parsed)."""
    model_config = ConfigDict(extra="forbid")

    input: str
    model: Optional[str] = None


class DetokenizeRequest(BaseModel):
    """llama-server's /detokenize and llama-cpp-python's /extras/detokenize: token ids to text."""
    model_config = ConfigDict(extra="forbid")

    tokens: List[StrictInt]
    model: Optional[str] = None


class APIError(Exception):
    """An HTTP error in OpenAI's shape; `extra`: more fields of the error object (llama-server's n_prompt_tokens and
    n_ctx beside a context overflow)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, extra: Optional[Dict[str, Any]] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.extra = extra or {}

    def body(self) -> Dict[str, Any]:
        """OpenAI's error object: as a response's body, or as a started stream's last event."""
        out = error_body(self.message, self.kind, self.param, self.code)
        out["error"].update(self.extra)
        return out


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
           code: Optional[str] = None, headers: Optional[Dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)
