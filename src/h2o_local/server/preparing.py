"""The server's work before a request reaches its slot, bounded and fair: chat templates, tokenization and answer
parsing run in the preparing threads, grammar checks in a smaller pool of their own, so that a slow grammar never
makes a template wait. Each pool has a bounded line (past it, 429, as the slots' waiting line), and one client
(one address) may hold at most half of it. A time limit counts a call's own time, not its wait in the line.

A grammar is checked once: the n samples of a request, and later requests with the same grammar, copy the checked
sampler's grammar (`GrammarChecks`); a grammar that failed its check fails again at once."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import threading
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

from .protocol import APIError

# the address of the client whose request is being answered (set by the app's ClientAddress middleware)
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("h2o_local_client", default="")


class WorkPool:
    """Threads with a bounded line: at most `max_held` calls waiting or running, at most `per_client` of them one
    client's. A call counts until its thread is done with it, even when its request has gone."""

    def __init__(self, name: str, workers: int, max_held: int, per_client: Optional[int] = None):
        self.name = name
        self.max_held = max(1, max_held)
        self.per_client = max(1, per_client if per_client is not None else (self.max_held + 1) // 2)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"h2o-local-{name}")
        self._held: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Calls waiting or running."""
        with self._lock:
            return sum(self._held.values())

    def _take(self, client: str) -> None:
        with self._lock:
            if sum(self._held.values()) >= self.max_held:
                raise APIError(429, f"the server is busy {self.name} other requests ({self.max_held} waiting); try "
                                    f"again shortly", kind="rate_limit_error", code="server_busy")
            if self._held[client] >= self.per_client:
                raise APIError(429, f"this client has {self._held[client]} requests waiting to be prepared, the most "
                                    f"one client may; try again when they are answered", kind="rate_limit_error",
                               code="client_busy")
            self._held[client] += 1

    def _give(self, client: str) -> None:
        with self._lock:
            self._held[client] -= 1
            if self._held[client] <= 0:
                del self._held[client]

    async def run(self, fn: Callable[..., Any], *args: Any, own_time_s: Optional[float] = None,
                  on_time_out: Optional[Callable[[], Exception]] = None, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a thread of this pool (await it). `own_time_s`: how long it may run once it
        has started (its wait in the line not counted); then `on_time_out()` is raised (asyncio.TimeoutError by
        default) while the call is left to end on its own (it still counts until it does)."""
        client = CLIENT.get()
        self._take(client)
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def call() -> Any:
            loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))
            return fn(*args, **kwargs)

        try:
            job = self.executor.submit(call)
        except RuntimeError:  # shut down
            self._give(client)
            raise APIError(503, "the server is stopping", kind="server_error") from None
        job.add_done_callback(lambda _: self._give(client))
        result = asyncio.wrap_future(job)
        try:
            if own_time_s is None:
                return await result
            await asyncio.wait({started, result}, return_when=asyncio.FIRST_COMPLETED)
            try:
                return await asyncio.wait_for(asyncio.shield(result), own_time_s)
            except asyncio.TimeoutError:
                raise (on_time_out() if on_time_out is not None else asyncio.TimeoutError()) from None
        finally:
            if not job.done():
                job.cancel()  # not started yet: it never will be; running: it ends on its own
            if not started.done():
                started.cancel()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class GrammarChecks:
    """Checked grammar samplers by (grammar, limits), the last `size` kept: a grammar is parsed and checked against
    the vocabulary once (`WorkPool` `pool`), then each sampler of it copies the checked one's grammar; requests
    asking at once for the same grammar wait for one check; a grammar that failed fails again at once."""

    def __init__(self, pool: WorkPool, size: int = 64):
        self.pool, self.size = pool, size
        self._done: "collections.OrderedDict[Hashable, Tuple[Any, Optional[Exception]]]" = collections.OrderedDict()
        self._running: Dict[Hashable, "asyncio.Future[Tuple[Any, Optional[Exception]]]"] = {}

    def close(self) -> None:
        self.pool.close()

    async def sampler(self, llm: Any, params: Any, history: Any) -> Any:
        """`llm.sampler(params, history=history)`, its grammar checked once for all requests that give it."""
        key = (params.grammar, params.grammar_limits)
        checked, error = await self._checked(llm, params, key)
        if error is not None:
            raise error
        return llm.sampler(params, history=history, grammar_of=checked)

    async def _checked(self, llm: Any, params: Any, key: Hashable) -> Tuple[Any, Optional[Exception]]:
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key]
        running = self._running.get(key)
        if running is None:
            running = asyncio.ensure_future(self._check(llm, params, key))
            self._running[key] = running
        return await asyncio.shield(running)

    async def _check(self, llm: Any, params: Any, key: Hashable) -> Tuple[Any, Optional[Exception]]:
        try:
            try:
                # the grammar alone: the request's other parameters (its bias, its seed) are its samplers' own
                alone = type(params)(grammar=params.grammar, grammar_limits=params.grammar_limits)
                outcome: Tuple[Any, Optional[Exception]] = (await self.pool.run(llm.sampler, alone), None)
            except APIError:
                raise  # the line is full: nothing was learnt about the grammar
            except (TypeError, ValueError) as e:
                outcome = (None, e)
            self._done[key] = outcome
            while len(self._done) > self.size:
                self._done.popitem(last=False)
            return outcome
        finally:
            del self._running[key]


class EmbeddingWork:
    """The embedding thread and how many requests it holds (running and waiting)."""

    def __init__(self, max_waiting: int):
        self.max_held = max_waiting + 1
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="h2o-local-embed")
        self._held = 0
        self._lock = threading.Lock()

    async def run(self, fn: Any) -> Any:
        with self._lock:
            if self._held >= self.max_held:
                raise APIError(429, "too many embedding requests are waiting; try again shortly",
                               kind="rate_limit_error")
            self._held += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        finally:
            with self._lock:
                self._held -= 1

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
