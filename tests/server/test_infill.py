"""Fill-in-the-middle for code models (editors' completion): the prompt llama-server's /infill makes of the code
around the gap (the model's FIM tokens, the project's files as context), through `Llama.create_completion(suffix=)`,
OpenAI's `suffix`, llama-server's `/infill` (llama.vscode, llama.vim) and Ollama's `suffix`; a model without FIM
tokens refuses it by name."""
import json

import httpx
import ollama
import pytest

from h2o_local import Llama
from h2o_local.completions import infill_prompt
from test_server import post, serving
from tiny_model import write_tiny_llama

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
SAID = 'root ::= "return a + b"'


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """A model whose vocabulary has Qwen2.5-Coder's FIM tokens (llama.cpp finds them by their text)."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("fim") / "coder.gguf", special_tokens=FIM, n_ctx_train=4096))


def test_the_prompt_is_the_code_around_the_gap_between_the_model_s_own_tokens(coder):
    llm = Llama(coder, budget=256)
    pre, suf, mid, rep, sep = llm.info.fim
    assert [llm.detokenize([t], special=True).decode() for t in llm.info.fim] == FIM

    def text(s):
        return llm.tokenize(s, add_bos=False, special=False)

    assert infill_prompt(llm, PREFIX, SUFFIX) == [llm.token_bos(), pre] + text(PREFIX) + [suf] + text(SUFFIX) + [mid]
    assert infill_prompt(llm, PREFIX, SUFFIX, prompt="# sum\n", extra=[("util.py", "X = 1\n")]) == \
        [rep] + text("myproject\n") + [sep] + text("util.py\n") + text("X = 1\n") + [sep] + text("filename\n") + \
        [llm.token_bos(), pre] + text(PREFIX) + text("# sum\n") + [suf] + text(SUFFIX) + [mid]
    # the code is text: a FIM token's spelling in it does not open another gap
    assert infill_prompt(llm, "<|fim_middle|>", "")[2:-2] == text("<|fim_middle|>") != [mid]
    out = llm.create_completion(PREFIX, suffix=SUFFIX, max_tokens=20, temperature=0, grammar=SAID)
    assert out["choices"][0]["text"] == "return a + b" and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["prompt_tokens"] == len(infill_prompt(llm, PREFIX, SUFFIX))
    with pytest.raises(ValueError, match="echo"):
        llm.create_completion(PREFIX, suffix=SUFFIX, echo=True)


def test_a_model_without_fim_tokens_refuses_a_suffix_by_name(tiny_model):
    llm = Llama(tiny_model, budget=64)
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        llm.create_completion(PREFIX, suffix=SUFFIX, max_tokens=2)
    assert llm.create_completion(PREFIX, suffix="", max_tokens=2)["usage"]["prompt_tokens"] == \
        len(llm.tokenize(PREFIX))  # an empty suffix asks for nothing there (clients send it)
    with serving(tiny_model, slots=1, budget=64) as (port, client):
        for path, body, param in (("/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX}, "suffix"),
                                  ("/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX}, "input_prefix")):
            status, out = post(port, path, body)
            assert status == 400 and out["error"]["param"] == param and "fill-in-the-middle" in out["error"]["message"]
        r = httpx.post(f"http://127.0.0.1:{port}/api/generate", json={"prompt": PREFIX, "suffix": SUFFIX})
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]


def test_every_server_route_reads_the_same_fim_prompt(coder):
    llm = Llama(coder, budget=256)
    n_prompt = len(infill_prompt(llm, PREFIX, SUFFIX))
    extra = [{"filename": "util.py", "text": "X = 1\n"}]
    with serving(coder, slots=2, budget=256) as (port, client):
        done = client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=20, temperature=0,
                                         extra_body={"grammar": SAID})
        assert done.choices[0].text == "return a + b" and done.usage.prompt_tokens == n_prompt
        status, out = post(port, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra,
                                             "n_predict": 20, "grammar": SAID})
        assert status == 200 and out["content"] == "return a + b" and out["stop_type"] == "eos"
        assert out["tokens_evaluated"] == len(infill_prompt(llm, PREFIX, SUFFIX, extra=[("util.py", "X = 1\n")]))
        with httpx.stream("POST", f"http://127.0.0.1:{port}/infill", timeout=30,
                          json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "stream": True, "grammar": SAID}) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert "".join(e["content"] for e in events) == "return a + b" and events[-1]["stop"]
        said = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60).generate(
            model="tiny", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 3})
        assert said.prompt_eval_count == n_prompt
        status, out = post(port, "/infill", {"input_prefix": PREFIX, "input_extra": [{"filename": 3}]})
        assert status == 400 and out["error"]["param"].startswith("input_extra")
