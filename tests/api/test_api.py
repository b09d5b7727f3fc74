"""The llama-cpp-python-style surface: generate, completions, chat, streaming, tokens, inspection."""
import numpy as np
import pytest

from h2o_local import KVState, Llama
from h2o_local.text import TextAssembler
from tiny_model import write_tiny_llama


@pytest.fixture
def llm(tiny_model):
    return Llama(tiny_model, policy="h2o", budget=24, n_batch=32)


def test_tokenize_detokenize_roundtrip(llm):
    text = "Hello, wörld! 123"
    tokens = llm.tokenize(text)
    assert tokens[0] == llm.token_bos()  # this model adds BOS
    assert llm.tokenize(text, add_bos=False) == tokens[1:]
    assert llm.detokenize(tokens[1:]).decode() == " " + text or llm.detokenize(tokens[1:]).decode() == text


def test_generate_text_and_stream_agree(llm):
    a = llm.generate("Once upon a time", max_tokens=30, temperature=0.9, seed=42)
    pieces = list(llm.generate("Once upon a time", max_tokens=30, temperature=0.9, seed=42, stream=True))
    assert isinstance(a, str) and a == "".join(pieces)
    assert llm.generate("Once upon a time", max_tokens=30, temperature=0.9, seed=43) != a or len(a) == 0


def test_greedy_is_deterministic(llm):
    assert llm.generate("abc", max_tokens=20, temperature=0) == llm.generate("abc", max_tokens=20, temperature=0)


def test_completion_dict(llm):
    out = llm("The sea", max_tokens=12, temperature=0)
    assert out["object"] == "text_completion"
    choice = out["choices"][0]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert choice["finish_reason"] in ("stop", "length")
    assert out["usage"]["prompt_tokens"] == len(llm.tokenize("The sea"))
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]


