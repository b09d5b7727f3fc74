"""`/metrics` in Prometheus' text format (prometheus-client), one registry per app: requests by outcome, tokens,
slots and the waiting line, KV entries kept and evicted per request, time to first token, the session cache."""
from __future__ import annotations

from typing import Any, Callable, Dict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServerMetrics:
    """Counters the scheduler updates as requests end, and gauges read from `stats()` at each scrape."""

    def __init__(self, stats: Callable[[], Dict[str, Any]], flash_attn: bool = False, totals: Any = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("h2o_local_requests", "Requests by outcome (ok, cancelled, error, rejected: 429)",
                                ["outcome"], registry=r)
        self.prompt_tokens = Counter("h2o_local_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("h2o_local_cached_prompt_tokens", "Prompt tokens found in a saved session",
                                     registry=r)
        self.completion_tokens = Counter("h2o_local_completion_tokens", "Generated tokens", registry=r)
        self.evicted = Counter("h2o_local_kv_evicted_entries", "KV entries evicted by the policy", registry=r)
        self.kept = Histogram("h2o_local_kv_kept_entries", "KV entries a request's cache held at its end",
                              buckets=(16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768), registry=r)
        self.ttft = Histogram("h2o_local_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        gauges = {"slots_total": "Slots (requests decoded at once)", "slots_processing": "Slots in use",
                  "requests_waiting": "Requests waiting for a slot", "session_bytes": "Bytes of saved sessions",
                  "sessions_saved": "Saved sessions"}
        for key, text in gauges.items():
            Gauge(f"h2o_local_{key}", text, registry=r).set_function(lambda key=key: stats()[key])
        Gauge("h2o_local_flash_attn", "1 where the context runs llama.cpp's flash attention", registry=r).set(
            int(flash_attn))
        self.llama_server = None if totals is None else LlamaServerNames(stats, totals)


class LlamaServerNames:
    """llama-server's own /metrics lines (`llamacpp:*`, as its --metrics writes them, a counter's TYPE line naming
    it with its `_total`), appended to ours: dashboards and autoscalers built for llama-server read them unchanged.
    The speculative-decoding counters are 0 (no draft model here); its KV-cache gauges and n_tokens_max are left
    out (a bounded cache's use is `h2o_local_kv_kept_entries`)."""

    def __init__(self, stats: Callable[[], Dict[str, Any]], totals: Any):
        self.stats, self.totals = stats, totals

    def text(self) -> str:
        t, s = self.totals, self.stats()
        counters = (("prompt_tokens_total", "Number of prompt tokens processed.", t.prompt_tokens),
                    ("prompt_tokens_cached_total", "Number of prompt tokens found in a saved cache.", t.cached_tokens),
                    ("prompt_seconds_total", "Prompt process time", t.prompt_seconds),
                    ("tokens_predicted_total", "Number of generation tokens processed.", t.predicted_tokens),
                    ("tokens_predicted_seconds_total", "Predict process time", t.predicted_seconds),
                    ("n_decode_total", "Total number of llama_decode() calls", t.n_decode),
                    ("spec_decode_num_draft_tokens_total", "Draft tokens (no speculative decoding here)", 0),
                    ("spec_decode_num_accepted_tokens_total", "Accepted draft tokens (none here)", 0),
                    ("spec_decode_num_drafts_total", "Drafts (none here)", 0))
        gauges = (("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
                   t.busy_slots / max(t.n_decode, 1)),
                  ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                   t.prompt_tokens / t.prompt_seconds if t.prompt_seconds else 0.0),
                  ("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                   t.predicted_after_first / t.predicted_seconds if t.predicted_seconds else 0.0),
                  ("requests_processing", "Number of requests processing.", s["slots_processing"]),
                  ("requests_deferred", "Number of requests deferred.", s["requests_waiting"]))
        lines = []
        for kind, rows in (("counter", counters), ("gauge", gauges)):
            for name, help_text, value in rows:
                lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                          f"llamacpp:{name} {float(value):g}"]
        return "\n".join(lines) + "\n"
