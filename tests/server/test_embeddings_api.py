"""The embedding routes (OpenAI's /v1/embeddings, llama-server's /embedding(s), Ollama's /api/embed and
/api/embeddings): each gives `Llama.embed`'s vectors for the same input, normalized as that API does; bad input is
a 400 naming its field, and the work of one request is bounded as a prompt's."""
import base64
import threading

import numpy as np
import ollama
import pytest

from test_server import CHATML, post, serving
from tiny_model import write_tiny_llama

TEXTS = ["The cat sat on the mat.", "A feline rested on the rug.", "Stock prices fell sharply today."]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("emb") / "chat.gguf", chat_template=CHATML, n_ctx_train=1024,
                                special_tokens=["<|im_start|>", "<|im_end|>"]))


@pytest.fixture(scope="module")
def server(chat_model):
    with serving(chat_model, slots=2, app_kwargs={"max_prompt_tokens": 600}) as s:
        yield s


@pytest.fixture(scope="module")
def llm(chat_model):
    from h2o_local import Llama
    return Llama(chat_model, budget=48, n_threads=1)


def unit(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def test_openai_s_client_gets_the_llama_s_vectors_of_length_one_as_floats_and_as_base64(server, llm):
    port, client = server
    out = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in out.data] == [0, 1, 2]
    for d, text in zip(out.data, TEXTS):
        np.testing.assert_allclose(d.embedding, unit(llm.embed(text)), rtol=1e-5, atol=1e-6)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(llm.tokenize(t)) for t in TEXTS)
    floats = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, out.data[0].embedding, rtol=1e-6)
    status, raw = post(port, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats.data[0].embedding, rtol=1e-6)
    ids = llm.tokenize(TEXTS[1])
    by_ids = client.embeddings.create(model="tiny", input=[ids], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, out.data[1].embedding, rtol=1e-6)


def test_llama_server_s_routes_give_rows_normalized_by_embd_normalize(server, llm):
    port, _ = server
    raw = np.asarray(llm.embed(TEXTS[0]), dtype=np.float64)
    for path in ("/embedding", "/embeddings"):
        status, out = post(port, path, {"content": TEXTS[0]})
        assert status == 200 and out[0]["index"] == 0 and len(out[0]["embedding"]) == 1
        np.testing.assert_allclose(out[0]["embedding"][0], unit(raw), rtol=1e-5, atol=1e-6)
    for norm, expected in ((-1, raw), (1, raw / np.abs(raw).sum()), (0, raw * 32760 / np.abs(raw).max()),
                           (3, raw / (np.abs(raw) ** 3).sum() ** (1 / 3))):
        status, out = post(port, "/embeddings", {"input": [TEXTS[0], TEXTS[1]], "embd_normalize": norm})
        assert status == 200 and [o["index"] for o in out] == [0, 1]
        np.testing.assert_allclose(out[0]["embedding"][0], expected, rtol=1e-5, atol=1e-5, err_msg=str(norm))


def test_ollama_s_client_gets_unit_vectors_from_embed_and_the_raw_vector_from_embeddings(server, llm):
    port, _ = server
    client = ollama.Client(host=f"http://127.0.0.1:{port}")
    out = client.embed(model="tiny", input=TEXTS[:2])
    assert len(out.embeddings) == 2 and out.prompt_eval_count == sum(len(llm.tokenize(t)) for t in TEXTS[:2])
    np.testing.assert_allclose(out.embeddings[1], unit(llm.embed(TEXTS[1])), rtol=1e-5, atol=1e-6)
    legacy = client.embeddings(model="tiny", prompt=TEXTS[0])
    np.testing.assert_allclose(legacy.embedding, llm.embed(TEXTS[0]), rtol=1e-6)
    assert client.embeddings(model="tiny", prompt="").embedding == []


