"""Log-probabilities, as OpenAI and llama-cpp-python give them: a text completion's `logprobs=k` (with `echo`, the
prompt's own too: an evaluation harness's log-likelihood request), a chat answer's `logprobs` / `top_logprobs`; in
`Llama` and on the server, where they equal `Llama`'s for the same prompt read in the same chunks."""
import json
import math

import numpy as np
import pytest

from h2o_local import Llama
from h2o_local.responses import ShownLogprobs, TokenLogprob, shown_logprobs, token_logprob
from h2o_local.sampling import CHAT_SURFACE
from engine_view import take_prompt_logits
from test_server import CHATML, USER, get, post, serving
from tiny_model import write_tiny_llama

SLOTS = 3
N_BATCH = 32
BUDGET = 48
# a prompt of about 200 tokens: read in several chunks, with evictions between them
PROMPT = " ".join(f"word{i % 23} and number {i}" for i in range(40))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("lp") / "chat.gguf", chat_template=CHATML, n_ctx_train=4096))


@pytest.fixture(scope="module")
def server(chat_model):
    with serving(chat_model, slots=SLOTS, budget=BUDGET, n_batch=N_BATCH) as s:
        yield s


@pytest.fixture(scope="module")
def llm(chat_model):
    """`Llama` reading prompts as the server's slots do: in the same cells, in chunks that leave a token of room for
    each other slot (for the tokens the others decode beside them)."""
    shape = dict(policy="h2o", budget=BUDGET, n_seq_max=SLOTS, kv_unified=False, keep="system", n_threads=1)
    cells = Llama(chat_model, n_batch=N_BATCH, **shape).n_ctx()
    return Llama(chat_model, n_batch=N_BATCH - (SLOTS - 1), n_ctx=cells, **shape)


def _assert_a_distribution(token_logprob, top):
    """A token's log-probability is at most 0; its top tokens are sorted, and a greedy token is the first of them."""
    assert token_logprob <= 0
    values = list(top.values()) if isinstance(top, dict) else [t["logprob"] for t in top]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert sum(math.exp(v) for v in values) <= 1 + 1e-6


# ---------------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("n_vocab, k, ties", [(50, 5, False), (151_936, 20, False), (1_000, 7, True), (10, 50, False),
                                             (1_000, 3, "flat")])
def test_a_tokens_logprob_and_top_tokens_equal_log_softmax_in_float64(n_vocab, k, ties):
    rng = np.random.default_rng(n_vocab + k)
    logits = rng.normal(0, 4, n_vocab).astype(np.float32)
    if ties:
        logits = np.round(logits)  # many equal values: the lower id first
    if ties == "flat":
        logits = np.zeros_like(logits)  # all equal: the k lowest ids
    x = logits.astype(np.float64)
    want = x - x.max() - np.log(np.exp(x - x.max()).sum())
    got = token_logprob(logits, 3, k)
    assert got.token == 3 and abs(got.logprob - want[3]) < 1e-5
    order = sorted(range(n_vocab), key=lambda t: (-want[t], t))[:min(k, n_vocab)]
    assert [t for t, _ in got.top] == order
    assert max(abs(v - want[t]) for t, v in got.top) < 1e-5


@pytest.mark.parametrize("tokens, text, shown", [
    ([1, 5], "abcd", [1, 5]),        # every token's text returned
    ([1, 5], "a", [1]),              # a stop string cut inside the first token: the second is not shown
    ([1, 2, 3, 5], "abé", [1, 2, 3]),  # a character made of two tokens is shown with both; the cut one is not
    ([1, 4], "ab", [1, 4]),          # a token with no text at the end is shown at the end
    ([1, 6], "ab", [1, 6]),          # so is one the answer ended inside a character of
    ([4, 1], "ab", [4, 1]),          # a token with no text before others comes with the next text
])
def test_the_logprobs_shown_are_those_of_the_tokens_whose_text_is_returned(tokens, text, shown):
    pieces = {1: b"ab", 2: b"\xc3", 3: b"\xa9", 4: b"", 5: b"cd", 6: b"\xe2"}
    entries = [TokenLogprob(t, -1.0, ()) for t in tokens]
    assert [e.token for e in shown_logprobs(pieces.get, entries, text)] == shown
    # streamed: each token's entry with the text it reaches, the rest at the end
    stream = ShownLogprobs(pieces.get)
    stream.drawn(entries)
    assert [e.token for e in stream.shown(text[:1]) + stream.shown(text[1:], end=True)] == shown


