"""The benchmark and experiment entry points compute what they claim (on the tiny model, no network)."""
import json

import numpy as np
import pytest

from h2o_local import Llama


def test_bench_measures_one_setting(tiny_model):
    from benchmarks.bench import measure

    cfg = {"runner": "h2o_local", "name": "h2o-32", "model": tiny_model, "policy": "h2o", "budget": 32, "rolling": False,
           "export_scores": False, "depth": 200, "decode_tokens": 8, "n_batch": 64, "threads": 1}
    r = measure(cfg)
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["decode_mean_tok_s"] > 0
    assert r["cells_in_use"] == 32 and r["kv_cells"] == 256 and r["kv_bytes"] > 0 and r["peak_rss"] > 0


def test_bench_warms_up_on_the_prompt_and_then_forgets_it(tiny_model):
    """Each run first reads part of its prompt (a device loads its kernels on first use), then starts over: the timed
    prompt runs as many probes and evictions, and ends with the same cache, as a cold run."""
    from benchmarks.bench import measure, warmup_tokens

    # four chunks, or two past the budget where that is more, never past the prompt
    assert warmup_tokens({"n_batch": 64, "depth": 1000, "budget": 32}) == 256
    assert warmup_tokens({"n_batch": 64, "depth": 1000, "budget": 512}) == 640
    assert warmup_tokens({"n_batch": 64, "depth": 200, "budget": None}) == 200
    assert warmup_tokens({"n_batch": 64, "depth": 1000, "warmup_tokens": 0}) == 0

    cfg = {"runner": "h2o_local", "name": "tova-32+s4+q8", "model": tiny_model, "policy": "tova", "budget": 32,
           "rolling": False, "export_scores": False, "depth": 300, "decode_tokens": 2, "n_batch": 64, "threads": 1}
    cold, warm = measure({**cfg, "warmup_tokens": 0}), measure(cfg)
    assert cold["prefill_parts"]["n_probes"] > 0
    assert warm["prefill_parts"]["n_probes"] == cold["prefill_parts"]["n_probes"]
    assert warm["cells_in_use"] == cold["cells_in_use"]


def test_device_copies_times_each_setting_against_its_own_uncompacted_run(tiny_model, tmp_path):
    from benchmarks.device_copies import DEFAULT, PARTS, main

    out = tmp_path / "copies"
    assert main(["--model", tiny_model, "--depth", "600", "--repeats", "2", "--n-gpu-layers", "0", "--threads", "1",
                 "--out", str(out)]) == 0
    runs = json.loads(out.with_suffix(".json").read_text())["seconds"]
    assert set(runs) == {DEFAULT + fa + s for fa in ("+fa", "") for s in ("+nocompact", "", "+recall")}
    for label, timed in runs.items():
        assert len(timed) == 2 and all(r["prompt"] > 0 for r in timed)
        # where the prompt's seconds went: parts of it, none counted twice
        assert all(0 <= sum(r[k] for k in PARTS) <= r["prompt"] and r["decode_seconds"] > 0 for r in timed)
        assert all(r["compact_seconds"] == 0 for r in timed) == label.endswith("+nocompact")
    rows = [line.split(" | ") for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| tova")]
    assert len(rows) == 6
    for label, _, ratio, *parts in rows:
        assert len(parts) == len(PARTS)
        if label.endswith("+nocompact"):
            assert ratio == "1.00x"


def test_streaming_nll_equals_a_direct_computation(tiny_model, tmp_path):
    """With a budget that never evicts, the chunked NLL equals -log softmax of one full pass."""
    from experiments.common import parse_setting
    from experiments.streaming import nll_run

    llm = Llama(tiny_model, n_ctx=512)
    tokens = llm.tokenize("Streaming text for a perplexity check, fed in small chunks. " * 3, add_bos=False)[:150]
    nll = nll_run(tiny_model, tokens, parse_setting("h2o-400"), 16, None)
    rows = llm.eval(tokens[:-1], logits_all=True).astype(np.float64)
    lse = np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1)) + rows.max(1)
    direct = lse - rows[np.arange(len(tokens) - 1), tokens[1:]]
    np.testing.assert_allclose(nll, direct, rtol=1e-4, atol=1e-4)