def test_long_inputs_are_refused_by_openai_s_route_and_cut_by_ollama_s_unless_truncate_is_false(server, llm):
    port, _ = server
    limit = llm.embedding_max_tokens
    long_text = "word " * 200  # 1,000 byte tokens
    assert len(llm.tokenize(long_text)) > limit == 512
    status, out = post(port, "/v1/embeddings", {"input": long_text})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded" and "512" in out["error"]["message"]
    status, out = post(port, "/api/embed", {"input": long_text})
    assert status == 200 and out["prompt_eval_count"] == limit
    np.testing.assert_allclose(out["embeddings"][0], unit(llm.embed(long_text)), rtol=1e-5, atol=1e-6)
    status, out = post(port, "/api/embed", {"input": long_text, "truncate": False})
    assert status == 400 and "512" in out["error"]


def test_a_request_s_inputs_together_are_bounded_as_a_prompt(server):
    port, _ = server
    status, out = post(port, "/v1/embeddings", {"input": ["word " * 60] * 3})  # 3 x 300 tokens > 600
    assert status == 400 and out["error"]["code"] == "context_length_exceeded" and "600" in out["error"]["message"]
    status, out = post(port, "/v1/embeddings", {"input": ["a"] * 2049})
    assert status == 400 and "2048" in out["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"), ({"input": [10**9]}, "input"),
    ({"input": {"a": 1}}, "input"), ({"input": [1, "a"]}, "input"), ({"input": [[1.5]]}, "input"),
    ({"input": "a", "dimensions": 3}, "dimensions"), ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({}, "input")])
def test_bad_openai_requests_are_400s_naming_the_field(server, body, param):
    port, _ = server
    status, out = post(port, "/v1/embeddings", body)
    assert status == 400 and out["error"]["param"] == param, out


def test_embeddings_run_beside_a_chat_and_leave_its_answer_as_it_was(server):
    port, client = server
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=24, temperature=0)
    alone = client.chat.completions.create(**ask).choices[0].message.content
    answers = []
    chat = threading.Thread(target=lambda: answers.append(client.chat.completions.create(**ask)))
    chat.start()
    for _ in range(5):
        assert post(port, "/v1/embeddings", {"input": TEXTS})[0] == 200
    chat.join()
    assert answers[0].choices[0].message.content == alone


def test_a_server_with_pooling_none_answers_llama_server_s_route_with_a_row_per_token(chat_model, llm):
    with serving(chat_model, slots=1, pooling_type=0) as (port, client):
        status, out = post(port, "/embeddings", {"content": "hello", "embd_normalize": -1})
        assert status == 200 and len(out[0]["embedding"]) == len(llm.tokenize("hello"))
        status, out = post(port, "/v1/embeddings", {"input": "hello"})
        assert status == 400 and "pooling" in out["error"]["message"]


def test_serve_s_pooling_option_reaches_the_embedding_routes(chat_model, monkeypatch):
    from h2o_local.cli import main
    from h2o_local.server import listener

    served = []
    monkeypatch.setattr(listener, "serve", lambda app, **kw: served.append(app))
    assert main(["serve", "--model", chat_model, "--pooling", "last", "--threads", "1", "--slots", "1"]) == 0
    state = served[0].state.server
    assert state.llm.pooling_type() == 3
    state.scheduler.close()
    with pytest.raises(SystemExit):
        main(["serve", "--model", chat_model, "--pooling", "rank"])


def test_the_embedding_thread_holds_one_running_and_max_waiting_waiting_then_refuses_with_429():
    import asyncio

    from h2o_local.server.preparing import EmbeddingWork
    from h2o_local.server.protocol import APIError

    async def scenario():
        work = EmbeddingWork(max_waiting=1)
        release = threading.Event()
        running = [asyncio.ensure_future(work.run(release.wait)) for _ in range(2)]  # one runs, one waits
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as e:
            await work.run(lambda: None)
        assert e.value.status == 429
        release.set()
        assert await asyncio.gather(*running) == [True, True]
        assert await work.run(lambda: 7) == 7  # room again
        work.close()

    asyncio.run(scenario())