def test_completion_echo_and_logprobs(llm):
    out = llm.create_completion("The sea", max_tokens=5, temperature=0, echo=True, logprobs=3)
    choice = out["choices"][0]
    n_prompt = out["usage"]["prompt_tokens"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt + out["usage"]["completion_tokens"]
    assert lp["token_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    # greedy: each generated token is the most likely one
    for i in range(n_prompt, len(lp["tokens"])):
        assert lp["token_logprobs"][i] >= max(lp["top_logprobs"][i].values()) - 1e-6
    assert choice["text"].startswith(llm.detokenize(llm.tokenize("The sea")).decode(errors="replace"))


def test_completion_stream_chunks(llm):
    chunks = list(llm.create_completion("The sea", max_tokens=8, temperature=0, stream=True))
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == llm("The sea", max_tokens=8, temperature=0)["choices"][0]["text"]


def test_stop_strings_cut_the_text():
    t = TextAssembler(["###"])
    out = t.push(b"Hello #") + t.push(b"#") + t.push(b"# world")
    assert out == "Hello " and t.stopped
    t = TextAssembler(["###"])
    assert t.push(b"a #") == "a " and t.push(b" b") == "# b"  # a partial stop string is held, then released
    assert t.stop_word is None
    t = TextAssembler(["world", "lo w"])  # the one found earliest in the text is the one that stopped it
    assert t.push(b"Hello world") == "Hel" and t.stop_word == "lo w"


def test_utf8_split_across_tokens():
    t = TextAssembler()
    e = "é".encode()
    assert t.push(e[:1]) == "" and t.push(e[1:]) == "é"


def test_stop_in_generation(llm):
    full = llm.generate("x", max_tokens=40, temperature=0)
    if len(full) > 6:
        stop = full[3:5]
        cut = llm.generate("x", max_tokens=40, temperature=0, stop=[stop])
        assert cut == full[: full.index(stop)]


def test_kv_state_and_reset(llm):
    llm.generate("A fairly long prompt that exceeds the budget of this small cache.", max_tokens=10, temperature=0)
    st = llm.kv_state()
    assert isinstance(st, KVState)
    assert st.positions.dtype == np.int32 and st.scores.dtype == np.float32
    assert st.n_cells == 24 and st.head_scores.shape == (24, 4)
    assert st.n_evicted == st.n_seen - 24 and st.kv_bytes > 0
    assert np.all(np.diff(st.positions) > 0)
    llm.reset()
    assert llm.kv_state().n_cells == 0 and llm.kv_state().n_seen == 0


def test_session_continues_without_reset(llm):
    llm.generate("First turn.", max_tokens=5, temperature=0)
    seen = llm.kv_state().n_seen
    llm.generate(" Second turn.", max_tokens=5, temperature=0, reset=False, add_bos=False)
    assert llm.kv_state().n_seen > seen


def test_last_logits(llm):
    llm.eval(llm.tokenize("abc"))
    logits = llm.last_logits()
    assert logits.shape == (llm.n_vocab(),) and logits.dtype == np.float32 and np.isfinite(logits).all()


@pytest.mark.slow
def test_real_model_chat(smol_model):
    llm = Llama(smol_model, policy="h2o", budget=64)
    # (SmolLM2-135M at Q4_1 answers this in French with its template's default system prompt, which has no full stop)
    system = {"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face."}
    out = llm.create_chat_completion([system, {"role": "user", "content": "What is the capital of France?"}],
                                     max_tokens=24, temperature=0)
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and "Paris" in msg["content"]
    chunks = list(llm.create_chat_completion([{"role": "user", "content": "Say hello."}], max_tokens=8,
                                             temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # as OpenAI streams it
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_real_model_h2o_generation_is_coherent(smol_model):
    """The main job: a chat answer with a 64-entry cache, generated past its budget."""
    llm = Llama(smol_model, policy="h2o", budget=64)
    prompt = llm.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse."}])
    text = llm.generate(llm.tokenize(prompt, special=True), max_tokens=150, temperature=0)
    st = llm.kv_state()
    assert st.n_seen > 100 and st.n_cells == 64 and st.n_evicted > 0
    words = text.split()
    assert len(words) > 40
    assert sum(w.lower().strip(".,") in {"the", "a", "and", "of", "to", "was"} for w in words) > 5  # English prose


def test_reset_one_sequence_keeps_the_other(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=2)
    llm.eval_batch({0: [5, 6, 7], 1: [8, 9]})
    llm.reset(1)
    assert llm.kv_state(1).n_cells == 0 and llm.kv_state(0).positions.tolist() == [0, 1, 2]
    llm.eval([10], seq_id=1)
    assert llm.kv_state(1).positions.tolist() == [0]


@pytest.mark.parametrize("kw", [dict(policy="full", n_ctx=256), dict(budget=24), dict(policy="h2o", budget=24)],
                         ids=["full", "default", "h2o"])
def test_warm_up_reads_a_made_up_prompt_then_leaves_the_llama_as_new(tiny_model, kw):
    """On a GPU the first prompt would wait for the device to load its kernels: warm_up() reads a prompt past the
    budget first (a chunk, an eviction and its probe, a step), as llama.cpp's tools do at load, then forgets it."""
    cold = Llama(tiny_model, n_batch=32, **kw)
    warm = Llama(tiny_model, n_batch=32, **kw)
    # by default only where a layer is on a device (on the CPU nothing is loaded on first use)
    on_device = any(d != "CPU" for d in cold.layer_devices)
    assert Llama(tiny_model, n_batch=32, **kw).warm_up() == on_device
    assert warm.warm_up(anywhere=True) and warm.stats()["decodes"] >= (2 if warm.budget is None else 3)
    st = warm.kv_state()
    assert (st.n_seen, st.n_cells, st.n_evicted, st.n_probes, warm.stats()["cells_used"]) == (0, 0, 0, 0, 0)
    answer = cold.generate("Once upon a time there was", max_tokens=12, temperature=0)
    assert warm.generate("Once upon a time there was", max_tokens=12, temperature=0) == answer
    assert warm.kv_state().positions.tolist() == cold.kv_state().positions.tolist()
    with pytest.raises(ValueError, match="before the first prompt"):
        warm.warm_up(anywhere=True)
    assert warm.kv_state().n_seen == cold.kv_state().n_seen  # what it held is untouched


def test_cli_runs_the_main_job(tiny_model, capsys):
    from h2o_local.cli import main

    assert main(["--model", tiny_model, "--no-chat", "--prompt", "Hello there", "--budget", "16",
                 "--max-tokens", "40"]) == 0
    err = capsys.readouterr().err
    assert "policy=tova budget=16" in err and "probe=question/32 pool=9 follow=12" in err and "kept=" in err
    # where the layers ran: the CPU here, the GPU's name in a GPU build (n_gpu_layers defaults to all)
    import h2o_local
    gpu = [d.name for d in h2o_local.devices() if d.type in ("gpu", "igpu")]
    assert f"cells) on {gpu[0] if gpu else 'CPU'}, " in err


def test_the_cli_takes_llama_cpps_sampler_options(tiny_model, capsys):
    """--top-k, --min-p, --typical, --mirostat, --mirostat-ent, --mirostat-lr, as llama.cpp's CLI names them: they
    reach the sampler (Mirostat 2 with a target near 0 draws the greedy text), and a bad value is one line, exit 2."""
    from h2o_local.cli import main

    def text(*options):
        assert main(["--model", tiny_model, "--no-chat", "--prompt", "Hello there", "--budget", "16",
                     "--max-tokens", "12", *options]) == 0
        return capsys.readouterr().out

    greedy = text()
    sampled = text("--temperature", "1", "--seed", "1", "--top-k", "0", "--min-p", "0")
    assert sampled != greedy
    assert text("--temperature", "1", "--seed", "1", "--mirostat", "2", "--mirostat-ent", "0.0001",
                "--mirostat-lr", "0.2") == greedy
    assert text("--temperature", "1", "--seed", "1", "--top-k", "0", "--min-p", "0", "--typical", "0.5") != sampled
    with pytest.raises(SystemExit) as e:
        main(["--model", tiny_model, "--no-chat", "--typical", "0"])
    assert e.value.code == 2 and "typical_p must be in (0, 1]" in capsys.readouterr().err


def test_the_cli_says_where_a_split_model_runs():
    from h2o_local.backends import where_layers_run

    assert where_layers_run(("CPU", "CPU")) == "CPU" and where_layers_run(("Vulkan0",) * 3) == "Vulkan0"
    assert where_layers_run(("CPU", "Vulkan0", "Vulkan0")) == "CPU + Vulkan0 (2 of 3 layers off the CPU)"


def test_cli_runs_per_head_h2o_and_refuses_what_it_cannot_do(tiny_model, capsys):
    from h2o_local.cli import main

    assert main(["--model", tiny_model, "--no-chat", "--prompt", "Hello there " * 10, "--policy", "h2o", "--budget",
                 "16", "--per-head", "--max-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert "policy=h2o budget=16 (sinks=0 heavy=8 recent=8 per_head)" in err and "kept=16" in err
    # the default policy takes --per-head without its probe (per-head choice takes none); a probe asked for is refused
    assert main(["--model", tiny_model, "--no-chat", "--prompt", "Hello there " * 10, "--budget", "16", "--per-head",
                 "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "policy=tova budget=16" in err and "per_head" in err and "probe=" not in err and "kept=16" in err
    for extra, says in ((["--policy", "h2o", "--roll-interval", "1"], "position_rolling"), (["--probe", "question"], "probe")):
        with pytest.raises(SystemExit) as e:
            main(["--model", tiny_model, "--no-chat", "--prompt", "Hi", "--budget", "16", "--per-head", *extra])
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_cli_takes_the_policy_label_it_prints(tiny_model, capsys):
    from h2o_local.cli import main

    assert main(["--model", tiny_model, "--no-chat", "--prompt", "Hello there " * 10, "--policy", "tova-16+s2+r6",
                 "--max-tokens", "4"]) == 0
    assert "policy=tova budget=16 (sinks=2 heavy=8 recent=6)" in capsys.readouterr().err
    for extra, says in ((["--budget", "32"], "carries its budget"), (["--sinks", "4"], "--sinks"),
                        ([], "not a policy label")):
        with pytest.raises(SystemExit) as e:
            main(["--model", tiny_model, "--prompt", "Hi", "--policy", "h2o-x" if not extra else "h2o-16", *extra])
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_default_threads_are_the_physical_cores(tiny_model):
    import os

    from h2o_local.cpu import physical_cores

    assert 1 <= physical_cores() <= os.cpu_count()
    assert Llama(tiny_model, policy="h2o", budget=8).n_threads == physical_cores()
    assert Llama(tiny_model, policy="h2o", budget=8, n_threads=1).n_threads == 1


def test_the_public_generation_calls_completions_stand_on(tiny_model):
    """prompt_tokens, generate_events(logits=, prompt_logits=) and prompt_logits(): what Completions is built from."""
    llm = Llama(tiny_model, n_threads=1)
    ids = [5, 6, 7, 8]
    assert llm.prompt_tokens(ids) == ids  # token ids as they are
    assert llm.prompt_tokens("ab c") == llm.tokenize("ab c", add_bos=llm.info.add_bos, special=True)
    events = list(llm.generate_events(ids, max_tokens=3, temperature=0, ignore_eos=True, logits=True,
                                      prompt_logits=True))
    rows = llm.prompt_logits()
    ref = Llama(tiny_model, n_threads=1).eval(ids, logits_all=True)
    assert rows.shape == (len(ids), llm.n_vocab()) and np.allclose(rows, ref, atol=1e-5)
    tokens = [e for e in events if e.token is not None]
    assert len(tokens) == 3 and all(e.logits.shape == (llm.n_vocab(),) and int(e.logits.argmax()) == e.token
                                    for e in tokens)


def test_llama_cpp_python_calls_scripts_make(llm, tiny_model):
    """What scripts written for llama-cpp-python call besides completions: the GGUF's metadata, the embedding
    width, `detokenize(prev_tokens=)`, `set_seed`, and the keywords for what this library does not do, accepted at
    the values that ask for nothing (wrappers pass them) and named otherwise."""
    assert llm.metadata["general.architecture"] == "llama" and llm.n_embd() == llm.info.n_embd
    tokens = llm.tokenize("Hello, wörld! 123", add_bos=False)
    for cut in range(1, len(tokens)):
        assert llm.detokenize(tokens[:cut]) + llm.detokenize(tokens[cut:], prev_tokens=tokens[:cut]) == \
            llm.detokenize(tokens)
    assert llm.detokenize([llm.token_bos()], True) == llm.detokenize([llm.token_bos()], special=True) != b""
    llm.set_seed(5)
    first = llm.generate("x", max_tokens=12, temperature=1.0)
    llm.set_seed(5)
    assert llm.generate("x", max_tokens=12, temperature=1.0) == first
    out = llm.create_completion("x", max_tokens=2, suffix=None, tfs_z=1.0, logits_processor=None,
                                stopping_criteria=None, model="mine")
    assert out["model"] == "mine" and out["choices"][0]["finish_reason"] == "length"
    chat = Llama(tiny_model, policy="h2o", budget=24, chat_template="chatml")
    assert chat.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=1, functions=None,
                                       model="mine")["model"] == "mine"
    assert llm.create_completion("x", max_tokens=4, temperature=0, tfs_z=0.5)["choices"][0]["text"] == \
        llm.create_completion("x", max_tokens=4, temperature=0)["choices"][0]["text"]  # ignored, as llama.cpp removed it
    for name, value in (("suffix", "end"), ("logits_processor", [lambda ids, logits: logits])):
        with pytest.raises(ValueError, match=name):
            llm.create_completion("x", max_tokens=2, **{name: value})
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        llm.create_completion("x", max_tokens=2, tfz_z=1.0)  # a misspelt keyword still names itself


def test_llama_cpp_python_s_token_helpers(llm):
    """`token_nl`, `tokenizer()` (encode / decode text, special tokens parsed as its encode does), and the static
    `logits_to_logprobs` (a log-softmax) and `longest_token_prefix`."""
    assert llm.tokenize("\n", add_bos=False)[-1] == llm.token_nl() >= 0
    tok = llm.tokenizer()
    ids = tok.encode("Hello, wörld!")
    assert ids == llm.tokenize("Hello, wörld!") and tok.decode(ids).strip() == "Hello, wörld!"
    assert tok.tokenize(b"x", add_bos=False) == llm.tokenize(b"x", add_bos=False)
    assert tok.detokenize(ids[2:], prev_tokens=ids[:2]) == llm.detokenize(ids[2:], prev_tokens=ids[:2])
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, -np.inf]], dtype=np.float32)
    logprobs = Llama.logits_to_logprobs(logits)
    assert logprobs.dtype == np.float32 and np.allclose(np.exp(logprobs).sum(axis=-1), 1.0)
    assert np.allclose(logprobs[0], logits[0] - np.log(np.exp(logits[0]).sum())) and logprobs[1, 2] == -np.inf
    assert np.allclose(Llama.logits_to_logprobs(logits.T, axis=0), logprobs.T)
    assert Llama.longest_token_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 == llm.longest_token_prefix([1, 2], [1, 2, 3])
    assert Llama.longest_token_prefix([], [1]) == 0


def test_llama_cpp_python_s_sample_draws_from_the_last_logits(llm):
    """`eval` then `sample(...)`: llama-cpp-python's low-level loop, with its keywords (`temp`, `top_k`, ...)."""
    rows = llm.eval(llm.tokenize("Hello there my friend"), logits_all=True)
    assert llm.sample(temp=0) == int(np.argmax(llm.last_logits()))
    assert llm.sample(temp=0, idx=2) == int(np.argmax(rows[2]))
    llm.set_seed(3)
    draws = [llm.sample(temp=1.5, top_k=0, top_p=1.0, min_p=0.0) for _ in range(8)]
    llm.set_seed(3)
    assert [llm.sample(temp=1.5, top_k=0, top_p=1.0, min_p=0.0) for _ in range(8)] == draws and len(set(draws)) > 1
    assert llm.sample(temp=0.8, top_k=1) == int(np.argmax(llm.last_logits()))
    x = llm.tokenize("x", add_bos=False)[-1]
    assert llm.sample(grammar=f'root ::= "{llm.detokenize([x]).decode().strip()}"', temp=0) == x
    for bad in (dict(idx=len(rows)), dict(logits_processor=[lambda ids, logits: logits]), dict(top_p=0.0)):
        with pytest.raises(ValueError):
            llm.sample(**bad)
    assert llm.sample(temp=0, tfs_z=0.5, penalize_nl=False) == int(np.argmax(llm.last_logits()))  # ignored, as there


def test_chat_completions_as_the_openai_package_s_types(tiny_model):
    """llama-cpp-python's `create_chat_completion_openai_v1` (instructor and other libraries call it)."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    llm = Llama(tiny_model, budget=24, chat_template="chatml")
    ask = [{"role": "user", "content": "hi"}]
    whole = llm.create_chat_completion_openai_v1(ask, max_tokens=4, temperature=0)
    assert isinstance(whole, ChatCompletion) and whole.choices[0].message.content == \
        llm.create_chat_completion(ask, max_tokens=4, temperature=0)["choices"][0]["message"]["content"]
    chunks = list(llm.create_chat_completion_openai_v1(ask, max_tokens=4, temperature=0, stream=True))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_llama_cpp_python_s_constructor_keywords_are_taken_where_they_ask_for_what_this_llama_does(tiny_model):
    """A script's `Llama(model_path=..., n_ctx=..., n_ubatch=512, use_mmap=True, logits_all=True, type_k=8, ...)`:
    the keywords at values that ask for what this library does anyway make the same `Llama` (the same greedy text),
    llama-cpp-python's type numbers name the KV types, and a value that asks for something else is a ValueError
    naming it, a misspelt keyword a TypeError."""
    plain = Llama(tiny_model, policy="h2o", budget=24, n_batch=32, n_threads=1)
    script = Llama(model_path=tiny_model, policy="h2o", budget=24, n_batch=32, n_threads=1, n_ubatch=512,
                   n_threads_batch=1, use_mmap=True, use_mlock=False, vocab_only=False, logits_all=True,
                   embedding=False, offload_kqv=True, main_gpu=0, tensor_split=None, split_mode=1, numa=False,
                   rope_freq_base=0, rope_freq_scale=0.0, rope_scaling_type=-1, pooling_type=-1, yarn_ext_factor=-1.0,
                   last_n_tokens_size=64, lora_path=None, lora_scale=1.0, no_perf=True, op_offload=None,
                   chat_handler=None, draft_model=None, verbose=False)
    prompt = "The quick brown fox jumps over the lazy dog " * 2
    assert script.generate(prompt, max_tokens=8, temperature=0) == plain.generate(prompt, max_tokens=8, temperature=0)
    numbered = Llama(tiny_model, budget=24, n_threads=1, type_k=0, type_v=30)
    named = Llama(tiny_model, budget=24, n_threads=1, type_k="f32", type_v="bf16")
    assert numbered.kv_bytes_per_cell == named.kv_bytes_per_cell > plain.kv_bytes_per_cell
    for keywords, name in ((dict(use_mmap=False), "use_mmap"), (dict(pooling_type=4), "pooling_type"),
                           (dict(lora_path="adapter.gguf"), "lora_path"),
                           (dict(rope_freq_base=1e6), "rope_freq_base"),
                           (dict(type_k=12), "type_k")):
        with pytest.raises(ValueError, match=name):
            Llama(tiny_model, budget=24, n_batch=32, n_threads=1, **keywords)
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_map'"):
        Llama(tiny_model, budget=24, use_map=True)
    with pytest.raises(TypeError, match="type_k"):
        Llama(tiny_model, budget=24, type_k=8.0)


def test_an_empty_text_completion_reads_the_bos_token_alone_as_llama_cpp_python_s_does(tmp_path):
    """`llm("")` generates a text from nothing (llama-cpp-python's rule: the BOS token alone, also for a model that
    adds none to its prompts, as SmolLM2 and Qwen2.5); a token id outside the vocabulary is a ValueError naming it as
    the prompt's, and the `Llama` goes on."""
    llm = Llama(str(write_tiny_llama(tmp_path / "no-bos.gguf", add_bos=False)), policy="h2o", budget=24, n_threads=1)
    assert not llm.info.add_bos and llm.prompt_tokens("") == []
    out = llm("", max_tokens=4, temperature=0)
    assert out["usage"]["prompt_tokens"] == 1 and out["usage"]["completion_tokens"] == 4
    assert out["choices"][0]["text"] == llm.generate([llm.token_bos()], max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="prompt token id 100000 is outside this model's"):
        llm([5, 100000], max_tokens=2)
    assert llm("x", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_reprs_are_one_line_people_read(tiny_model):
    from h2o_local import ModelInfo

    info = ModelInfo.load(tiny_model)
    llm = Llama(tiny_model, budget=16, n_threads=1, recall=True)
    llm("The sea is", max_tokens=24, temperature=0)
    shown = {"info": repr(info), "llm": repr(llm), "kv": repr(llm.kv_state())}
    assert all("\n" not in text and len(text) < 300 for text in shown.values()), shown
    assert f"n_ctx_train={info.n_ctx_train}" in shown["info"] and "tiny-llama.gguf" in shown["info"]
    assert (info.chat_template or "{%") not in shown["info"]  # the template's length, not its body
    assert f"policy={llm.policy.label}, budget=16" in shown["llm"] and ", on " in shown["llm"]
    st = llm.kv_state()
    assert f"kept={st.n_cells} entries" in shown["kv"] and f"evicted={st.n_evicted}" in shown["kv"] and "MiB" in shown["kv"]
    assert "array" not in shown["kv"] and f"host={len(st.host_positions)} entries" in shown["kv"]
    llm.close()
    assert repr(llm).endswith("closed)")
