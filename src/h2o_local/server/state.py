"""What the server's routes share: the `Llama`, its scheduler, the settings and the limits derived from them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable

from ..llama import Llama
from .preparing import EmbeddingWork, GrammarChecks, WorkPool
from .scheduler import Scheduler
from .settings import ServerSettings


@dataclass
class ServerState:
    """What the routes share, kept on `app.state.server` by `create_app`."""

    llm: Llama
    scheduler: Scheduler
    settings: ServerSettings
    model_id: str
    max_prompt_tokens: int
    max_prompt_bytes: int                             # text longer than this cannot be max_prompt_tokens tokens
    max_tokens: int                                   # an answer's longest length (a bounded cache never fills up)
    default_keep: int                                 # the protected prefix of a completion (tokens)
    # requests are prepared here, off the event loop and with the GIL released where it is C++: chat templates
    # rendered, prompts tokenized, answers parsed (server/preparing.py)
    prepare: WorkPool
    grammars: GrammarChecks                           # grammars parsed and checked, in a pool of their own
    embedding: EmbeddingWork                        # the embedding routes' thread

    @property
    def template_source(self) -> str:
        """The model's chat template as Jinja source (what reasoning and tool formats are read from)."""
        return self.llm.chat_template.source

    def close(self) -> None:
        """The decoding thread and every worker pool stopped (the app's shutdown)."""
        self.scheduler.close()
        self.prepare.close()
        self.grammars.close()
        self.embedding.close()

    def prepared(self, fn, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """`fn(*args, **kwargs)` in the server's preparing threads, off the event loop (await it); 429 when their
        line is full or this client holds its share of it."""
        return self.prepare.run(fn, *args, **kwargs)
