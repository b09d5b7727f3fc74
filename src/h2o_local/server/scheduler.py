"""Many requests decoded together: a slot (sequence) per request, one `llama_decode` per step for all of them.

One thread owns the `Llama`. Each step it admits waiting requests into free slots (restoring a saved session when
a request continues one, then feeding the new prompt tokens), draws one token for every live slot, hands the
events to the requests' mailboxes, and feeds the new tokens in one batch. Requests join and leave between
steps; a request whose client went away is cancelled and its slot freed at the next step. A long prompt is fed in
chunks of n_batch tokens with a decode step of the running requests between two chunks (slots with streams of
their own), so it does not stall them, and a prompt whose client left stops at the next chunk.

Sessions: when a request ends, its slot's cache is saved (a snapshot in host memory) under the tokens it holds (the
prompt and what was generated) and its protected prefix. A later request whose prompt tokens, tokenized as a fresh
request tokenizes them, start with those tokens (or equal them: a regenerated answer), with the same protected
prefix, restores it and feeds only the rest: a chat front end that resends the whole history continues its
compressed cache, and a request can never continue a cache that was built from other tokens or with another prefix (nor from text cut inside a token).
Snapshots live in an LRU bounded in bytes. A request with a protected prefix (a chat's system prompt) that no saved
session starts also saves the cache of that prefix alone: other conversations with the same system prompt start
from it (`usage.prompt_tokens_details.cached_tokens`).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Deque, Dict, List, Optional, Tuple, Union

from .. import generation
from .metrics import ServerMetrics
from ..llama import Llama
from ..policies import Policy
from ..responses import TokenLogprob, token_logprob
from ..sampling import SamplingParams
from ..sessions import SessionCache

# one line per finished request, as llama-server prints its slots' timings
log = logging.getLogger("h2o_local.server")


class Busy(Exception):
    """Every slot is taken and the waiting line is full."""


@dataclass(frozen=True)
class Started:
    """A job's first event: its prompt is in (the response can start)."""

    reused_tokens: int                      # prompt tokens found in a saved session
    view: Optional[Dict[str, Any]] = None   # with Job.view: the cache after the prompt, and the prompt's pieces
    # with Job.echo_logprobs: the logits after each prompt token (float32 [n, n_vocab], for its logprobs: the
    # handler makes them, off the decoding thread)
    prompt_logits: Optional[Any] = None


@dataclass(frozen=True)
class Step:
    """A generated token's event, or the last one (token None, with the finish reason); with the cache's view at that
    moment when the job asked for it (Job.view)."""

    event: generation.Event
    view: Optional[Dict[str, Any]] = None
    logprobs: Tuple[TokenLogprob, ...] = ()  # with Job.logprobs: those of the step's tokens (merged steps: each)
    tokens: Tuple[int, ...] = ()  # the step's token ids (merged steps: each; the last step: none)


@dataclass(frozen=True)
class Failed:
    """A job's end without a finish reason: its error (Cancelled when its client went away; ValueError when its own
    input was at fault)."""

    error: BaseException


# what the decoding thread hands a request's handler, in order: Started (or Failed), then Steps up to the last (or
# Failed); llama.cpp's server has the same shape (a task's typed results read from its queue)
Result = Union[Started, Step, Failed]