def test_streaming_full_stops_at_its_context(tiny_model_128):
    from experiments.common import parse_setting
    from experiments.streaming import nll_run

    tokens = list(range(3, 259)) * 2  # 512 tokens, trained context 128
    nll = nll_run(tiny_model_128, tokens, parse_setting("full"), 32, None)
    assert not np.isnan(nll[:120]).any() and np.isnan(nll[300:]).all()
    local = nll_run(tiny_model_128, tokens, parse_setting("local-64"), 32, None)
    assert not np.isnan(local).any()


def test_summarization_settings_and_summary(tmp_path):
    from experiments.summarization import decodings, settings, summarize

    assert settings(["h2o", "local"], ["64", "full"]) == [("full", None), ("h2o", 64), ("local", 64)]
    assert decodings([0, 1], True) == [("greedy", None), ("seed0", 0), ("seed1", 1)]
    path = tmp_path / "out.jsonl"
    recs = []
    for row in range(2):
        for policy, budget in (("full", None), ("h2o", 64)):
            for dec, r2 in (("greedy", 0.1), ("seed0", 0.2), ("seed1", 0.4)):
                # greedy h2o writes the full cache's text on row 0 and something else on row 1
                out = "the keeper wrote" if policy == "full" or row == 0 else "a storm came"
                recs.append({"row": row, "policy": policy, "budget": budget, "decoding": dec, "rouge2": r2,
                             "g_rouge2": r2, "rouge1": r2, "rougeL": r2, "output": out})
    # a row that a stopped run left incomplete is left out of every cell
    recs.append({"row": 2, "policy": "h2o", "budget": 64, "decoding": "greedy", "rouge2": 0.9, "g_rouge2": 0.9,
                 "rouge1": 0.9, "rougeL": 0.9, "output": "x"})
    path.write_text("\n".join(json.dumps(r) for r in recs))
    table = summarize(path)
    assert table.startswith("Rows: 2.")
    assert "| h2o | greedy | 0.1000 | 0.1000 |" in table
    assert "| h2o | sampled | 0.3000 ± 0.1414 | 0.3000 ± 0.1414 |" in table
    assert "| h2o | 0.500 ± 0.500 |" in table  # agreement with the full cache: 1 on row 0, 0 on row 1

    # a second implementation's file (perhead.py) that finished row 1 only: the tables keep the common row,
    # and its policies are compared with its own full cache
    other = tmp_path / "perhead.jsonl"
    other.write_text("\n".join(json.dumps({**r, "row": 1, "policy": p, "rouge2": 0.3}) for r in recs[:6]
                               for p in ["hf-full" if r["policy"] == "full" else "hf-h2o-first"]))
    table = summarize(path, other)
    assert table.startswith("Rows: 1.")
    assert "| hf-h2o-first | greedy | 0.3000 | 0.3000 |" in table
    assert "| h2o | 0.000 ± 0.000 |" in table


def test_summarization_runs_resumes_and_adds_bos_only_when_asked(tiny_model, tmp_path):
    from experiments.summarization import main

    data = tmp_path / "xsum.jsonl"
    data.write_text(json.dumps({"article": "Article: the keeper lit the lamp every night.\nSummary:",
                                "summary_gt": "the keeper lit the lamp", "temperature": 0.3}) + "\n")
    prompt_tokens = {}
    for bos in (False, True):
        out = tmp_path / f"out-{bos}.jsonl"
        argv = ["--input-path", str(data), "--output-path", str(out), "--model", tiny_model, "--budgets", "8", "full",
                "--policies", "h2o", "--sample-num", "1", "--seeds", "--greedy", "--n-ctx", "256", "--n-batch", "64",
                "--threads", "1"] + (["--add-bos"] if bos else [])
        assert main(argv) == 0
        recs = [json.loads(line) for line in open(out)]
        assert sorted((r["policy"], r["budget"]) for r in recs) == [("full", None), ("h2o", 8)]
        assert main(argv) == 0 and len(open(out).read().splitlines()) == 2  # a rerun resumes: nothing new
        prompt_tokens[bos] = recs[0]["prompt_tokens"]
    assert prompt_tokens[True] == prompt_tokens[False] + 1


