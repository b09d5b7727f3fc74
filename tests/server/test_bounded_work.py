"""Bounded work per request: a grammar's size is checked before any work is done on it (the Python API raises
ValueError, the server answers 400 naming the limit and its setting), a grammar is asked about the drawn token
before it constrains the whole vocabulary, a request's generation has a time limit, and a server on a loopback
address answers only this machine's names (DNS rebinding)."""
import concurrent.futures
import http.client
import json
import resource
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from h2o_local import Llama, SamplingParams
from h2o_local.grammar import DEFAULT_LIMITS, GrammarLimits, GrammarTooLarge, check_grammar, json_schema_grammar

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ------------------------------------------------------------------------------------------ limits, no model
def test_each_grammar_limit_is_named_with_its_setting():
    small = GrammarLimits(max_bytes=64, max_rules=2, max_alternatives=3, max_repetition=10)
    cases = {"max_bytes": 'root ::= "' + "a" * 80 + '"',
             "max_rules": 'root ::= a b c\na ::= "a"\nb ::= "b"\nc ::= "c"',
             "max_alternatives": 'root ::= "a" | "b" | "c" | "d" | "e"',
             "max_repetition": 'root ::= "a"{11}'}
    for limit, gbnf in cases.items():
        with pytest.raises(GrammarTooLarge, match=f"GrammarLimits.{limit}.*--grammar-{limit.replace('_', '-')}") \
                as e:
            check_grammar(gbnf, small)
        assert e.value.limit == limit and isinstance(e.value, ValueError)
        check_grammar(gbnf, DEFAULT_LIMITS)  # the same grammar is fine under the defaults


def test_operators_inside_literals_classes_and_comments_are_not_counted():
    limits = GrammarLimits(max_alternatives=1, max_repetition=5)
    check_grammar('root ::= "a|b|c{99}" | [|{}0-9] # | | {1000}\n', limits)
    with pytest.raises(GrammarTooLarge):
        check_grammar('root ::= "a" | "b" | "c"', limits)


def test_a_schema_asking_for_millions_of_repetitions_is_refused_before_the_converter_runs():
    for schema in ({"type": "array", "items": {"type": "integer"}, "minItems": 10_000_000},
                   {"type": "string", "maxLength": 2**40},
                   {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x{5000000}$"}}},
                   {"type": "array", "items": {"type": "string", "minLength": 10**5000}}):
        start = time.perf_counter()
        with pytest.raises(GrammarTooLarge, match="max_repetition"):
            json_schema_grammar(schema)
        assert time.perf_counter() - start < 1.0  # nothing was written out (it took a minute and GBs)
    assert json_schema_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3})


def test_an_enum_of_tens_of_thousands_of_values_is_refused_and_one_of_a_thousand_served():
    with pytest.raises(GrammarTooLarge, match="too large"):
        json_schema_grammar({"enum": [f"value{i}" for i in range(30_000)]})
    with pytest.raises(GrammarTooLarge, match="alternatives"):
        json_schema_grammar({"enum": list(range(5_000))})
    assert json_schema_grammar({"enum": [f"value{i}" for i in range(1_000)]})  # OpenAI's limit per schema


def test_sampling_params_check_the_grammar_against_their_limits():
    gbnf = 'root ::= "a" | "b" | "c"'
    SamplingParams(grammar=gbnf)
    with pytest.raises(ValueError, match="alternatives"):
        SamplingParams(grammar=gbnf, grammar_limits=GrammarLimits(max_alternatives=1))
    with pytest.raises(TypeError, match="GrammarLimits"):
        SamplingParams(grammar=gbnf, grammar_limits={"max_alternatives": 1})
    with pytest.raises(ValueError, match="max_rules"):
        GrammarLimits(max_rules=0)


# ------------------------------------------------------------------------------------------ the sampler
@pytest.fixture(scope="module")
def llm(tiny_model):
    return Llama(tiny_model, policy="h2o", budget=24, n_batch=32)


