"""The server's settings, declared once: `h2o-local serve` options, H2O_LOCAL_* environment variables and
`create_app(...)` keywords all come from these fields (the model and cache options are the CLI's shared ones)."""
from __future__ import annotations

from typing import Optional

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..grammar import DEFAULT_LIMITS, GrammarLimits


class ServerSettings(BaseSettings):
    """How `h2o-local serve` listens and schedules. Each field is `--field-name` on the command line and
    `H2O_LOCAL_FIELD_NAME` in the environment (the command line wins)."""

    model_config = SettingsConfigDict(env_prefix="H2O_LOCAL_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (default: 127.0.0.1, this machine only)")
    port: int = Field(8000, ge=0, le=65535, description="port (0: any free one)")
    slots: int = Field(4, ge=1, description="requests decoded at once, each in its own KV stream")
    max_waiting: int = Field(16, ge=0, description="requests that may wait for a slot; more get 429")
    session_mib: float = Field(256, ge=0, description="memory for saved conversations that later requests "
                                                      "continue, MiB (0: off)")
    model_id: Optional[str] = Field(None, description="the model name /v1/models shows (default: the file name)")
    seed: Optional[int] = Field(None, description="the seed of every request that sends none, as llama-server's "
                                "--seed: a request then answers the same each time (default: none, each request "
                                "draws its own)")
    max_prompt_tokens: Optional[int] = Field(None, ge=1, description="the most tokens of a request that are new to "
                                             "the server (not held by a saved conversation); more get HTTP 400 "
                                             "(default: the model's trained context)")
    max_history_bytes: int = Field(2**20, ge=1024, description="the most text a resent conversation (one that holds "
                                   "an answer) may carry, bytes: a bounded cache reads it in its own memory whatever "
                                   "its length in tokens, only the part no saved conversation holds, and only that "
                                   "counts against --max-prompt-tokens; the full cache keeps --max-prompt-tokens")
    max_tokens: Optional[int] = Field(None, ge=1, description="an answer's longest length in tokens, for a request "
                                      "that asks for more or for no limit (finish_reason 'length'; default: the "
                                      "model's trained context)")
    max_body_bytes: int = Field(8 * 2**20, ge=1024, description="larger request bodies get HTTP 413")
    api_key: Optional[str] = Field(None, min_length=1, description="every request must send 'Authorization: "
                                   "Bearer KEY' (else 401; /health is public); several keys comma-separated, each "
                                   "client's conversations kept apart by its key; better given as H2O_LOCAL_API_KEY "
                                   "(default: none)")
    cors_origins: Optional[str] = Field(None, min_length=1, description="browser origins allowed to call the API, "
                                        "comma-separated, or * (default: none, CORS off)")
    allowed_hosts: Optional[str] = Field(None, min_length=1, description="more Host names the server answers, "
                                         "comma-separated, or * for any; a server on a loopback address answers only "
                                         "this machine's names (localhost, loopback addresses, the host name) "
                                         "otherwise (default: none)")
    request_time_limit_s: float = Field(600.0, gt=0, description="longest a request may generate, seconds; then it "
                                        "ends with finish_reason 'length' (a request's t_max_predict_ms may ask "
                                        "for less)")
    grammar_max_bytes: int = Field(DEFAULT_LIMITS.max_bytes, ge=1, description="largest grammar (GBNF text, or "
                                   "what a JSON schema becomes), bytes; larger ones get HTTP 400")
    grammar_max_rules: int = Field(DEFAULT_LIMITS.max_rules, ge=1, description="most rules a grammar may have")
    grammar_max_alternatives: int = Field(DEFAULT_LIMITS.max_alternatives, ge=1, description="most alternatives "
                                          "('|') a grammar may have (an enum of N values has N - 1)")
    grammar_max_repetition: int = Field(DEFAULT_LIMITS.max_repetition, ge=1, description="largest repetition count "
                                        "in a grammar ({m,n}) or a schema (minItems, maxLength, ...), as llama.cpp's "
                                        "GBNF parser")
    grammar_max_work: int = Field(DEFAULT_LIMITS.max_work, ge=1, description="most work one step of a grammar may "
                                  "take (parse-stack elements visited, candidate characters matched; the default is "
                                  "about a second of one core): a grammar that needs more at its start gets HTTP 400, "
                                  "later its request ends with an error")
    stream_send_timeout_s: float = Field(60.0, gt=0, description="a streaming client that reads nothing for this "
                                         "long, seconds, is dropped")
    max_connections: int = Field(512, ge=1, description="requests the server answers at once (more get HTTP 503), "
                                 "and connections it keeps open waiting for a request (a new one closes the one that "
                                 "waited longest)")
    head_timeout_s: float = Field(15.0, gt=0, description="a connection that has not sent a complete request head "
                                  "this long after it opened or after its last answer, seconds, is closed")
    echo_logprobs_mib: float = Field(256, ge=0, description="most memory the logits of one prompt whose own "
                                     "logprobs are asked for (/v1/completions with echo and logprobs) may take while "
                                     "it is read, MiB: its tokens x the vocabulary x 4 bytes; longer prompts get HTTP "
                                     "400 (0: such requests are refused)")
    template_timeout_s: float = Field(10.0, gt=0, description="longest a chat template may render a request's "
                                                              "messages, seconds (then HTTP 400)")

    def grammar_limits(self) -> GrammarLimits:
        """The limits every request's grammar is checked against."""
        return GrammarLimits(**{name: getattr(self, f"grammar_{name}") for name in GrammarLimits.__dataclass_fields__})