# ---------------------------------------------------------------------------------------------------- Llama
def test_chat_logprobs_give_each_answer_token_with_its_top_tokens(llm):
    out = llm.create_chat_completion(USER, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] and choice["logprobs"]["refusal"] is None
    # the tokens' bytes are the answer's (no stop string here: nothing was cut)
    assert bytes(b for t in content for b in t["bytes"]).decode("utf-8", errors="replace") == \
        choice["message"]["content"]
    for t in content:
        assert len(t["top_logprobs"]) == 3
        _assert_a_distribution(t["logprob"], t["top_logprobs"])
        assert t["top_logprobs"][0]["token"] == t["token"] and t["top_logprobs"][0]["logprob"] == t["logprob"]
    # streamed: the same entries, one per token
    streamed = [t for ch in llm.create_chat_completion(USER, max_tokens=8, temperature=0, logprobs=True,
                                                       top_logprobs=3, stream=True)
                if ch["choices"][0]["logprobs"] for t in ch["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    # asked for nothing, nothing given
    assert llm.create_chat_completion(USER, max_tokens=2)["choices"][0]["logprobs"] is None
    assert llm.create_chat_completion(USER, max_tokens=2, logprobs=True)["choices"][0]["logprobs"]["content"][0][
        "top_logprobs"] == []


@pytest.mark.parametrize("fields, error", [({"top_logprobs": 2}, ValueError),
                                           ({"logprobs": True, "top_logprobs": 21}, ValueError),
                                           ({"logprobs": True, "top_logprobs": -1}, ValueError),
                                           ({"logprobs": 1}, TypeError)])
def test_chat_logprobs_fields_are_checked(llm, fields, error):
    with pytest.raises(error):
        llm.create_chat_completion(USER, max_tokens=1, **fields)
    assert llm.create_chat_completion(USER, max_tokens=1)["choices"][0]["finish_reason"] == "length"


def test_a_streamed_echo_carries_the_prompts_logprobs(llm):
    whole = llm.create_completion(PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)["choices"][0]["logprobs"]
    chunks = list(llm.create_completion(PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2, stream=True))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert [x for block in streamed for x in block[key]] == whole[key]


def test_logprobs_are_those_of_the_tokens_whose_text_is_returned(llm):
    """A stop string cuts the text: the tokens after the cut are not shown, nor their logprobs (whole or streamed);
    the tokens shown spell the text up to their last one, which reaches the cut."""
    greedy = llm.create_completion(PROMPT, max_tokens=24, temperature=0, logprobs=1)["choices"][0]
    text = greedy["text"]
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isprintable() and
                text.find(text[i:i + 2]) == i)
    cut = text.find(stop)
    out = llm.create_completion(PROMPT, max_tokens=24, temperature=0, logprobs=1, stop=[stop])["choices"][0]
    assert out["text"] == text[:cut] and out["finish_reason"] == "stop"
    lp = out["logprobs"]
    assert 0 < len(lp["tokens"]) < len(greedy["logprobs"]["tokens"])
    assert lp["token_logprobs"] == greedy["logprobs"]["token_logprobs"][:len(lp["tokens"])]
    n = len(lp["tokens"])
    ids = [e.token for e in llm.generate_events(PROMPT, max_tokens=24, temperature=0) if e.token is not None]
    text_of = lambda k: llm.detokenize(ids[:k]).decode("utf-8", errors="replace")  # noqa: E731
    assert text_of(n).startswith(out["text"]) and len(text_of(n - 1)) < cut  # the last token shown reaches the cut
    streamed = [c["choices"][0]["logprobs"] for c in llm.create_completion(PROMPT, max_tokens=24, temperature=0,
                                                                          logprobs=1, stop=[stop], stream=True)]
    assert [v for block in streamed if block for v in block["token_logprobs"]] == lp["token_logprobs"]


def test_a_prompts_logits_are_handed_over_once_without_a_copy(llm):
    """The server takes an echoed prompt's logits out of the engine (the memory its echo_logprobs_mib bounds is then
    held once, by the array): the same rows as a copy, and the engine keeps none."""
    tokens = llm.tokenize(PROMPT)
    llm.reset()
    copied = llm.eval(tokens, logits_all=True).copy()
    llm.reset()
    llm.eval(tokens, logits_all=True)
    taken = take_prompt_logits(llm, 0)
    assert taken.shape == (len(tokens), llm.n_vocab()) and np.array_equal(taken, copied)
    assert take_prompt_logits(llm, 0).shape == (0, llm.n_vocab()) and llm.prompt_logits().size == 0


# ---------------------------------------------------------------------------------------------------- server
def test_a_completions_logprobs_equal_llamas(server, llm):
    port, _ = server
    status, out = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 4})
    assert status == 200, out
    mine = llm.create_completion(PROMPT, max_tokens=6, temperature=0, logprobs=4)
    assert out["choices"][0]["text"] == mine["choices"][0]["text"]
    assert out["choices"][0]["logprobs"] == mine["choices"][0]["logprobs"]
    # with a stop string that cuts the text: the shown tokens' logprobs, whole and streamed
    stop = mine["choices"][0]["text"][3:5]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 4, "stop": [stop]}
    mine = llm.create_completion(PROMPT, max_tokens=6, temperature=0, logprobs=4, stop=[stop])["choices"][0]
    status, out = post(port, "/v1/completions", body)
    assert status == 200 and out["choices"][0]["logprobs"] == mine["logprobs"]
    streamed = [e["choices"][0]["logprobs"] for e in _stream(port, "/v1/completions", {**body, "stream": True})]
    assert [v for block in streamed if block for v in block["token_logprobs"]] == mine["logprobs"]["token_logprobs"]