def test_greedy_under_a_grammar_takes_the_best_token_the_grammar_allows(llm):
    """The grammar is asked about the drawn token first; when it refuses, the draw is made again over the tokens it
    allows: greedy still gives the allowed token with the highest logit."""
    words = ["apple", "bread", "cloud", "dance", "eagle", "flame"]
    prompt = llm.tokenize("Pick one:")
    llm.eval(prompt)
    logits = llm.last_logits()
    pieces = {t: llm.token_to_piece(t).decode("utf-8", errors="replace") for t in range(llm.n_vocab())}
    allowed = [t for t, p in pieces.items() if p and any(w.startswith(p) for w in words)]  # the grammar's first step
    assert int(np.argmax(logits)) not in allowed  # the unconstrained choice is refused: the second path runs
    best = max(allowed, key=lambda t: logits[t])
    gbnf = "root ::= " + " | ".join(f'"{w}"' for w in words)
    out = llm.generate(prompt, grammar=gbnf, max_tokens=8, temperature=0)
    assert out in words and out.startswith(pieces[best])


def test_a_sampled_grammar_answer_always_follows_the_grammar(llm):
    for seed in range(6):
        out = llm.generate("Number:", grammar='root ::= [1-9] [0-9]{0,3} "."', max_tokens=8, temperature=2.0,
                           seed=seed)
        assert out.endswith(".") and out[:-1].isdigit() and not out.startswith("0"), out


# ------------------------------------------------------------------------------------------ completion prompts
def test_completion_prompts_parse_special_tokens_as_llama_cpp_python(tiny_model):
    """A hand-written prompt's special tokens (here the tiny model's `</s>`; `<|im_start|>` in a ChatML model) are
    one token each, as llama-cpp-python's create_completion and the server read them; token ids from
    `tokenize(text, special=False)` feed the literal text."""
    llm = Llama(tiny_model, policy="full", n_ctx=256)
    text = "user: Hi</s>assistant:"
    parsed, literal = llm.tokenize(text, special=True), llm.tokenize(text, special=False)
    assert llm.token_eos() in parsed and llm.token_eos() not in literal and len(parsed) < len(literal)
    for call in (lambda p, **k: llm.create_completion(p, **k)["choices"][0]["text"], llm.generate,
                 lambda p, **k: llm.generate_batch([p], **k)[0]):
        by_text, by_tokens = call(text, max_tokens=6, temperature=0), call(parsed, max_tokens=6, temperature=0)
        assert by_text == by_tokens
    assert llm.create_completion(text, max_tokens=1)["usage"]["prompt_tokens"] == len(parsed)
    assert llm.create_completion(literal, max_tokens=1)["usage"]["prompt_tokens"] == len(literal)


# ------------------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from tiny_model import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("bw") / "chat.gguf", chat_template=CHATML,
                                n_ctx_train=4096))


@pytest.fixture(scope="module")
def server(chat_model):
    from h2o_local.server import create_app, serve_in_background

    llm = Llama(chat_model, budget=48, n_seq_max=2, kv_unified=False, n_threads=1, policy="h2o")
    app = create_app(llm, model_id="tiny", max_waiting=4, session_mib=16, grammar_max_alternatives=1_000)
    with serve_in_background(app) as port:
        yield port