class Mailbox:
    """The results of one request, in order. While the reader is behind, a token's step is merged into the token
    step waiting before it (its text appended, the newest view kept): a client that does not read its stream holds a
    few results, never one per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: Deque[Result] = collections.deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()

    def put(self, item: Result) -> None:
        """From any thread."""
        with self._lock:
            if self._items and _token_step(self._items[-1]) and _token_step(item):
                item = _merged(self._items.pop(), item)  # type: ignore[arg-type]
            self._items.append(item)
        self._loop.call_soon_threadsafe(self._ready.set)

    async def get(self) -> Result:
        """On the loop: the next result (merged tokens count as one)."""
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                self._ready.clear()
            await self._ready.wait()

    async def started(self) -> Started:
        """The first result: Started, or the job's failure raised (Cancelled: its client went away)."""
        item = await self.get()
        if isinstance(item, Failed):
            raise item.error
        assert isinstance(item, Started), item
        return item

    async def steps(self) -> AsyncIterator[Step]:
        """The steps after Started, up to the last (whose event has no token); a failure is raised."""
        while True:
            item = await self.get()
            if isinstance(item, Failed):
                raise item.error
            assert isinstance(item, Step), item
            yield item
            if item.event.token is None:
                return

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _token_step(item: Result) -> bool:
    return isinstance(item, Step) and item.event.token is not None


def _merged(first: Step, then: Step) -> Step:
    """Two token steps as one: the texts joined, both tokens' ids and logprobs, the later token and view, with both
    tokens' pieces (`pieces`, one per token, so that a view still maps pieces to positions; `piece` their text)."""
    event = dataclasses.replace(then.event, text=first.event.text + then.event.text)
    logprobs, tokens = first.logprobs + then.logprobs, first.tokens + then.tokens
    if then.view is None or first.view is None:
        return Step(event, then.view, logprobs, tokens)
    pieces = first.view.get("pieces", [first.view.get("piece", "")]) + [then.view.get("piece", "")]
    return Step(event, {**then.view, "piece": "".join(pieces), "pieces": pieces}, logprobs, tokens)


@dataclass
class Totals:
    """Sums since the server started, for llama-server's /metrics names (server/metrics.py): prompt tokens read (not
    those a saved session held) and the seconds to their first token, tokens generated and the seconds after their
    first, decode steps and the slots live in them."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    predicted_after_first: int = 0  # tokens generated after each request's first (the generation rate's)
    n_decode: int = 0
    busy_slots: int = 0


class ShuttingDown(Exception):
    """The server stops (Ctrl-C, SIGTERM): a request waiting, reading its prompt or answering ends with a 503."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class Cancelled(Exception):
    """The job's last event after `Scheduler.cancel`: its request handler ends (its client went away)."""


