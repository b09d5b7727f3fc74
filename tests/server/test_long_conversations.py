"""A conversation that outgrows the trained context (issue 73): a bounded server takes any resent conversation on
every route (it reads only what no saved conversation holds, and a history no session holds by the bounded prefill,
within --max-history-bytes), the full cache keeps its 400; the template's own system prompt is protected like a
given one; ChatSession goes on from what a re-rendered history shares with its cache."""
import anthropic
import ollama
import pytest

from h2o_local import Llama
from h2o_local.chat_session import ChatSession
from test_server import CHATML, post, serving
from tiny_model import write_tiny_llama

N_TRAIN = 256
# SmolLM2's shape: without a system message the template writes one of its own
DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a tiny default.<|im_end|>\n"
                  "{% endif %}" + CHATML)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("long") / "chat.gguf", chat_template=CHATML,
                                n_ctx_train=N_TRAIN))


def words(turn):
    return f"turn {turn}: " + " ".join(f"w{(turn * 7 + i) % 50}" for i in range(30))


@pytest.mark.parametrize("route", ["openai", "ollama", "anthropic"])
def test_a_resent_conversation_goes_on_past_the_trained_context_on_every_route(chat_model, route):
    """Eight turns of about 200 tokens, the whole history resent each time, pass max_prompt_tokens (the trained
    context, 256) several times: every turn is answered and reads only its own new tokens."""
    with serving(chat_model, slots=1, budget=48) as (port, openai_client):
        history = [{"role": "system", "content": "Be brief."}]
        fed = []
        for turn in range(8):
            history.append({"role": "user", "content": words(turn)})
            if route == "openai":
                out = openai_client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                                            temperature=0)
                answer, used = out.choices[0].message.content, out.usage
                fed.append(used.prompt_tokens - used.prompt_tokens_details.cached_tokens)
            elif route == "ollama":
                out = ollama.Client(host=f"http://127.0.0.1:{port}").chat(
                    model="tiny", messages=history, options={"temperature": 0, "num_predict": 4})
                answer = out.message.content
            else:
                out = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0).messages.create(
                    model="tiny", system=history[0]["content"], messages=history[1:], max_tokens=4)
                answer = "".join(b.text for b in out.content if b.type == "text")
            history.append({"role": "assistant", "content": answer})
        total = Llama(chat_model, budget=48).chat_tokens(history[:-1])[0]
        assert len(total) > 3 * N_TRAIN
        if route == "openai":  # each turn read only itself (and the previous answer), not the history
            assert max(fed[1:]) < 2 * len(Llama(chat_model, budget=48).tokenize(words(7))) < len(total) / 3


def test_a_fresh_prompt_past_the_limit_and_a_full_cache_s_long_history_are_refused(chat_model):
    long_turn = [{"role": "user", "content": words(0) * 3}]
    with serving(chat_model, slots=1, budget=48, app_kwargs={"max_prompt_tokens": 64}) as (port, _):
        status, out = post(port, "/v1/chat/completions", {"messages": long_turn, "max_tokens": 1})
        assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
        resent = [{"role": "user", "content": words(1)}, {"role": "assistant", "content": "ok"}] * 6 + long_turn
        assert post(port, "/v1/chat/completions", {"messages": resent, "max_tokens": 1})[0] == 200
    with serving(chat_model, slots=1, policy="full", budget=None, n_ctx=N_TRAIN) as (port, _):
        resent = [{"role": "user", "content": words(1)}, {"role": "assistant", "content": "ok"}] * 8
        status, out = post(port, "/v1/chat/completions", {"messages": resent + long_turn, "max_tokens": 1})
        assert status == 400 and out["error"]["code"] == "context_length_exceeded", out


def test_a_conversation_past_the_history_byte_limit_is_refused_before_it_is_read(chat_model):
    with serving(chat_model, slots=1, budget=48, app_kwargs={"max_history_bytes": 2048}) as (port, _):
        resent = [{"role": "user", "content": words(1)}, {"role": "assistant", "content": "ok"}] * 30
        status, out = post(port, "/v1/chat/completions", {"messages": resent, "max_tokens": 1})
        assert status == 400 and "--max-history-bytes" in out["error"]["message"], out


def test_the_templates_own_system_prompt_is_protected_like_a_given_one(tmp_path):
    model = str(write_tiny_llama(tmp_path / "default.gguf", chat_template=DEFAULT_SYSTEM, n_ctx_train=N_TRAIN,
                                 special_tokens=["<|im_start|>", "<|im_end|>"]))
    llm = Llama(model, budget=96, keep="system", n_threads=1)
    assert llm.chat_template.default_system.startswith("<|im_start|>system\nYou are a tiny default.<|im_end|>")
    tokens, n_keep = llm.chat_tokens([{"role": "user", "content": "hi"}])
    default = llm.tokenize("<|im_start|>system\nYou are a tiny default.<|im_end|>\n", special=True)
    assert n_keep >= len(default) and tokens[:len(default)] == default
    plain = Llama(str(write_tiny_llama(tmp_path / "plain.gguf", chat_template=CHATML)), budget=32, keep="system")
    assert plain.chat_template.default_system == "" and plain.chat_tokens([{"role": "user", "content": "hi"}])[1] == 0
    chat = ChatSession(llm, max_tokens=4, temperature=0)
    for turn in range(12):  # far past the budget and the trained context
        "".join(chat.send(words(turn)))
    st = llm.kv_state()
    assert st.origins[:len(default)].tolist() == list(range(len(default)))  # still there, as first fed
    assert st.tokens[:len(default)].tolist() == default