def test_an_echoed_prompts_logprobs_equal_llamas_through_evictions(server, llm):
    """An evaluation harness's log-likelihood request (max_tokens 0, echo, logprobs): every prompt token's
    log-probability under the bounded cache, read whole even when a saved session holds the prompt already."""
    port, _ = server
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    status, out = post(port, "/v1/completions", body)
    assert status == 200, out
    n = out["usage"]["prompt_tokens"]
    assert n > 4 * N_BATCH and out["usage"]["kv_cache"]["evicted"] > 0
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == n and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert out["choices"][0]["text"] == PROMPT and "".join(lp["tokens"]).lstrip() == PROMPT  # (a word's leading space)
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    for v, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        _assert_a_distribution(v, top)
    assert lp == llm.create_completion(PROMPT, max_tokens=0, echo=True, logprobs=1)["choices"][0]["logprobs"]
    # the same prompt again: a saved session holds it, but its logprobs need it read whole
    status, again = post(port, "/v1/completions", {**body, "max_tokens": 2, "temperature": 0})
    assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["logprobs"]["token_logprobs"][:n] == lp["token_logprobs"]
    # an evaluation harness sends token ids as a batch of one ([[ids]]): the same answer
    ids = llm.tokenize(PROMPT)
    status, batch = post(port, "/v1/completions", {**body, "prompt": [ids]})
    assert status == 200 and batch["choices"][0]["logprobs"] == lp
    status, two = post(port, "/v1/completions", {**body, "prompt": [ids, ids]})  # a batch: a choice each
    assert status == 200 and [c["logprobs"] for c in two["choices"]] == [lp, lp]
    # streamed, the prompt's come with the echo
    events = _stream(port, "/v1/completions", {**body, "stream": True})
    assert events[0]["choices"][0]["text"] == PROMPT
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]


def test_a_chats_logprobs_equal_llamas_streamed_or_whole(chat_model, llm):
    """Without saved sessions, so that the system prompt is read with the rest, as `Llama` reads it (a server that
    saves sessions reads it alone first, to share it: other chunks, other rounding)."""
    body = {"messages": USER, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    with serving(chat_model, slots=SLOTS, budget=BUDGET, n_batch=N_BATCH, session_mib=0) as (port, client):
        status, out = post(port, "/v1/chat/completions", body)
        assert status == 200, out
        mine = llm.create_chat_completion(USER, sampling=CHAT_SURFACE, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=2)
        assert out["choices"][0]["logprobs"] == mine["choices"][0]["logprobs"]
        events = _stream(port, "/v1/chat/completions", {**body, "stream": True})
        streamed = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
                    for t in e["choices"][0]["logprobs"]["content"]]
        assert streamed == out["choices"][0]["logprobs"]["content"]
        # the openai client reads them
        parsed = client.chat.completions.create(model="tiny", **body)
        assert [t.logprob for t in parsed.choices[0].logprobs.content] == \
            [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
])
def test_bad_logprobs_fields_are_a_400_naming_them(server, path, fields, param):
    port, _ = server
    body = {"max_tokens": 1, **fields, **({"prompt": "x"} if "chat" not in path else {"messages": USER})}
    status, err = post(port, path, body)
    assert status == 400 and param in json.dumps(err), err


def test_an_echoed_prompts_logits_are_bounded_in_memory(chat_model):
    """The prompt's logits are kept while it is read: a prompt whose logits would take more than the server's
    echo_logprobs_mib is refused before it is read; the same prompt without echo, or shorter, is answered."""
    with serving(chat_model, slots=1, app_kwargs={"echo_logprobs_mib": 0.05}) as (port, _):
        vocab = Llama(chat_model, budget=16).n_vocab()
        fits = int(0.05 * 2**20 / (4 * vocab))
        status, err = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 0})
        assert status == 400 and err["error"]["param"] == "logprobs" and "echo-logprobs-mib" in err["error"]["message"]
        status, _ = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 0})
        assert status == 200
        status, out = post(port, "/v1/completions", {"prompt": [1] * fits, "max_tokens": 1, "echo": True,
                                                     "logprobs": 0})
        assert status == 200 and len(out["choices"][0]["logprobs"]["tokens"]) == fits + 1


def test_a_model_is_retrieved_by_its_id(server):
    port, client = server
    assert client.models.retrieve("tiny").id == "tiny"
    status, err = get(port, "/v1/models/gpt-4")
    assert status == 404 and err["error"]["code"] == "model_not_found"


def _stream(port, path, body):
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    lines = c.getresponse().read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
