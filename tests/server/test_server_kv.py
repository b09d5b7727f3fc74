"""The request's own cache (`kv_cache`, an extension field): a policy and budget per conversation, and the live
view of what the cache keeps that the web page draws. Driven with the official `openai` client (`extra_body`)."""
import json

import httpx
import pytest

from h2o_local import Llama
from h2o_local.policies import parse
from test_server import CHATML, USER, post, serving
from tiny_model import write_tiny_llama

LONG = [{"role": "system", "content": "You are tiny."},
        {"role": "user", "content": " ".join(f"item{i} is {i * 7 % 13}" for i in range(40))}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = str(write_tiny_llama(tmp_path_factory.mktemp("kv") / "chat.gguf", chat_template=CHATML, n_ctx_train=4096))
    with serving(model, slots=2, budget=64) as s:
        yield s


def chat(client, messages=LONG, **kv):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"kv_cache": kv} if kv else None)


def stream_chunks(port, body):
    """Every chunk of a streamed chat completion, parsed."""
    chunks = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_a_conversation_chooses_its_policy_and_budget(server):
    _, client = server
    served = chat(client)
    assert served.usage.model_extra["kv_cache"]["policy"] == "h2o-64"
    for kv, label in (({"policy": "sink", "budget": 24}, "sink-24"), ({"policy": "tova-32"}, "tova-32"),
                      ({"budget": 40}, "h2o-40"), ({"policy": "default", "budget": 48}, None)):
        use = chat(client, **kv).usage.model_extra["kv_cache"]
        assert use["budget"] == parse(use["policy"]).budget == kv.get("budget", 32)
        assert label is None or use["policy"] == label
        assert use["kept"] <= use["budget"] and use["evicted"] > 0
    # the server's own policy is untouched by what a conversation chose
    assert chat(client).usage.model_extra["kv_cache"]["policy"] == "h2o-64"


def test_a_conversation_s_policy_evicts_as_a_llama_made_with_it(server, tmp_path):
    port, client = server
    chunks = stream_chunks(port, {"messages": LONG, "max_tokens": 6, "temperature": 0, "stream": True,
                                  "kv_cache": {"policy": "sink", "budget": 20, "view": True}})
    first = chunks[0]["kv_cache"]
    # sink-20 keeps its protected prefix (the system prompt's first 10 tokens: half the budget; the 4 sinks are
    # inside it) and the newest entries
    n, kept = first["seen"], first["protected"]
    assert kept == 10 and first["positions"] == list(range(kept)) + list(range(n - (20 - kept), n))
    assert len(first["tokens"]) == n == first["evicted"] + 20


def test_the_live_view_follows_the_tokens(server):
    """Each chunk's view is the cache once its tokens are in; a reader that is behind gets the tokens drawn
    meanwhile as one chunk, with the newest view and their pieces joined (the server's mailbox merges them)."""
    port, _ = server
    body = {"messages": LONG, "max_tokens": 10, "temperature": 0, "stream": True,
            "kv_cache": {"policy": "h2o", "budget": 32, "view": True}}
    chunks = stream_chunks(port, body)
    start = chunks[0]["kv_cache"]
    assert start["policy"] == "h2o-32" and start["budget"] == 32 and start["protected"] > 0
    n_prompt = len(start["tokens"])
    assert start["seen"] == n_prompt and len(start["positions"]) == len(start["scores"]) == 32
    assert start["positions"][:start["protected"]] == list(range(start["protected"]))  # the system prompt stays
    tokens = [c["kv_cache"] for c in chunks[1:] if "piece" in c.get("kv_cache", {})]
    assert 1 <= len(tokens) <= 10
    seen = [view["seen"] for view in tokens]
    # the cache once a chunk's tokens are in (the last token is shown and never fed)
    assert seen == sorted(seen) and n_prompt <= seen[0] and seen[-1] <= n_prompt + 10
    for view in tokens:
        assert len(view["positions"]) <= 32 and all(p < view["seen"] for p in view["positions"])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(v["piece"] for v in tokens)[:len(text)]
    # a client that does not ask gets no view
    plain = stream_chunks(port, {**body, "kv_cache": {"policy": "h2o", "budget": 32}})
    assert not any("kv_cache" in c for c in plain)


def test_saved_sessions_are_continued_only_under_the_policy_that_made_them(server):
    _, client = server
    first = chat(client, messages=USER, policy="sink", budget=24)
    follow = USER + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "More."}]
    same = chat(client, messages=follow, policy="sink", budget=24)
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    other = chat(client, messages=follow, policy="sink", budget=28)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.model_extra["kv_cache"]["policy"] == "sink-28"


@pytest.mark.parametrize("kv, param, says", [
    ({"policy": "nonsense"}, "kv_cache.policy", "unknown policy"),
    ({"policy": "full"}, "kv_cache.policy", "bounded"),
    ({"budget": 100000}, "kv_cache.budget", "at most"),
    ({"policy": "h2o-16", "budget": 16}, "kv_cache.policy", "carries its budget"),
    ({"budget": 0}, "kv_cache.budget", "greater than or equal to 1"),
    ({"budget": "12"}, "kv_cache.budget", "integer"),
    ({"view": True}, "kv_cache.view", "stream"),
    ({"colour": "red"}, "kv_cache.colour", "Extra inputs"),
    ({"policy": "tova-16+q100000"}, "kv_cache.policy", "its probe takes"),  # a probe larger than a slot
])
def test_a_cache_request_that_cannot_run_is_a_400_naming_it(server, kv, param, says):
    port, client = server
    status, body = post(port, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "kv_cache": kv})
    assert status == 400 and body["error"]["param"] == param and says in body["error"]["message"], body
    assert chat(client, messages=USER).choices[0].finish_reason in ("stop", "length")  # still serving


def test_a_scoring_policy_needs_a_server_that_exports_scores(tmp_path):
    model = str(write_tiny_llama(tmp_path / "chat.gguf", chat_template=CHATML, n_ctx_train=4096))
    with serving(model, slots=1, budget=48, policy="sink") as (port, client):
        status, body = post(port, "/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                            "kv_cache": {"policy": "h2o"}})
        assert status == 400 and "--export-scores" in body["error"]["message"]
        assert chat(client, messages=USER, policy="local", budget=20).usage.model_extra["kv_cache"]["policy"] == "local-20"
    with serving(model, slots=1, budget=48, policy="sink", export_scores=True) as (port, client):
        assert chat(client, messages=USER, policy="h2o").usage.model_extra["kv_cache"]["policy"] == "h2o-48"


def test_a_per_head_conversation_shows_what_some_head_holds(server):
    port, client = server
    use = chat(client, policy="tova-32+ph").usage.model_extra["kv_cache"]
    assert use["policy"] == "tova-32+ph" and use["kept"] <= 32 and use["evicted"] > 0
    chunks = stream_chunks(port, {"messages": LONG, "max_tokens": 4, "temperature": 0, "stream": True,
                                  "kv_cache": {"policy": "tova-32+ph", "view": True}})
    last = [c["kv_cache"] for c in chunks if "kv_cache" in c and "positions" in c["kv_cache"]][-1]
    # (keep="system" takes half the budget, tova ranks the rest) tokens held by at least one layer's KV head: more
    # than the 32 cells, each with the share of heads holding it
    assert len(last["positions"]) > 32 and all(0 < s <= 1 for s in last["scores"])
    assert sum(last["scores"]) == pytest.approx(32, abs=0.01)
