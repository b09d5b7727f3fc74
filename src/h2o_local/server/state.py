"""What the server's routes share: the `Llama`, its scheduler, the settings and the limits derived from them."""
from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..llama import Llama
from .scheduler import Scheduler
from .settings import ServerSettings

if TYPE_CHECKING:
    from .embeddings import EmbeddingWork


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
    # rendered, prompts tokenized, grammars parsed and checked
    prepare: concurrent.futures.ThreadPoolExecutor
    embedding: "EmbeddingWork"                        # the embedding routes' thread

    def prepared(self, fn, *args: Any, **kwargs: Any) -> "asyncio.Future[Any]":
        """`fn(*args, **kwargs)` in the server's preparing threads, off the event loop (await it)."""
        return asyncio.get_running_loop().run_in_executor(self.prepare, lambda: fn(*args, **kwargs))