def test_rouge_scores():
    from experiments.summarization import rouge_scores

    s = rouge_scores("a cat sat on a mat", "the cat sat on the mat")
    assert s["rouge2"] == pytest.approx(0.4, abs=1e-6) and s["g_rouge2"] == pytest.approx(0.4, abs=1e-6)
    assert rouge_scores("", "the cat")["rouge2"] == 0.0


def test_throughput_experiment_end_to_end(tiny_model, tmp_path):
    """Fixed-length prompts, every setting recorded once, the capped batches within the limit, a report."""
    from experiments.throughput import main

    words = "the keeper of the lighthouse wrote a letter to the council about the storm".split()
    rows = [{"article": "###\nArticle: " + " ".join(words[(i * j) % len(words)] for i in range(150)) +
             "\n\nSummarize the above article in 1 sentence.\n", "summary_gt": "a keeper wrote a letter"}
            for j in range(1, 17)]
    data = tmp_path / "articles.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "tp"
    argv = ["--input-path", str(data), "--model", tiny_model, "--lengths", "480:32", "--batch-sizes", "1", "4",
            "--policies", "full", "h2o-25%", "local-32", "--kv-limit-batch", "2", "--quality", "3",
            "--n-batch", "32", "--threads", "1", "--output", str(out)]
    assert main(argv) == 0
    recs = [json.loads(line) for line in open(out.with_suffix(".jsonl"))]
    batch = [r for r in recs if r["kind"] == "batch"]
    assert len(batch) == 6 and all(r["finish"] == ["length"] and r["tok_s"] > 0 for r in batch)
    capped = {r["policy"]: r for r in recs if r["kind"] == "capped"}
    assert all(r["kv_bytes"] <= r["kv_limit"] for r in capped.values())
    assert capped["full"]["batch"] == 2 and capped["h2o-25%"]["batch"] > capped["full"]["batch"]
    quality = [r for r in recs if r["kind"] == "quality"]
    assert [r["n"] for r in quality] == [3, 3, 3] and all(0 <= r["identical"] <= 3 for r in quality)
    assert out.with_suffix(".md").read_text().count("| h2o-25% |") == 3  # a row in each of the three tables
    assert main(argv) == 0  # a rerun measures nothing again
    assert len(open(out.with_suffix(".jsonl")).read().splitlines()) == len(recs)