def request(port, method, path, body=None, host=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if host is not None:
        headers["Host"] = host
    c.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    r = c.getresponse()
    return r.status, json.loads(r.read() or b"null")


def chat(messages="Hi", **fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": messages}], "temperature": 0, **fields}


def test_a_foreign_host_gets_403_and_this_machines_names_are_answered(server):
    """DNS rebinding: a page of evil.example that rebinds its name to 127.0.0.1 sends Host: evil.example."""
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example", ""):
        status, body = request(server, "GET", "/v1/models", host=host)
        assert status == 403 and body["error"]["code"] == "host_not_allowed", host
        assert request(server, "POST", "/v1/chat/completions", chat(max_tokens=2), host=host)[0] == 403
    for host in (f"127.0.0.1:{server}", f"localhost:{server}", "localhost", f"[::1]:{server}", "app.localhost",
                 "127.0.0.2", socket.gethostname()):
        assert request(server, "GET", "/v1/models", host=host)[0] == 200, host


def test_allowed_hosts_adds_names_and_a_non_loopback_server_is_not_checked(chat_model):
    from h2o_local.server import create_app, serve_in_background

    llm = Llama(chat_model, budget=48, n_seq_max=1, n_threads=1, policy="h2o")
    app = create_app(llm, model_id="tiny", allowed_hosts="my-box.lan, Other.Example")
    with serve_in_background(app) as port:
        assert request(port, "GET", "/health", host="my-box.lan")[0] == 200
        assert request(port, "GET", "/health", host="other.example:80")[0] == 200
        assert request(port, "GET", "/health", host="third.example")[0] == 403
    llm = Llama(chat_model, budget=48, n_seq_max=1, n_threads=1, policy="h2o")
    app = create_app(llm, model_id="tiny", host="0.0.0.0")  # listening on every address: meant to be reached
    with serve_in_background(app) as port:
        assert request(port, "GET", "/health", host="my-box.lan")[0] == 200


def test_a_grammar_over_the_limits_is_a_400_naming_the_limit_and_the_setting(server):
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                   {"enum": [f"v{i}" for i in range(5_000)]}}}}, "--grammar-max-alternatives"),
             ({"json_schema": {"type": "array", "items": {"type": "integer"}, "minItems": 10_000_000}},
              "--grammar-max-repetition"),
             ({"grammar": 'root ::= "a"{100000}'}, "--grammar-max-repetition"),
             ({"grammar": 'root ::= "' + "a" * 300_000 + '"'}, "--grammar-max-bytes")]
    for fields, setting in cases:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        status, body = request(server, "POST", "/v1/chat/completions", chat(max_tokens=4, **fields))
        assert status == 400 and body["error"]["code"] == "grammar_too_large", body
        assert setting in body["error"]["message"] and body["error"]["param"] == next(iter(fields))
        assert time.perf_counter() - start < 10  # a minute before
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 * 1024  # KiB: GBs before
    status, body = request(server, "POST", "/v1/chat/completions", chat(max_tokens=4))
    assert status == 200


class _HeldDraws(concurrent.futures.Executor):
    """An executor whose draws finish only when the test says so (a grammar draw that takes as long as we like)."""

    def __init__(self):
        self.futures = []

    def submit(self, fn, *args):
        f = concurrent.futures.Future()
        self.futures.append((f, fn, args))
        return f

    def finish_all(self):
        for f, fn, args in self.futures:
            if not f.done():
                f.set_result(fn(*args))


def test_a_grammar_draw_that_is_not_done_skips_the_step_and_the_others_go_on(tiny_model):
    """Batch(background=...): the grammar-constrained sequence's draw runs aside; until it is done that sequence is
    neither fed nor shown, the other sequence gets a token every step, and the held token joins a later step, the
    same token the draw gave. Deterministic: the draw ends when the test ends it."""
    from h2o_local import generation
    from h2o_local.text import TextAssembler

    llm = Llama(tiny_model, policy="h2o", budget=24, n_seq_max=2, kv_unified=False)
    held = _HeldDraws()
    slots = llm.slots(draws=held, draw_wait_s=0.0)
    with slots.owned():
        slots.start(0, llm.tokenize("free text"), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        slots.start(1, llm.tokenize("constrained"), SamplingParams(max_tokens=3, temperature=0,
                                                                   grammar='root ::= "abc"'))
        shown = {0: 0, 1: 0}
        for _ in range(5):
            for e in slots.step(idle_wait_s=0):
                shown[e.index] += e.token is not None
        assert shown == {0: 5, 1: 0} and len(held.futures) == 1  # one draw asked for, not one per step
        held.finish_all()
        texts = {0: "", 1: ""}
        for _ in range(10):
            for e in slots.step(idle_wait_s=0):
                texts[e.index] += e.text
            held.finish_all()
        assert texts[1] == "abc"  # the grammar's answer, drawn aside


@pytest.mark.slow
def test_a_stream_keeps_coming_while_another_slot_draws_under_a_large_grammar(smol_model):
    """From a real HTTP client, on SmolLM2 (49k tokens: a refused draw walks them once per open alternative, 0.2 to
    0.5 s for an enum of 2,000 values). Drawing inline, the stream got one token per token of the structured
    answer (both waited for each draw); now it keeps its own pace. Counted in tokens, not seconds: a loaded machine
    slows both alike."""
    from benchmarks.grammar_gap import STORY, stream_gaps
    from h2o_local.server import create_app, serve_in_background

    llm = Llama(smol_model, budget=256, n_seq_max=2, kv_unified=False, n_threads=2)
    with serve_in_background(create_app(llm, model_id="smol")) as port:
        gaps, stop = [], threading.Event()
        t = threading.Thread(target=stream_gaps, args=(port, STORY, gaps, stop), daemon=True)
        t.start()
        while len(gaps) < 10:
            time.sleep(0.01)
        schema = {"type": "object", "properties": {"pick": {"enum": [f"option number {i}" for i in range(2_000)]}},
                  "required": ["pick"]}
        start = time.perf_counter()
        status, body = request(port, "POST", "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "Pick one option."}], "max_tokens": 24,
                                "temperature": 0.7, "seed": 2, "json_schema": schema})
        end = time.perf_counter()
        stop.set()
        t.join(timeout=60)
    assert status == 200, body
    structured = body["usage"]["completion_tokens"]
    streamed = sum(start <= at <= end for at, _ in gaps)
    assert streamed >= 3 * structured, (streamed, structured)


