"""Requests translated into engine values: a request's sampling parameters (and its grammar's sampler), its own
policy, recall and live view (`kv_cache`), its time limit and the prompt's byte bound, each refused with the
OpenAI-shaped 400 that names the field."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .. import grammar, policies
from ..policies import Policy
from ..sampling import SamplingParams
from .protocol import APIError, RequestFields
from .state import ServerState


def conversation_cache(state: ServerState, body: RequestFields) -> Tuple[Optional[Policy], bool, Optional[bool]]:
    """The request's own policy (None: the server's), whether it asked for the live view, and its recall setting
    (None: the server's) (`kv_cache`)."""
    policy, view = conversation_policy(state, body)
    asked = None if body.kv_cache is None else body.kv_cache.recall
    try:
        if asked:
            state.llm.check_recall(policy)
        elif asked is None and state.llm.recall and policy is not None:
            state.llm.check_recall(policy)  # the server recalls where a conversation's own policy can
    except ValueError as e:
        if asked:
            raise APIError(400, f"kv_cache.recall: {e}", param="kv_cache.recall") from None
        asked = False
    return policy, view, asked


def conversation_policy(state: ServerState, body: RequestFields) -> Tuple[Optional[Policy], bool]:
    """The request's own policy (None: the server's) and whether it asked for the live view."""
    asked = body.kv_cache
    if asked is None:
        return None, False
    llm = state.llm
    if asked.view and not body.stream:
        raise APIError(400, "kv_cache.view needs stream: true (the view comes with every streamed chunk)",
                       param="kv_cache.view")
    if asked.policy is None and asked.budget is None:
        return None, asked.view
    if not llm.policy.bounded:
        raise APIError(400, "this server keeps the full cache; start it with a budget to choose a policy per "
                            "conversation", param="kv_cache")
    name, budget = asked.policy, asked.budget
    try:
        if name is not None and (name == "full" or "-" in name):  # a label: it carries its budget
            if budget is not None:
                raise ValueError(f"the label {name!r} carries its budget; give kv_cache.budget with a policy name")
            value = policies.parse(name)
        else:
            server = llm.policy
            if name is None:  # the server's kind of policy, with this budget
                name = "default" if server.label == policies.resolve(None, server.budget).label else server.name
            value = policies.resolve(None if name == "default" else name, budget or llm.budget)
    except (TypeError, ValueError) as e:
        raise APIError(400, f"kv_cache.policy: {e}", param="kv_cache.policy") from None
    if not value.bounded:
        raise APIError(400, "kv_cache.policy: a slot holds a bounded cache; 'full' cannot run in it",
                       param="kv_cache.policy")
    limit = max_budget(state, value)
    if limit < 1:
        raise APIError(400, f"kv_cache.policy: its probe takes {state.llm.probe_cells(value)} cells, more "
                            f"than a slot of this server has ({state.scheduler.cells_per_slot})",
                       param="kv_cache.policy")
    if value.budget > limit:
        raise APIError(400, f"kv_cache.budget: {value.budget} entries do not fit in a slot of this server; at most "
                            f"{limit} with policy {value.name}", param="kv_cache.budget")
    if value.needs_scores and not llm.policy.needs_scores and not llm.export_scores:
        raise APIError(400, f"kv_cache.policy: {value.name} ranks by attention scores, which this server does not "
                            f"export (start it with --export-scores or a scoring policy)", param="kv_cache.policy")
    return value, asked.view


def max_budget(state: ServerState, policy: Optional[Policy] = None) -> int:
    """The largest budget a conversation can take in a slot (with `policy`'s probe; default: the server's)."""
    return state.scheduler.cells_per_slot - 1 - state.llm.probe_cells(policy)


def text_bytes(content: Any) -> int:
    """The bytes of a message's text (a string, or a list of text parts)."""
    if isinstance(content, str):
        return len(content.encode("utf-8", errors="surrogatepass"))
    if isinstance(content, list):
        return sum(text_bytes(part.get("text") if isinstance(part, dict) else part) for part in content)
    return 0


def check_prompt_bytes(state: ServerState, n_bytes: int, param: str, history: bool = False) -> None:
    """Text that cannot fit in max_prompt_tokens is refused before anything tokenizes it; a resent conversation
    (`history`) on a bounded cache, which is read whatever its length, within max_history_bytes."""
    if history and state.llm.budget is not None:
        limit = state.settings.max_history_bytes
        if n_bytes > limit:
            raise APIError(400, f"the conversation's text has {n_bytes} bytes; this server reads at most {limit} "
                                f"bytes of a conversation (--max-history-bytes)", param=param,
                           code="context_length_exceeded")
        return
    if n_bytes > state.max_prompt_bytes:
        raise APIError(400, f"the prompt's text has {n_bytes} bytes, more than {state.max_prompt_tokens} tokens "
                            f"of this model can hold; this server takes at most {state.max_prompt_tokens} tokens",
                       param=param, code="context_length_exceeded")


def check_echo_logprobs(state: ServerState, n_tokens: int) -> None:
    """A prompt whose own logprobs are asked for keeps every token's logits while it is read: bounded in bytes."""
    mib = n_tokens * state.llm.n_vocab() * 4 / 2**20
    if mib > state.settings.echo_logprobs_mib:
        raise APIError(400, f"echo with logprobs keeps the logits of every prompt token: {n_tokens} tokens of this "
                            f"model take {mib:.0f} MiB, more than this server allows ({state.settings.echo_logprobs_mib:g}"
                            f" MiB, --echo-logprobs-mib)", param="logprobs")


async def sampling(state: ServerState, defaults: SamplingParams, body: RequestFields, max_tokens: Optional[int],
                    tokens: List[int], preserved: Tuple[int, ...] = ()) -> Tuple[SamplingParams, Any]:
    """The request's sampling parameters, and with a grammar its sampler, made (the grammar parsed and checked
    against the vocabulary) in the preparing threads: a grammar that does not parse, allows nothing or needs more
    work than allowed is the request's 400, here. `preserved`: the special tokens its answer shows."""
    changes: Dict[str, Any] = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "typical_p",
                                                              "mirostat_mode", "mirostat_tau", "mirostat_eta", "seed",
                                                              "presence_penalty", "frequency_penalty", "repeat_penalty")
                               if getattr(body, k) is not None}
    if body.seed is None and state.settings.seed is not None:  # the server's --seed
        changes["seed"] = state.settings.seed
    if body.mirostat is not None:
        if body.mirostat_mode is not None and body.mirostat_mode != body.mirostat:
            raise APIError(400, "mirostat and mirostat_mode differ: give one", param="mirostat_mode")
        changes["mirostat_mode"] = body.mirostat
    if body.repetition_penalty is not None:
        if body.repeat_penalty is not None and body.repeat_penalty != body.repetition_penalty:
            raise APIError(400, "repeat_penalty and repetition_penalty differ: give one", param="repetition_penalty")
        changes["repeat_penalty"] = body.repetition_penalty
    if body.repeat_last_n is not None:
        changes["penalty_last_n"] = body.repeat_last_n
    given = [k for k in ("response_format", "grammar", "json_schema") if getattr(body, k) not in (None, "")]
    if len(given) > 1:
        raise APIError(400, f"give one of {', '.join(given)}, not several", param=given[1])
    limits = state.settings.grammar_limits()
    changes["grammar_limits"] = limits
    if preserved:
        changes["preserved_tokens"] = preserved
    try:
        if body.grammar:
            changes["grammar"] = body.grammar
        elif body.json_schema is not None:
            changes["grammar"] = grammar.json_schema_grammar(body.json_schema, limits)
        elif body.response_format is not None:
            changes["grammar"] = grammar.response_format_grammar(body.response_format, limits)
    except ValueError as e:
        raise APIError(400, str(e), param=given[0], code=limit_code(e)) from None
    if body.logit_bias:
        changes["logit_bias"] = token_bias(state, body.logit_bias)
    if body.ignore_eos:
        changes["ignore_eos"] = True
    if body.stop is not None:
        changes["stop"] = body.stop
    # a bounded cache never fills up: without a cap a model that never ends would hold its slot for good
    asked = max_tokens if max_tokens is not None else defaults.max_tokens  # None: no limit asked for
    changes["max_tokens"] = state.max_tokens if asked is None else min(asked, state.max_tokens)
    try:
        params = defaults.replace(**changes)
        if not params.grammar:
            return params, None
        return params, await state.grammars.sampler(state.llm, params, tokens)
    except (TypeError, ValueError) as e:
        named = str(e).split(" ", 1)[0]  # SamplingParams' messages start with the field's name
        param = given[0] if given and "grammar" in str(e) else named if named in type(body).model_fields else None
        raise APIError(400, str(e), param=param, code=limit_code(e)) from None


def token_bias(state: ServerState, pairs: List[Tuple[Any, float]]) -> Dict[int, float]:
    """A request's logit_bias (`RequestFields`'s pairs) by token id: a text's bias on each of its tokens."""
    bias: Dict[int, float] = {}
    for key, value in pairs:
        tokens = [key] if isinstance(key, int) else state.llm.tokenize(key, add_bos=False, special=False)
        try:
            tokens = state.llm.check_token_ids(tokens, "logit_bias token")
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param="logit_bias") from None
        for token in tokens:
            bias[token] = value
    return bias


def time_limit(state: ServerState, body: RequestFields) -> float:
    """Seconds the request may generate: the server's limit, or less when the request asks (t_max_predict_ms)."""
    limit = state.settings.request_time_limit_s
    return limit if body.t_max_predict_ms is None else min(limit, body.t_max_predict_ms / 1000)


def limit_code(error: Exception) -> Optional[str]:
    return "grammar_too_large" if isinstance(error, grammar.GrammarTooLarge) else None