class _StepFailed(Exception):
    """The running requests' decode step failed between the chunks of another request's prompt."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


@dataclass
class JobRequest:
    """What a request asks of the scheduler: its prompt, how to sample, its cache settings and limits."""

    prompt_tokens: List[int]
    params: SamplingParams
    n_keep: int = 0                     # the protected prefix (tokens)
    policy: Optional[Policy] = None     # its own policy (resolved, fits a slot), None: the server's
    view: bool = False                  # deliver the cache's state with every result (Started.view, Step.view)
    time_limit_s: Optional[float] = None  # generation ends with "length" after this long (seconds)
    recall: Optional[bool] = None       # its own recall setting (None: the server's)
    cache_salt: Optional[str] = None    # saved sessions are shared only with requests of the same salt
    sampler: Optional[Any] = None       # made beforehand, off the decoding thread (a grammar's), None: at its start
    logprobs: Optional[int] = None      # each generated token's logprobs, with this many top tokens (None: none)
    echo_logprobs: bool = False         # the prompt's own logprobs too (its prompt is read whole: no saved session)


@dataclass
class JobProgress:
    """What became of a request so far: set by the scheduler (and `cancelled` by its route, when its client left)."""

    cancelled: bool = False
    reused_tokens: int = 0              # prompt tokens found in a saved session
    submitted: float = field(default_factory=time.perf_counter)
    slot: int = -1                      # the slot it runs in, once admitted
    prompt_started_at: float = 0.0      # perf_counter() when its prompt began to be read
    first_token_at: float = 0.0         # perf_counter() at its first generated token (0: none yet)
    n_generated: int = 0
    kv_cache: Optional[Dict[str, Any]] = None  # what the cache did, set before the end event is delivered
    stopping_word: str = ""             # the stop string that ended it ("" if none), set with kv_cache
    started: Optional[Started] = None   # its first event, once delivered


@dataclass
class Job:
    """One request: what it asks (`request`), where its events go (`mailbox`, set when it is submitted) and what
    became of it so far (`progress`)."""

    request: JobRequest
    mailbox: Optional[Mailbox] = None
    progress: JobProgress = field(default_factory=JobProgress)

    def put(self, item: Result) -> None:
        if self.mailbox is not None:
            self.mailbox.put(item)

    def fail(self, error: BaseException) -> None:
        self.put(Failed(error))


class Scheduler:
    """Runs jobs on `llm` (which it owns from now on) in up to `llm.n_seq_max` slots at once.

    max_waiting: requests that may wait for a slot; more are refused (Busy).
    session_bytes: memory for saved sessions (0: no session reuse).
    """

    def __init__(self, llm: Llama, *, max_waiting: int = 16, session_bytes: int = 256 * 2**20):
        self.llm = llm
        self.n_slots = llm.n_seq_max
        self.max_waiting = max_waiting
        self.sessions = SessionCache(session_bytes)
        self._waiting: Deque[Job] = collections.deque()
        self._active: Dict[int, Job] = {}        # slot -> job
        self._started: set = set()                # slots whose prompt is in
        self.slots = llm.slots()
        self._cv = threading.Condition()
        self._stop = False
        self.stopping = False  # stop_soon(): every request ends at its next step or prompt chunk
        self.served = 0
        self.peak_batch = 0   # most requests decoded in one step
        self.totals = Totals()
        self.metrics = ServerMetrics(self.stats, flash_attn=llm.flash_attn, totals=self.totals)
        self._thread = threading.Thread(target=self._run, name="h2o-local-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from the server
    @property
    def cells_per_slot(self) -> int:
        """KV cells each slot has (its sequence's share of the context)."""
        return self.slots.cells_per_slot

    def holds_slot(self, job: Job) -> bool:
        """Whether `job` has a slot now (admitted, not finished)."""
        with self._cv:
            return any(j is job for j in self._active.values())

    def held_tokens(self, job: Job) -> int:
        """How many of the job's prompt tokens a saved session holds now (what it need not read, if that session is
        still saved when the job starts)."""
        if not self.sessions.limit_bytes or job.request.echo_logprobs:
            return 0
        return self.sessions.held(job.request.prompt_tokens, job.request.n_keep, _label(job))

    def stop_soon(self) -> None:
        """End every request at its next step or prompt chunk, with ShuttingDown, and take no new one: what a
        signal handler calls (one assignment, no lock), so that the server stops within a chunk's time."""
        self.stopping = True

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stop or self.stopping:
                raise ShuttingDown()
            if len(self._active) >= self.n_slots and len(self._waiting) >= self.max_waiting:
                self.metrics.requests.labels("rejected").inc()
                raise Busy(f"all {self.n_slots} slots are busy and {len(self._waiting)} requests wait")
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        with self._cv:
            job.progress.cancelled = True
            self._cv.notify()

    def stats(self) -> Dict[str, Any]:
        with self._cv:
            return {"slots_total": self.n_slots, "slots_processing": len(self._active),
                    "requests_waiting": len(self._waiting), "requests_served": self.served,
                    "peak_batch": self.peak_batch,
                    "sessions_saved": len(self.sessions), "session_bytes": self.sessions.nbytes,
                    "session_hits": self.sessions.hits, "session_misses": self.sessions.misses}

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)
        self.slots.close()

    # ------------------------------------------------------------------ the decoding thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stop:
                    for job in list(self._waiting) + list(self._active.values()):
                        job.fail(ShuttingDown())
                    return
                if self.stopping:
                    for job in self._waiting:
                        job.fail(ShuttingDown())
                    self._waiting.clear()
                admitted = []
                while self._waiting and len(self._active) < self.n_slots:
                    job = self._waiting.popleft()
                    if job.progress.cancelled:
                        job.fail(Cancelled())
                        continue
                    slot = next(s for s in range(self.n_slots) if s not in self._active)
                    self._active[slot] = job
                    admitted.append((slot, job))
                cancelled = [s for s, j in self._active.items() if j.progress.cancelled]
            if self.stopping and not admitted:
                with self.slots.owned():
                    self._fail_active(ShuttingDown())
                continue
            with self.slots.owned():  # nothing else may use the Llama during a step
                try:
                    self._step(cancelled, admitted)
                except Exception as e:  # a failed step: every request in a slot gets the error, the slots are freed
                    self._fail_active(e)

    def _step(self, cancelled: List[int], admitted: List[Tuple[int, Job]]) -> None:
        """Free the cancelled slots, start the admitted jobs, then sample and feed one token for every live slot."""
        self._free(cancelled)
        for slot, job in admitted:
            self._start(slot, job)
        self._decode_step()

    def _free(self, slots: List[int]) -> None:
        for slot in slots:
            job = self._active.get(slot)
            if job is not None:
                self._release(slot, save=False)
                self.metrics.requests.labels("cancelled").inc()
                job.fail(Cancelled())

    def _decode_step(self, idle_wait_s: float = 0.05) -> None:
        self.peak_batch = max(self.peak_batch, self.slots.n_live)
        self.totals.n_decode += 1
        self.totals.busy_slots += self.slots.n_live
        self._deliver(self.slots.step(idle_wait_s))

    def _between_prompt_chunks(self, job: Job) -> Dict[int, List[int]]:
        """Called between the chunks of a long prompt: the running requests draw their next tokens, which are
        decoded with the prompt's next chunk (one batch, as llama-server's continuous batching), so that a long
        prompt stalls no stream by more than a step; a prompt whose client left, or read while the server stops,
        stops here."""
        if job.progress.cancelled:
            raise Cancelled()
        if self.stopping or self._stop:
            raise ShuttingDown()
        with self._cv:
            gone = [s for s, j in self._active.items() if j.progress.cancelled and s in self._started]
        try:
            self._free(gone)
            self.peak_batch = max(self.peak_batch, self.slots.n_live)
            events, riders = self.slots.ride()
            self._deliver(events)
            return {slot: tokens for slot, tokens in riders.items() if slot in self._started}
        except Exception as e:
            raise _StepFailed(e) from e

    def _fail_active(self, error: Exception) -> None:
        for slot, job in list(self._active.items()):
            self.metrics.requests.labels("error").inc()
            job.fail(error)
            try:
                self.slots.release(slot)
            finally:
                self._started.discard(slot)
                with self._cv:
                    self._active.pop(slot, None)

    def _start(self, slot: int, job: Job) -> None:
        """Fill the slot with the job's prompt (continuing a saved session when one matches) and join the steps."""
        job.progress.slot, job.progress.prompt_started_at = slot, time.perf_counter()
        try:
            if job.progress.cancelled:
                raise Cancelled()
            match = self.sessions.longest_prefix(job.request.prompt_tokens, job.request.n_keep, _label(job)) \
                if self.sessions.limit_bytes and not job.request.echo_logprobs else None
            resume = None if match is None else (match.session.snapshot, match.n_held)
            events = self.slots.start(slot, job.request.prompt_tokens, job.request.params, n_keep=job.request.n_keep, resume=resume,
                                      between_chunks=lambda: self._between_prompt_chunks(job),
                                      save_prefix=self._prefix_saver(job) if match is None else None,
                                      policy=job.request.policy, time_limit_s=job.request.time_limit_s, recall=job.request.recall,
                                      sampler=job.request.sampler, logits=job.request.logprobs is not None,
                                      prompt_logits=job.request.echo_logprobs)
        except _StepFailed as e:  # the running requests' step failed inside this prompt: it fails them all
            job.fail(RuntimeError(f"the server failed while reading this prompt: {e.error}"))
            self._release(slot, save=False)
            raise e.error
        except Exception as e:
            self.metrics.requests.labels("cancelled" if isinstance(e, (Cancelled, ShuttingDown)) else "error").inc()
            job.fail(e)
            self._release(slot, save=False)
            return
        job.progress.reused_tokens = 0 if match is None else match.n_held
        self._started.add(slot)
        # the prompt alone is saved too: a client whose next request re-tokenizes this answer differently from the
        # tokens generated (BPE sometimes does) still continues the whole conversation before it
        self._save(slot, job, job.request.prompt_tokens, len(job.request.prompt_tokens), answer_from=len(job.request.prompt_tokens))
        job.put(Started(job.progress.reused_tokens, self._view(slot, prompt=job.request.prompt_tokens) if job.request.view else None,
                        self.slots.take_prompt_logits(slot) if job.request.echo_logprobs else None))
        self._deliver(events)

    def _prefix_saver(self, job: Job) -> Optional[Any]:
        """For a request with a protected prefix (a chat's system prompt) that no saved session starts: save the
        cache of that prefix alone, so that other conversations with the same system prompt start from it."""
        if not self.sessions.limit_bytes or not 0 < job.request.n_keep < len(job.request.prompt_tokens):
            return None
        prefix = job.request.prompt_tokens[:job.request.n_keep]
        return lambda snapshot: self.sessions.put(prefix, len(prefix), job.request.n_keep, snapshot, _label(job))

    def _view(self, slot: int, *, prompt: Optional[List[int]] = None, token: Optional[int] = None) -> Dict[str, Any]:
        """The live view of a slot's cache (`Slots.view`): when its request starts (`prompt`), with the slot's
        policy, budget, protected prefix and the prompt's pieces; after a token, with that token's piece."""
        view = self.slots.view(slot)
        if prompt is not None:
            policy = self.llm.policy_of(slot)
            view.update(policy=policy.label, budget=policy.budget, protected=self.llm.kv_state(slot).n_keep,
                        tokens=[self._piece(t) for t in prompt])
        if token is not None:
            view["piece"] = self._piece(token)
        return view

    def _piece(self, token: int) -> str:
        return self.llm.token_to_piece(token, special=True).decode("utf-8", errors="replace")

    def _deliver(self, events: List[generation.Event]) -> None:
        for e in events:
            job = self._active.get(e.index)
            if job is None:
                continue
            if e.error is not None:  # its draw failed (its grammar): it alone ends, with the error
                self.metrics.requests.labels("error").inc()
                job.fail(e.error)
                self._release(e.index, save=False)
                continue
            if e.token is not None:
                job.progress.n_generated += 1
                if job.progress.n_generated == 1:
                    job.progress.first_token_at = time.perf_counter()
                    self.metrics.ttft.observe(job.progress.first_token_at - job.progress.submitted)
            else:
                job.progress.kv_cache = self.slots.cache_summary(e.index)
                job.progress.stopping_word = e.stop_word or ""
                if job.progress.kv_cache["protected"] < job.request.n_keep:  # a system prompt longer than the budget lets protect
                    job.progress.kv_cache["protected_asked"] = job.request.n_keep
                now = time.perf_counter()
                self._count_finished(job, now)
                log.info("slot %d: %s", e.index, request_line(job, now))
            logprobs = ()
            if e.logits is not None:  # only the compact logprobs wait in the mailbox
                logprobs = (token_logprob(e.logits, e.token, job.request.logprobs or 0),)
                e = dataclasses.replace(e, logits=None)
            job.put(Step(e, self._view(e.index, token=e.token) if job.request.view else None, logprobs,
                         () if e.token is None else (e.token,)))
            if e.token is None:
                self._release(e.index, save=True)

    def _count_finished(self, job: Job, now: float) -> None:
        t = self.totals
        t.prompt_tokens += len(job.request.prompt_tokens) - job.progress.reused_tokens
        t.cached_tokens += job.progress.reused_tokens
        t.predicted_tokens += job.progress.n_generated
        if job.progress.first_token_at:  # the first token is the prompt's: the rate counts the tokens after it
            t.prompt_seconds += job.progress.first_token_at - job.progress.prompt_started_at
            t.predicted_seconds += now - job.progress.first_token_at
            t.predicted_after_first += job.progress.n_generated - 1
        m = self.metrics
        m.requests.labels("ok").inc()
        m.prompt_tokens.inc(len(job.request.prompt_tokens))
        m.cached_tokens.inc(job.progress.reused_tokens)
        m.completion_tokens.inc(job.progress.n_generated)
        if job.progress.kv_cache is not None:
            m.evicted.inc(job.progress.kv_cache["evicted"])
            m.kept.observe(job.progress.kv_cache["kept"])

    def _release(self, slot: int, *, save: bool) -> None:
        """Free the slot (its cache saved as a session first, when asked)."""
        job = self._active.get(slot)
        if save and job is not None and slot in self._started:
            generated, n_pending = self.slots.generated(slot)
            held = job.request.prompt_tokens + generated  # a client that resends other tokens (a cut text) will not match
            self._save(slot, job, held, len(held) - n_pending, answer_from=len(job.request.prompt_tokens))
        self.slots.release(slot)
        self._started.discard(slot)
        with self._cv:
            if self._active.pop(slot, None) is not None:
                self.served += 1

    def _save(self, slot: int, job: Job, tokens: List[int], n_fed: int, answer_from: int = -1) -> None:
        """Save the slot's cache as the session of `tokens` (of which it holds the first `n_fed`; its answer from
        `answer_from`), when it fits."""
        n_cells = min(n_fed, self.llm.policy_of(slot).budget or n_fed)
        if 0 < n_cells * self.llm.kv_bytes_per_cell <= self.sessions.limit_bytes:
            self.sessions.put(tokens, n_fed, job.request.n_keep, self.slots.save(slot), _label(job), answer_from)


