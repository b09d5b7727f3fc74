"""The user API: `Llama`, in the style of llama-cpp-python, with a KV cache bounded by an eviction policy."""
from __future__ import annotations

import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import _engine
from ._text import TextAssembler
from .capacity import CELL_PAD, cells_needed, largest_batch

Prompt = Union[str, bytes, Sequence[int]]
POLICIES = ("full", "local", "sink", "h2o")


@dataclass(frozen=True)
class KVState:
    """What the KV cache of one sequence holds (see `Llama.kv_state`)."""

    positions: np.ndarray    # int32 [n]: kept positions, ascending
    scores: np.ndarray       # float32 [n]: accumulated attention of each kept position, summed over heads
    head_scores: np.ndarray  # float32 [n, n_head]: the same per query head
    n_evicted: int           # tokens evicted so far
    n_seen: int              # tokens fed so far
    peak_cells: int          # most entries held at once (right after a decode, before its eviction)
    kv_bytes: int            # bytes allocated for the whole context's KV cache
    kv_cells: int            # KV cells allocated (n_ctx)

    @property
    def n_cells(self) -> int:
        """Entries held now."""
        return int(self.positions.shape[0])


class Llama:
    """A GGUF model on a patched llama.cpp whose KV cache never holds more than `budget` entries per sequence.

    Args:
        model_path: the GGUF file.
        budget: KV entries (tokens) kept per sequence; None keeps everything (the full cache).
        policy: "h2o" (heavy hitters by accumulated attention + a recent window), "local" (recent window),
            "sink" (first `sinks` tokens + recent window, StreamingLLM) or "full".
        heavy / recent / sinks: the split of the budget; h2o defaults to heavy = budget // 2, recent = the rest,
            sinks = 0; sink defaults to 4 sinks.
        position_rolling: renumber the kept positions 0..n-1 after each eviction, so that generation can run past
            the model's trained context (needs a model whose cache can shift).
        roll_interval: with rolling, renumber only once the kept positions have drifted this many tokens past
            0..n-1 (1: after every eviction). Each renumbering makes llama.cpp rotate every cached key in every
            layer; a larger interval pays that once per `roll_interval` evicted tokens, and positions stay below
            budget + roll_interval + n_batch. Which entries are kept is decided the same way either way.
        n_ctx: KV cells to allocate; 0 = budget + n_batch (bounded) or the trained context (full).
        n_batch: tokens per llama_decode; prompts longer than the free cells are fed in chunks with eviction in
            between, so memory stays at about budget + n_batch cells.
        n_seq_max: sequences the context can hold at once (each with its own budget).
        kv_unified: one cell space shared by all sequences (n_ctx = their budgets + one batch); False gives each
            sequence its own stream of n_ctx / n_seq_max cells (default: a budget + one batch each), so that a
            sequence attends only its own cells, as in llama.cpp's parallel server slots.
        n_threads: CPU threads (None: llama.cpp's default).
        n_gpu_layers: layers offloaded to the GPU (-1: all).
        seed: seed of the sampling RNG; each call without its own seed draws from it.
        kv_f32: store K/V in F32 instead of F16 (twice the bytes; exact position rolling).
    """

    def __init__(
        self,
        model_path: Union[str, os.PathLike],
        *,
        budget: Optional[int] = None,
        policy: str = "h2o",
        heavy: Optional[int] = None,
        recent: Optional[int] = None,
        sinks: Optional[int] = None,
        position_rolling: bool = False,
        roll_interval: int = 1,
        n_ctx: int = 0,
        n_batch: int = 512,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        n_threads: Optional[int] = None,
        n_gpu_layers: int = 0,
        seed: int = 0,
        kv_f32: bool = False,
        verbose: bool = False,
        _scores_sum_rows: bool = False,
        _capture_softmax: bool = False,
        _export_scores: bool = False,
    ):
        self.model_path = os.fspath(model_path)
        if not os.path.isfile(self.model_path):
            raise FileNotFoundError(f"model file not found: {self.model_path}")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if budget is None:
            if policy not in ("h2o", "full"):
                raise ValueError(f"policy {policy!r} needs a budget (KV entries kept per sequence)")
            policy = "full"
        for name, value in (("budget", budget), ("roll_interval", roll_interval), ("n_ctx", n_ctx), ("n_batch", n_batch),
                            ("n_seq_max", n_seq_max)):
            if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool)):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be >= 1 (KV entries kept per sequence), got {budget}")
        if roll_interval < 1:
            raise ValueError(f"roll_interval must be >= 1 (tokens), got {roll_interval}")
        if n_ctx < 0 or n_batch < 1:
            raise ValueError("n_ctx must be >= 0 and n_batch >= 1")

        def opt(v: Optional[int]) -> int:
            return -1 if v is None else int(v)

        self._engine = _engine.Engine(
            self.model_path,
            policy=policy,
            budget=opt(budget),
            heavy=opt(heavy),
            recent=opt(recent),
            sinks=opt(sinks),
            position_rolling=position_rolling,
            roll_interval=int(roll_interval),
            n_ctx=int(n_ctx),
            n_batch=int(n_batch),
            n_seq_max=int(n_seq_max),
            kv_unified=bool(kv_unified),
            n_threads=int(n_threads or 0),
            n_gpu_layers=int(n_gpu_layers),
            scores_sum_rows=_scores_sum_rows,
            capture_softmax=_capture_softmax,
            export_scores=_export_scores,
            kv_f32=kv_f32,
            verbose=verbose,
        )
        self.policy = policy
        self.budget = budget
        self.position_rolling = position_rolling
        self.roll_interval = int(roll_interval)
        self.sinks, self.heavy, self.recent = self._engine.split
        self.n_seq_max = int(n_seq_max)
        self.kv_unified = bool(kv_unified)
        self._rng = random.Random(seed)
        self.last_eog_token: Optional[int] = None  # the end-of-generation token the last generation sampled
        self._eog: Optional[np.ndarray] = None

    @classmethod
    def for_kv_limit(
        cls,
        model_path: Union[str, os.PathLike],
        kv_limit_bytes: int,
        *,
        prompt_tokens: int,
        max_tokens: int,
        budget: Optional[int] = None,
        n_batch: int = 128,
        kv_unified: bool = True,
        **kwargs: Any,
    ) -> "Llama":
        """The memory-capped mode: a Llama that runs the most sequences at once within `kv_limit_bytes` of KV.

        The full cache (`budget=None`) needs `prompt_tokens + max_tokens` cells per sequence, a bounded policy
        `budget` per sequence plus `n_batch` (shared in a unified cache, per sequence otherwise; see
        `h2o_local.capacity`). The returned object has
        `n_seq_max` set to that largest batch and its cache allocated within the limit (checked, in bytes, after
        llama.cpp's rounding). Other keyword arguments go to `Llama(...)`. Raises ValueError when not even one
        sequence fits.
        """
        if kv_limit_bytes < 1 or prompt_tokens < 1 or max_tokens < 0:
            raise ValueError("kv_limit_bytes and prompt_tokens must be >= 1 and max_tokens >= 0")
        kv_f32 = bool(kwargs.get("kv_f32", False))
        probe = cls(model_path, n_ctx=CELL_PAD, n_batch=min(n_batch, CELL_PAD), kv_f32=kv_f32)
        n_seq = largest_batch(kv_limit_bytes, bytes_per_cell=probe.kv_bytes_per_cell, prompt_tokens=prompt_tokens,
                              max_tokens=max_tokens, budget=budget, n_batch=n_batch, kv_unified=kv_unified)
        del probe
        while n_seq > 0:
            n_ctx = cells_needed(n_seq, prompt_tokens=prompt_tokens, max_tokens=max_tokens, budget=budget,
                                 n_batch=n_batch, kv_unified=kv_unified)
            llm = cls(model_path, budget=budget, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq, kv_unified=kv_unified,
                      **kwargs)
            if llm._engine.kv_bytes <= kv_limit_bytes:
                return llm
            n_seq -= 1  # a cache that is not all cells (sliding-window layers) can come out larger than estimated
        raise ValueError(f"not even one sequence of {prompt_tokens} + {max_tokens} tokens fits in {kv_limit_bytes} "
                         f"bytes of KV cache" + ("" if budget is None else f" with budget {budget}"))

    # ------------------------------------------------------------------ model facts
    def n_ctx(self) -> int:
        """KV cells (tokens, all sequences together) the cache fills at most: `n_ctx` as given, or its default.

        llama.cpp allocates this rounded up to a multiple of 256 (`kv_state().kv_cells`); the extra cells stay unused.
        """
        return self._engine.capacity

    @property
    def kv_bytes_per_cell(self) -> int:
        """Bytes of one KV cell: one token's K and V in every layer (models with sliding-window layers add a fixed
        part on top, so for them this is an average over the allocated cells)."""
        return self._engine.kv_bytes // self._engine.n_ctx

    def n_vocab(self) -> int:
        return self._engine.n_vocab

    def n_ctx_train(self) -> int:
        """The context length the model was trained with (tokens)."""
        return self._engine.n_ctx_train

    def token_bos(self) -> int:
        return self._engine.token_bos

    def token_eos(self) -> int:
        return self._engine.token_eos

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: Union[str, bytes], add_bos: bool = True, special: bool = False) -> List[int]:
        """Token ids of `text`; `add_bos` adds the model's BOS if it uses one; `special` parses special tokens."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._engine.tokenize(text, add_bos, special))

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        """The bytes of `tokens` (bytes, like llama-cpp-python: a token may hold part of a UTF-8 character)."""
        return self._engine.detokenize([int(t) for t in tokens], special)

    # ------------------------------------------------------------------ low level
    def eval(self, tokens: Sequence[int], *, seq_id: int = 0) -> None:
        """Feed tokens to a sequence, evicting as the policy says; the last token's logits are then in `last_logits`."""
        self._engine.eval({int(seq_id): [int(t) for t in tokens]}, False)

    def eval_batch(self, tokens: Dict[int, Sequence[int]]) -> None:
        """Feed several sequences in one batch: {seq_id: tokens}. Each keeps its own budget and scores."""
        self._engine.eval({int(s): [int(t) for t in toks] for s, toks in tokens.items()}, False)

    def last_logits(self, seq_id: int = 0) -> np.ndarray:
        """float32 [n_vocab]: the logits after the last token fed to `seq_id`."""
        return self._engine.last_logits(seq_id)

    def reset(self, seq_id: Optional[int] = None) -> None:
        """Forget a sequence (or all, with None): its KV entries, scores and counters."""
        if seq_id is None:
            self._engine.reset()
        else:
            self._engine.reset_seq(seq_id)

    def kv_state(self, seq_id: int = 0) -> KVState:
        """The kept positions of `seq_id`, their scores, and the cache counters."""
        st = self._engine.state(seq_id)
        return KVState(
            positions=st["positions"],
            scores=st["scores"],
            head_scores=st["head_scores"],
            n_evicted=st["n_evicted"],
            n_seen=st["n_seen"],
            peak_cells=st["peak_cells"],
            kv_bytes=self._engine.kv_bytes,
            kv_cells=self._engine.n_ctx,
        )

    def set_policy(self, policy: str, budget: Optional[int] = None, *, heavy: Optional[int] = None,
                   recent: Optional[int] = None, sinks: Optional[int] = None) -> None:
        """Switch the eviction policy for what follows; `compress()` applies it to the cache now.

        A policy that needs scores (h2o) needs a `Llama` created with one, so that scores were accumulated.
        """
        if budget is None and policy not in ("h2o", "full"):
            raise ValueError(f"policy {policy!r} needs a budget (KV entries kept per sequence)")
        if budget is None:
            policy = "full"

        def opt(v: Optional[int]) -> int:
            return -1 if v is None else int(v)

        self._engine.set_policy(policy, opt(budget), opt(heavy), opt(recent), opt(sinks))
        self.policy, self.budget = policy, budget
        self.sinks, self.heavy, self.recent = self._engine.split

    def compress(self, seq_id: int = 0) -> None:
        """Evict now what the current policy does not keep."""
        self._engine.compress(seq_id)

    def save_state(self, seq_id: int = 0):
        """A snapshot of one sequence: its KV cells, positions, scores, counters and last logits (in memory)."""
        return self._engine.snapshot(seq_id)

    def load_state(self, state, seq_id: int = 0) -> None:
        """Put a `save_state` snapshot back into `seq_id` (replacing what it holds), to branch from a prefix."""
        self._engine.restore(seq_id, state)

    # ------------------------------------------------------------------ generation
    def _sampler(self, temperature: float, top_p: float, top_k: int, min_p: float, seed: Optional[int]):
        if seed is None:
            seed = self._rng.getrandbits(32)
        return _engine.Sampler(float(temperature), float(top_p), int(top_k), float(min_p), int(seed) & 0xFFFFFFFF)

    def _prompt_tokens(self, prompt: Prompt, add_bos: Optional[bool]) -> List[int]:
        if isinstance(prompt, (str, bytes)):
            return self.tokenize(prompt, add_bos=self._engine.add_bos if add_bos is None else add_bos)
        return [int(t) for t in prompt]

    def _stream_tokens(self, prompt_tokens: List[int], max_tokens: Optional[int], sampler, stop: Sequence[str],
                       reset: bool, all_logits: bool = False) -> Iterator[tuple]:
        """Yields (token, text, logits) per generated token, then (None, text, finish_reason) once."""
        if not prompt_tokens and reset:
            raise ValueError("the prompt is empty: pass at least one token (or reset=False to continue)")
        _check_max_tokens(max_tokens)
        if reset:
            self._engine.reset()
        if prompt_tokens:
            self._engine.eval({0: prompt_tokens}, all_logits)
        text = TextAssembler(stop)
        n = 0
        finish = "length"
        while max_tokens is None or n < max_tokens:
            logits = self._engine.last_logits(0)
            token = sampler.sample(logits)
            if self._engine.is_eog(token):
                self.last_eog_token = token  # sampled, not fed: a session that goes on feeds it first
                finish = "stop"
                break
            n += 1
            piece = text.push(self._engine.token_to_piece(token, False))
            yield token, piece, logits
            if text.stopped:
                finish = "stop"
                break
            if self.policy == "full" and self._engine.cells_used >= self._engine.capacity:
                break  # the context is full and never evicts: stop like llama-cpp-python does
            if max_tokens is not None and n >= max_tokens:
                break
            self._engine.eval({0: [token]}, False)
        yield None, text.flush(), finish

    def generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: Optional[int] = 128,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        stop: Optional[Union[str, Sequence[str]]] = None,
        seed: Optional[int] = None,
        stream: bool = False,
        reset: bool = True,
        add_bos: Optional[bool] = None,
    ) -> Union[str, Iterator[str]]:
        """Generate text after `prompt` (str, bytes or token ids); temperature <= 0 is greedy.

        Returns the text, or with `stream=True` an iterator of text pieces. `max_tokens` counts generated tokens
        (None: until an end-of-generation token, a stop string, or, for the full cache, the end of the context).
        `reset=False` continues the session: the prompt is appended to what the cache already holds (an empty
        prompt continues from the last token fed).
        """
        stops = _stop_list(stop)
        sampler = self._sampler(temperature, top_p, top_k, min_p, seed)
        tokens = self._prompt_tokens(prompt, add_bos)
        it = self._stream_tokens(tokens, max_tokens, sampler, stops, reset)
        if stream:
            return (piece for _, piece, _ in it if piece)
        return "".join(piece for _, piece, _ in it)

    def create_completion(
        self,
        prompt: Prompt,
        *,
        max_tokens: Optional[int] = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        stop: Optional[Union[str, Sequence[str]]] = None,
        seed: Optional[int] = None,
        stream: bool = False,
        echo: bool = False,
        logprobs: Optional[int] = None,
    ) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        """An OpenAI-style text completion, as llama-cpp-python returns it (`choices[0]["text"]`, `finish_reason`,
        `usage`; `logprobs=k` adds the k most likely tokens per position; `echo` prepends the prompt)."""
        if logprobs is not None and logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        stops = _stop_list(stop)
        prompt_tokens = self._prompt_tokens(prompt, None)
        sampler = self._sampler(temperature, top_p, top_k, min_p, seed)
        want_prompt_lp = echo and logprobs is not None
        it = self._stream_tokens(prompt_tokens, max_tokens, sampler, stops, True, all_logits=want_prompt_lp)
        meta = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_path}
        if stream:
            return self._completion_chunks(it, meta, prompt_tokens, echo, logprobs)
        return self._completion(it, meta, prompt_tokens, echo, logprobs)

    __call__ = create_completion

    def _completion(self, it, meta, prompt_tokens, echo, logprobs) -> Dict[str, Any]:
        pieces, tokens, gen_logits = [], [], []
        finish = None
        for token, piece, extra in it:
            pieces.append(piece)
            if token is None:
                finish = extra
                break
            tokens.append(token)
            if logprobs is not None:
                gen_logits.append(extra)
        text = "".join(pieces)
        lp_out = None
        if logprobs is not None:
            lp_out = self._logprobs(prompt_tokens if echo else [], tokens, gen_logits, logprobs)
        if echo:
            text = self.detokenize(prompt_tokens).decode("utf-8", errors="replace") + text
        return {**meta, "choices": [{"text": text, "index": 0, "logprobs": lp_out, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(prompt_tokens), "completion_tokens": len(tokens),
                          "total_tokens": len(prompt_tokens) + len(tokens)}}

    def _completion_chunks(self, it, meta, prompt_tokens, echo, logprobs) -> Iterator[Dict[str, Any]]:
        if echo:
            yield {**meta, "choices": [{"text": self.detokenize(prompt_tokens).decode("utf-8", errors="replace"),
                                        "index": 0, "logprobs": None, "finish_reason": None}]}
        for token, piece, extra in it:
            if token is None:
                yield {**meta, "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": extra}]}
                return
            lp = None
            if logprobs is not None:
                lp = self._logprob_entry(token, extra, logprobs)
            yield {**meta, "choices": [{"text": piece, "index": 0, "logprobs": lp, "finish_reason": None}]}

    def _logprob_entry(self, token: int, logits: np.ndarray, k: int) -> Dict[str, Any]:
        lp = _log_softmax(logits)
        top = np.argsort(-lp)[:k]
        piece = self._engine.token_to_piece(token, False).decode("utf-8", errors="replace")
        return {"tokens": [piece], "token_logprobs": [float(lp[token])],
                "top_logprobs": [{self._engine.token_to_piece(int(t), False).decode("utf-8", errors="replace"):
                                  float(lp[t]) for t in top}]}

    def _logprobs(self, echoed: List[int], generated: List[int], gen_logits: List[np.ndarray], k: int) -> Dict[str, Any]:
        """llama-cpp-python's logprobs block: echoed prompt tokens (logits of the prompt pass), then generated ones."""
        rows = self._engine.logits_all(0) if echoed else np.zeros((0, self.n_vocab()), np.float32)
        out = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        offset = 0
        seq = list(echoed) + list(generated)
        for i, tok in enumerate(seq):
            piece = self._engine.token_to_piece(tok, False).decode("utf-8", errors="replace")
            out["tokens"].append(piece)
            out["text_offset"].append(offset)
            offset += len(piece)
            if i == 0 and echoed:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            logits = rows[i - 1] if i < len(echoed) else gen_logits[i - len(echoed)]
            lp = _log_softmax(logits)
            top = np.argsort(-lp)[:k]
            out["token_logprobs"].append(float(lp[tok]))
            out["top_logprobs"].append({self._engine.token_to_piece(int(t), False).decode("utf-8", errors="replace"):
                                        float(lp[t]) for t in top})
        return out

    # ------------------------------------------------------------------ batched generation
    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        *,
        max_tokens: Optional[int] = 128,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        stop: Optional[Union[str, Sequence[str]]] = None,
        seed: Optional[int] = None,
        stream: bool = False,
        add_bos: Optional[bool] = None,
        ignore_eos: bool = False,
    ) -> Union[List[str], Iterator[tuple]]:
        """Generate for several prompts decoded together: one llama_decode per step for all live sequences.

        Each sequence has its own KV budget, scores and sampler (seeded `seed + i`, so sequence i samples what
        `generate(prompts[i], seed=seed + i)` would, up to batching round-off); finished sequences leave the
        batch. At most `n_seq_max` prompts run at once; more are processed in waves. Returns the texts, or with
        `stream=True` an iterator of (index, text piece) pairs, and (index, None) when sequence `index` ends.
        `ignore_eos=True` never samples an end-of-generation token, so that every sequence runs to `max_tokens`
        (benchmarks).
        """
        stops = _stop_list(stop)
        _check_max_tokens(max_tokens)
        token_lists = [self._prompt_tokens(p, add_bos) for p in prompts]
        if any(not t for t in token_lists):
            raise ValueError("a prompt is empty: pass at least one token per prompt")
        base_seed = self._rng.getrandbits(32) if seed is None else int(seed)
        if ignore_eos and max_tokens is None:
            raise ValueError("ignore_eos=True needs max_tokens")
        it = self._batch_stream(token_lists, max_tokens, (temperature, top_p, top_k, min_p), base_seed, stops,
                                self._eog_tokens() if ignore_eos else None)
        if stream:
            return it
        texts = [""] * len(prompts)
        for i, piece in it:
            if piece:
                texts[i] += piece
        return texts

    def _eog_tokens(self) -> np.ndarray:
        if self._eog is None:
            self._eog = np.array([t for t in range(self.n_vocab()) if self._engine.is_eog(t)], dtype=np.int64)
        return self._eog

    def _batch_stream(self, token_lists, max_tokens, knobs, base_seed, stops, banned) -> Iterator[tuple]:
        self.finish_reasons: List[Optional[str]] = [None] * len(token_lists)
        for wave in range(0, len(token_lists), self.n_seq_max):
            idx = list(range(wave, min(wave + self.n_seq_max, len(token_lists))))
            self._engine.reset()
            self._engine.eval({s: token_lists[i] for s, i in enumerate(idx)}, False)
            live = {s: (i, self._sampler(*knobs, seed=base_seed + i), TextAssembler(stops), [0])
                    for s, i in enumerate(idx)}
            while live:
                step: Dict[int, List[int]] = {}
                for s, (i, sampler, text, count) in list(live.items()):
                    logits = self._engine.last_logits(s)
                    if banned is not None:
                        logits = np.array(logits, dtype=np.float32)
                        logits[banned] = -np.inf
                    token = sampler.sample(logits)
                    finish = None
                    if self._engine.is_eog(token):
                        finish = "stop"
                    else:
                        count[0] += 1
                        piece = text.push(self._engine.token_to_piece(token, False))
                        if piece:
                            yield i, piece
                        if text.stopped:
                            finish = "stop"
                        elif max_tokens is not None and count[0] >= max_tokens:
                            finish = "length"
                        else:
                            step[s] = [token]
                    if finish is not None:
                        yield from self._end_sequence(i, text, finish)
                        self._engine.reset_seq(s)
                        del live[s]
                if step:
                    if self.policy == "full" and self._engine.cells_used + len(step) > self._engine.capacity:
                        for s in list(live):
                            i, _, text, _ = live.pop(s)
                            yield from self._end_sequence(i, text, "length")
                        break
                    self._engine.eval(step, False)

    def _end_sequence(self, i: int, text: TextAssembler, finish: str) -> Iterator[tuple]:
        rest = text.flush()
        if rest:
            yield i, rest
        yield i, None
        self.finish_reasons[i] = finish

    # ------------------------------------------------------------------ chat
    def create_chat_completion(
        self,
        messages: Sequence[Dict[str, str]],
        *,
        max_tokens: Optional[int] = None,
        temperature: float = 0.2,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        stop: Optional[Union[str, Sequence[str]]] = None,
        seed: Optional[int] = None,
        stream: bool = False,
    ) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        """An OpenAI-style chat completion with the model's own chat template (from the GGUF)."""
        prompt = self.apply_chat_template(messages)
        tokens = self.tokenize(prompt, add_bos=self._engine.add_bos, special=True)
        stops = _stop_list(stop)
        sampler = self._sampler(temperature, top_p, top_k, min_p, seed)
        it = self._stream_tokens(tokens, max_tokens, sampler, stops, True)
        meta = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": self.model_path}
        if stream:
            return self._chat_chunks(it, meta)
        text, n, finish = [], 0, None
        for token, piece, extra in it:
            text.append(piece)
            if token is None:
                finish = extra
            else:
                n += 1
        return {**meta, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                             "logprobs": None, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n}}

    def _chat_chunks(self, it, meta) -> Iterator[Dict[str, Any]]:
        base = {**meta, "object": "chat.completion.chunk"}
        yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}]}
        for token, piece, extra in it:
            if piece:
                yield {**base, "choices": [{"index": 0, "delta": {"content": piece}, "logprobs": None,
                                            "finish_reason": None}]}
            if token is None:
                yield {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": extra}]}

    def apply_chat_template(self, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text the model's chat template makes of `messages` ([{"role": ..., "content": ...}])."""
        pairs = []
        for m in messages:
            if "role" not in m or "content" not in m:
                raise ValueError("each message needs a 'role' and a 'content'")
            pairs.append((str(m["role"]), str(m["content"])))
        return self._engine.apply_chat_template(pairs, add_generation_prompt)


def _stop_list(stop: Optional[Union[str, Sequence[str]]]) -> List[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _check_max_tokens(max_tokens: Optional[int]) -> None:
    if max_tokens is not None and max_tokens < 0:
        raise ValueError("max_tokens must be >= 0 (or None: until the end of the text or the context)")


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())