def test_a_request_that_runs_past_its_time_limit_ends_with_length(server):
    start = time.perf_counter()
    status, body = request(server, "POST", "/v1/chat/completions",
                           chat(max_tokens=100_000, ignore_eos=True, t_max_predict_ms=300))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert 0 < body["usage"]["completion_tokens"] < 100_000 and time.perf_counter() - start < 60
    assert request(server, "POST", "/v1/chat/completions", chat(t_max_predict_ms=0))[0] == 400


SCHEMAS = st.recursive(
    st.one_of(st.just({"type": "string"}), st.just({"type": "integer"}), st.just({"type": "boolean"}),
              st.just({"type": "null"}), st.just({"type": "number"}),
              st.builds(lambda v: {"enum": v}, st.lists(st.text(max_size=6), min_size=1, max_size=2_000, unique=True)),
              st.builds(lambda n, m: {"type": "string", "minLength": n, "maxLength": n + m},
                        st.integers(0, 10**7), st.integers(0, 10**7)),
              st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(
                  ["^[a-z]+$", "^a{3}$", "^x{100000}$", "^[0-9]{2,4}-[a-z]{1,3}$", "(", "^a{2,1}$"]))),
    lambda inner: st.one_of(
        st.builds(lambda i, n: {"type": "array", "items": i, "minItems": n}, inner, st.integers(0, 10**8)),
        st.builds(lambda i, n: {"type": "array", "items": i, "maxItems": n}, inner, st.integers(0, 3_000)),
        st.builds(lambda p: {"type": "object", "properties": p, "required": sorted(p)[:1]},
                  st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), inner, min_size=1, max_size=4)),
        st.builds(lambda a: {"anyOf": a}, st.lists(inner, min_size=1, max_size=3))),
    max_leaves=6)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=SCHEMAS)
def test_any_schema_is_served_valid_json_or_refused_with_a_400(server, schema):
    status, body = request(server, "POST", "/v1/chat/completions",
                           chat(max_tokens=48, json_schema=schema, temperature=1.0, seed=1))
    assert status in (200, 400), (status, body)
    if status == 400:
        assert body["error"]["message"]
        return
    choice = body["choices"][0]
    # llama.cpp's grammar takes a byte token that starts a UTF-8 sequence and lets a later token cut it short: the
    # tiny model's byte vocabulary writes such bytes (U+FFFD in the text), which no grammar on characters can count;
    # a known limit of llama.cpp's grammar sampler (docs/serving.md), left out of the check
    if choice["finish_reason"] == "stop" and "\ufffd" not in choice["message"]["content"]:
        _validate(json.loads(choice["message"]["content"]), schema)


def _validate(value, schema):
    """The parts of JSON schema the strategy writes, checked independently of the converter."""
    if "enum" in schema:
        assert value in schema["enum"]
    elif "anyOf" in schema:
        errors = 0
        for option in schema["anyOf"]:
            try:
                _validate(value, option)
            except AssertionError:
                errors += 1
        assert errors < len(schema["anyOf"])
    elif schema.get("type") == "string":
        assert isinstance(value, str)
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    elif schema.get("type") == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
    elif schema.get("type") == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
    elif schema.get("type") == "boolean":
        assert isinstance(value, bool)
    elif schema.get("type") == "null":
        assert value is None
    elif schema.get("type") == "array":
        assert isinstance(value, list)
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
        for item in value:
            _validate(item, schema["items"])
    elif schema.get("type") == "object":
        assert isinstance(value, dict)
        for name in schema.get("required", []):
            assert name in value
        for name, item in value.items():
            if name in schema["properties"]:
                _validate(item, schema["properties"][name])