def test_mtbench_session_full_stops_where_h2o_goes_on(tmp_path):
    """The session keeps its cache across turns: the full cache stops at its context, h2o + rolling does not."""
    from tiny_model import write_tiny_llama

    from experiments.mtbench import main

    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    model = write_tiny_llama(tmp_path / "chat.gguf", chat_template=chatml)  # trained context 128
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"Question {i}?", f"And then {i}?"]}) for i in range(4)))
    out = tmp_path / "mt"
    assert main(["--input-path", str(questions), "--model", str(model), "--settings", "full", "h2o-48+roll",
                 "h2o-48+roll8", "--max-tokens", "12", "--threads", "1", "--output", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())["results"]
    full, h2o = res["full"], res["h2o-48+roll"]
    assert "error" in full[-1] and len(full) < 8  # 8 turns of 40+ tokens do not fit in 128 cells
    assert len(h2o) == 8 and not any("error" in r for r in h2o)
    assert all(r["kv_cells"] <= 48 for r in h2o) and h2o[-1]["n_seen"] > 128
    lazy = res["h2o-48+roll8"]  # renumbering once per 8 evictions: same bound on the cache
    assert len(lazy) == 8 and all(r["kv_cells"] <= 48 for r in lazy)
    table = out.with_suffix(".md").read_text()
    assert "| full | " in table and "| h2o-48+roll8 | 8 | " in table
    out.with_suffix(".md").unlink()
    assert main(["--input-path", str(questions), "--output", str(out), "--report-only"]) == 0
    assert out.with_suffix(".md").read_text() == table


def test_quality_fidelity_of_a_cache_that_never_evicts_is_perfect(tiny_model, tmp_path):
    """A budget larger than prompt + continuation keeps everything: agreement 1 and KL 0 at every step."""
    from experiments.quality import full_continuation, teacher_forced

    llm = Llama(tiny_model, policy="h2o", budget=400, n_ctx=420)
    prompt = llm.tokenize("A prompt for the teacher-forced check, long enough to matter. " * 4)
    tokens, logps = full_continuation(tiny_model, prompt, 12, None)
    res = teacher_forced(llm, prompt, tokens, logps)
    assert res["agree"] == [1] * 12 and max(res["kl"]) < 1e-6
    small = teacher_forced(Llama(tiny_model, policy="local", budget=8, n_ctx=420), prompt, tokens, logps)
    assert max(small["kl"][1:]) > 1e-3  # an 8-entry window is measurably different


def test_quality_passkey_runs_and_resumes(tiny_model, tmp_path):
    from experiments.quality import main

    data = tmp_path / "articles.jsonl"
    data.write_text("\n".join(json.dumps({"article": f"###\nArticle: News item {i} about ships and rain.\n"})
                              for i in range(40)) + "\n")
    args = ["passkey", "--input-path", str(data), "--model", tiny_model, "--lengths", "400", "--depths", "0.5",
            "--keys", "1", "--settings", "full", "h2o-32", "--out", str(tmp_path / "pk"), "--no-chat"]
    assert main(args) == 0
    rows = [json.loads(line) for line in open(tmp_path / "pk.jsonl")]
    assert {(r["setting"], r["prefill"]) for r in rows} == {("full", "all"), ("h2o-32", "all"), ("h2o-32", "bounded")}
    assert all(r["prompt_tokens"] == 400 and r["right"] in (0, 1) for r in rows)
    assert main(args) == 0 and len(open(tmp_path / "pk.jsonl").readlines()) == 3  # resumed: nothing rerun
    assert (tmp_path / "pk.md").exists() and (tmp_path / "pk.png").exists()


def test_quality_chat_full_cache_agrees_with_itself_and_a_small_window_does_not(tiny_model, tmp_path):
    """The chat task: the full setting replays the reference exactly (agreement 1, KL 0 on both answers); an 8-entry
    window loses the system prompt and shows it in KL; a rerun resumes."""
    from experiments.quality import main

    articles = tmp_path / "articles.jsonl"
    articles.write_text("\n".join(json.dumps({"article": f"###\nArticle: News item {i} about ships and rain.\n"})
                                  for i in range(40)) + "\n")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["Tell me about ships.", "Now shorter."]}) + "\n")
    args = ["chat", "--input-path", str(questions), "--system-path", str(articles), "--model", tiny_model,
            "--system-tokens", "120", "--first-tokens", "12", "--steps", "10", "--prefill", "bounded",
            "--settings", "full", "local-8", "--chat-template", "chatml", "--out", str(tmp_path / "chat")]
    assert main(args) == 0
    rows = {r["setting"]: r for r in map(json.loads, open(tmp_path / "chat.jsonl"))}
    assert set(rows) == {"full", "local-8"}
    full, small = rows["full"], rows["local-8"]
    assert full["context_tokens"] > 120 and full["answer2_tokens"] > 0
    assert full["agree"] == 1.0 and full["kl"] < 1e-6
    assert small["prefill"] == "bounded" and small["budget"] == 8 and small["kl"] > 1e-3
    assert main(args) == 0 and len(open(tmp_path / "chat.jsonl").readlines()) == 2
    assert "| local-8 | bounded | 1 |" in (tmp_path / "chat.md").read_text()