def test_a_chat_whose_template_writes_its_answers_otherwise_goes_on_from_the_common_part(tmp_path):
    """A template that writes a past answer right after "assistant" while its generation prompt ends with a newline
    (the same happens when an answer's first spaces tokenize with the template's newline): neither the cache nor the
    last prompt is a prefix of the history rendered again. The turn goes back to where they part and reads from
    there, not the whole history."""
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant{{ m['content'] }}"
                "<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model = str(write_tiny_llama(tmp_path / "rewrites.gguf", chat_template=template, n_ctx_train=N_TRAIN,
                                 special_tokens=["<|im_start|>", "<|im_end|>"]))
    chat = ChatSession(Llama(model, budget=48, n_threads=1), max_tokens=4, temperature=0)
    last_prompt = 0
    for turn in range(8):
        "".join(chat.send(words(turn)))
        if turn:
            assert chat.last.reused_tokens >= last_prompt - 1  # all but the newline the template dropped
            assert chat.last.prompt_tokens < len(words(turn)) + 80  # the answer and this turn, not the history
        last_prompt = chat.last.reused_tokens + chat.last.prompt_tokens


def test_a_resent_history_that_parts_from_a_saved_answer_goes_on_from_where_it_parts(chat_model):
    """A client's resent history re-tokenizes a saved answer otherwise where the answer meets the template's newline
    (BPE merges an answer's first spaces with it): the request parts from the saved conversation one token before the
    answer, where neither the saved prompt nor the saved answer is a prefix of it. It reuses all but what follows the
    parting, and reads only that; a request that parts earlier (another question after the same first tokens)
    reads everything."""
    with serving(chat_model, slots=1, budget=48) as (port, _):
        first = list(range(10, 210))
        status, out = post(port, "/completion", {"prompt": first, "n_predict": 6, "temperature": 0,
                                                 "return_tokens": True})
        assert status == 200 and out["tokens_cached"] == 0
        resent = first[:-1] + [first[-1] + 1] + out["tokens"] + list(range(60, 90))
        status, again = post(port, "/completion", {"prompt": resent, "n_predict": 2, "temperature": 0})
        assert status == 200 and again["tokens_cached"] == len(first) - 1
        assert again["timings"]["prompt_n"] == len(resent) - (len(first) - 1)
        status, other = post(port, "/completion", {"prompt": first[:150] + list(range(30, 90)), "n_predict": 2,
                                                   "temperature": 0})
        assert status == 200 and other["tokens_cached"] == 0


def test_the_session_rule_continues_a_resent_history_only_from_within_its_last_answer():
    from h2o_local.sessions import ANSWER_SLACK, SessionCache

    class Snap:
        nbytes = 10

    cache = SessionCache(1 << 20)
    prompt, answer = list(range(100)), [500, 501, 502]
    cache.put(prompt + answer, len(prompt) + len(answer), 4, Snap(), answer_from=len(prompt))
    assert cache.held(prompt + answer + [7, 8], 4) == len(prompt) + len(answer)       # a prefix: all of it
    assert cache.held(prompt + [500, 999, 7], 4) == len(prompt) + 1                    # parts inside the answer
    assert cache.held(prompt[:-1] + [777, 500, 501], 4) == len(prompt) - 1             # one token before it
    assert cache.held(prompt[:-ANSWER_SLACK] + [777, 778, 500], 4) == len(prompt) - ANSWER_SLACK
    assert cache.held(prompt[:-ANSWER_SLACK - 1] + [777] * 6, 4) == 0                  # earlier: another request
    assert cache.held(prompt[:-1] + [777], 5) == 0                                     # another protected prefix
    assert cache.held(prompt + answer, 4) == len(prompt) + len(answer)                 # resent as it is
    cache.put(prompt[:4], 4, 4, Snap())                                                 # a prefix alone: no answer
    assert cache.held(prompt[:3] + [9, 9], 4) == 0
    short = SessionCache(1 << 20)                  # a prompt of 3 tokens: parting after its first is another request
    short.put([1, 2, 3, 600, 601], 5, 0, Snap(), answer_from=3)
    assert short.held([1, 9, 9, 9, 9, 9, 9], 0) == 0 and short.held([1, 2, 3, 600, 601, 7], 0) == 5