def request_line(job: Job, now: float) -> str:
    """A finished request in one line: prompt tokens fed and reused, time to the first token, answer tokens and their
    speed, and what the cache kept, evicted and recalled."""
    n_prompt = len(job.request.prompt_tokens)
    text = f"prompt {n_prompt} tokens ({n_prompt - job.progress.reused_tokens} fed, {job.progress.reused_tokens} reused)"
    if job.progress.first_token_at:
        speed = (job.progress.n_generated - 1) / (now - job.progress.first_token_at) if job.progress.n_generated > 1 and now > job.progress.first_token_at \
            else 0.0
        text += f", first token {job.progress.first_token_at - job.progress.submitted:.2f} s, {job.progress.n_generated} tokens at {speed:.1f} tok/s"
    else:
        text += f", no tokens generated, {now - job.progress.submitted:.2f} s"
    kv = job.progress.kv_cache or {}
    if kv:
        budget = "" if kv.get("budget") is None else f"/{kv['budget']}"
        text += f", kv {kv['kept']}{budget} kept, {kv['evicted']} evicted"
        if "host" in kv:
            text += f", {kv['host']} in host memory, {kv['recalled']} recalled"
    return text


def _label(job: Job) -> str:
    """Saved sessions are continued only under the policy and recall setting that made them ("": the server's), and
    only by requests with the same cache_salt (a client's conversations and system prompts stay its own: without
    a salt, `cached_tokens` would tell one client whether another sent a given prompt)."""
    salt = "" if job.request.cache_salt is None else "+salt=" + hashlib.sha256(job.request.cache_salt.encode()).hexdigest()
    return ("" if job.request.policy is None else job.request.policy.label) + ("" if job.request.recall is None else f"+recall={job.request.recall}") \
        + salt