def test_setting_labels_give_the_split_they_name():
    from experiments.common import parse_setting
    from h2o_local.policies import H2O, TOVA, SnapKV

    assert parse_setting("h2o-256").policy_value() == H2O(budget=256)
    assert parse_setting("tova-256+r128+s4").policy_value() == TOVA(budget=256, heavy=124, recent=128, sinks=4)
    # a share of the prompt, and a recent window as a share of that budget
    assert parse_setting("tova-25%+r50%").policy_value(2000) == TOVA(budget=500, heavy=250, recent=250)
    assert parse_setting("snapkv-10%+w64").policy_value(1000).query_window == 64
    assert parse_setting("tova-25%+r50%+s4").family == "tova+r50%+s4"
    assert parse_setting("h2o-25%").is_plain and not parse_setting("h2o-25%+r10").is_plain
    # n_batch only where the label gives it (the experiment's own otherwise)
    batched = parse_setting("tova-256+s4+fa+batch2048")
    assert batched.llama_kwargs()["n_batch"] == 2048 and batched.policy_label == "tova-256+s4" and batched.flash_attn
    assert "n_batch" not in parse_setting("tova-256+s4+fa").llama_kwargs()
    # the probe in a decode of its own, to measure what riding with its chunk saves
    assert parse_setting("tova-256+s4+q32+noride").llama_kwargs()["probe_rides"] is False
    assert parse_setting("tova-256+s4+q32").llama_kwargs()["probe_rides"] is True
    for bad in ("h2o-256+x3", "h2o-256+r", "h2o", "tova-256+r300", "h2o-256+batch0"):
        with pytest.raises(ValueError):
            parse_setting(bad)


def test_decide_pairs_families_row_by_row():
    from experiments.decide import paired, row_values

    fidelity = [{"setting": s, "prefill": "bounded", "row": r, "agree": a}
                for r, (x, y) in enumerate([(0.9, 0.8), (0.7, 0.5), (0.8, 0.8)])
                for s, a in (("h2o-25%+ph", x), ("h2o-25%", y))]
    retrieval = [{"setting": s, "task": "single", "mode": "aware", "row": 0, "score": v}
                 for s, v in (("h2o-25%+ph", 1.0), ("h2o-25%", 0.0), ("full", 1.0))]
    values = {**row_values(fidelity, "fidelity"), **row_values(retrieval, "longctx")}
    mean, se, n = paired(values, "h2o+ph", "h2o", "25%")
    diffs = [0.1, 0.2, 0.0, 1.0]  # three fidelity rows and one retrieval row, each against its own pair
    assert n == 4 and mean == pytest.approx(np.mean(diffs)) and se == pytest.approx(np.std(diffs, ddof=1) / 2)
    assert paired(values, "h2o+ph", "h2o", "10%")[2] == 0


def test_cuda_graphs_counts_the_decode_s_graph_lines_of_each_setting(tiny_model, tmp_path):
    """benchmarks/cuda_graphs.py: the lines after the decode's mark, by kind; on the CPU build a decode logs none."""
    from benchmarks.cuda_graphs import MARK, counted, main

    log = ("ggml_backend_cuda_graph_compute: CUDA graph warmup reset\n" + MARK + "\n"
           + "ggml_backend_cuda_graph_compute: CUDA graph warmup reset\n" * 3
           + "ggml_backend_cuda_graph_compute: CUDA graph warmup complete\nCUDA Graph id 7 reused\n")
    assert counted(log) == {"warmup_complete": 1, "warmup_reset": 3, "reused": 1, "disabled": 0}
    assert main(["--model", tiny_model, "--settings", "full", "h2o-16", "--depth", "40", "--steps", "3",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cuda-graphs.json").read_text())
    assert [r["setting"] for r in rows] == ["full", "h2o-16"]
    assert all(r["steps"] == 3 and r["warmup_complete"] == r["warmup_reset"] == 0 for r in rows), rows
