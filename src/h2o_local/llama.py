"""The user API: `Llama`, in the style of llama-cpp-python, with a KV cache bounded by an eviction policy."""
from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import logging
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _engine, embeddings, generation, llama_cpp_python, rpc
from .backends import devices, gpu_offload_supported, where_layers_run
from . import sampling as sampling_
from .chat_template import ChatTemplate, Message, content_pieces, markup_strings, normalize_messages
from .text import TextAssembler, check_text
from .capacity import cells_needed, kv_bytes_per_cell, largest_batch
from .completions import Completions
from .cpu import physical_cores
from .kv_state import KVState, Snapshot
from .llama_types import CreateEmbeddingResponse, LlamaStats
from .model_info import ModelInfo
from .policies import Policy, check_int, resolve
from .sampling import SamplingParams

_log = logging.getLogger("h2o_local")

if TYPE_CHECKING:
    from .slots import Slots

Prompt = Union[str, bytes, Sequence[int]]

# recall=True keeps at most this much evicted K and V per sequence in host memory (bytes)
RECALL_DEFAULT_BYTES = 256 * 2**20


# the engine's own defaults (cpp/engine_params.h): declared there once, read here for Llama's signature
ENGINE_DEFAULTS = _engine.EngineParams()
# the warnings said once per process (Llama._warn_surprises)
_WARNED: set = set()
MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS: more crashed in its thread pool

# Llama keywords that are EngineParams fields of the same name and meaning, with an int's minimum (None: any; a bool
# is checked as one): the engine's setting rows (cpp/engine_params.cpp), checked and copied in one loop. Adding one:
# the C++ field and its row, the keyword (its default read from ENGINE_DEFAULTS) and README's row
# (tests/unit/test_engine_settings.py checks them against the rows).
# each setting's lowest and highest value (None: any, the type's)
_ENGINE_KEYWORDS: Dict[str, Tuple[Optional[int], Optional[int]]] = {
    s["name"]: (s["minimum"], s["maximum"]) for s in _engine.ENGINE_SETTINGS}


def _handed_to_completions(name: str) -> Callable[..., Any]:
    """A `Llama` method that hands over to its `Completions`, with that method's signature and help."""
    method = getattr(Completions, name)

    @functools.wraps(method)
    def call(self: "Llama", *args: Any, **kwargs: Any) -> Any:
        return getattr(self.completions, name)(*args, **kwargs)

    return call


def _check_settings(given: Dict[str, Any], *, n_threads, seed, rpc_servers, type_k, type_v, pooling_type,
                    recall_type, keep) -> None:
    """Llama's settings checked before anything is loaded: the engine's (`given`, by _ENGINE_KEYWORDS' ranges)
    and the others'; TypeError or ValueError naming the first that is wrong."""
    for name, (minimum, maximum) in _ENGINE_KEYWORDS.items():
        if isinstance(getattr(ENGINE_DEFAULTS, name), bool):
            if not isinstance(given[name], (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {given[name]!r}")
        elif maximum is None:
            check_int(name, given[name], minimum)
        else:
            check_int(name, given[name], minimum, maximum)
    check_int("n_threads", n_threads, 0, MAX_THREADS)
    check_int("seed", seed, maximum=None)  # seeds Python's generator: any int
    for endpoint in rpc.parse_endpoints(rpc_servers):
        rpc.check_server(endpoint)
    for name, value in (("type_k", type_k), ("type_v", type_v)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a ggml type name such as 'q8_0', got {value!r}")
    embeddings.check_pooling_type(pooling_type)
    if recall_type not in (None, "q8_0"):
        raise ValueError(f"recall_type must be None (the cache's own rows) or 'q8_0', got {recall_type!r}")
    if keep is not None and keep != "system":
        check_int("keep", keep, minimum=0)


def _chat_template_of(chat_template: Optional[str], chat_format: Optional[str]) -> Optional[str]:
    """The template a Llama renders chats with: its Jinja source or built-in name, or llama-cpp-python's chat_format
    name for one (not both)."""
    if chat_format is not None:
        if chat_template is not None:
            raise ValueError("give chat_template or chat_format (llama-cpp-python's name for it), not both")
        if not isinstance(chat_format, str):
            raise TypeError(f"chat_format must be a template's name, got {chat_format!r}")
        chat_template = llama_cpp_python.CHAT_FORMATS.get(chat_format, chat_format)
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a string (Jinja source or a built-in name), got {chat_template!r}")
    return chat_template


class Llama:
    """A GGUF model on a patched llama.cpp whose KV cache never holds more than `budget` entries per sequence.

    Args:
        model_path: the GGUF file.
        budget: KV entries (tokens) kept per sequence; None keeps everything (the full cache).
        policy: None (the default: `TOVA(budget, sinks=min(4, budget // 8), probe="question", pool=9, follow=12, recent=min(32, budget // 2), reply=True)`,
            heavy hitters ranked by the newest query and by the prompt's own question, the best of the quality
            suite, docs/quality.md), a policy value (`h2o_local.policies.H2O(...)`, `Sink(...)`, a `PythonRanked`
            subclass, ...) or a registered name (`h2o_local.policies.REGISTRY`): "h2o" (the published H2O: heavy
            hitters by accumulated attention + a recent window), "local" (recent window), "sink" (first `sinks` tokens + recent window, StreamingLLM),
            "full", and the other scorers "h2o_norm", "h2o_maxhead", "h2o_headnorm", "tova", "snapkv", "keydiff"
            (docs/policies.md), or a label as `Policy.label` prints it ("tova-256+s4+q32", "h2o-128+ph"), which
            carries its budget.
        heavy / recent / sinks: with a policy name (or the default), the split of the budget; h2o defaults to heavy =
            budget // 2, recent = the rest, sinks = 0; sink defaults to 4 sinks.
        position_rolling: a bounded cache renumbers its kept positions 0..n-1 (llama.cpp's K shift), so that a
            conversation runs past the model's trained context without degrading; recall brings evicted entries
            back among them in the conversation's order. On by default; False keeps the positions as fed (the
            output degrades past the trained context, with a warning). The full cache stops at its context.
        roll_interval: 0 (the default): renumber only when a sequence's next position, plus one batch and its
            probe, would pass the trained context, so every output below it is exactly what it is without rolling,
            and only where the model's cache can shift positions (otherwise rolling is off: `Llama.position_rolling`
            says). N >= 1: renumber whenever the kept positions have drifted N tokens past 0..n-1 (1: after every
            eviction), an error where the cache cannot shift. Each renumbering rotates every cached key in every
            layer. Which entries are kept is decided the same way either way.
        n_ctx: KV cells to allocate; 0 = budget + n_batch (bounded) or the trained context (full).
        n_batch: tokens per llama_decode; prompts longer than the free cells are fed in chunks with eviction in
            between, so memory stays at about budget + n_batch cells.
        n_ubatch: tokens per ubatch, llama.cpp's physical batch (its compute buffers grow with it): a batch is
            computed in ubatches of this many tokens and evicted only after the whole batch (its scores summed over
            all of them); 0 (the default) is n_batch, a larger value is n_batch (llama.cpp's and llama-cpp-python's
            min(n_batch, n_ubatch)).
        n_seq_max: sequences the context can hold at once (each with its own budget).
        kv_unified: one cell space shared by all sequences (n_ctx = their budgets + one batch); False gives each
            sequence its own stream of n_ctx / n_seq_max cells (default: a budget + one batch each), so that a
            sequence attends only its own cells, as in llama.cpp's parallel server slots.
        n_threads: CPU threads (None: the physical cores this process may use, `h2o_local.cpu.physical_cores()`;
            at most 512, ggml's limit).
        n_threads_batch: CPU threads for prompts (batches of more than one token), as llama.cpp's --threads-batch
            and llama-cpp-python's n_threads_batch; 0 (the default): as n_threads. At most 512.
        n_gpu_layers: layers whose weights and KV cache go to the GPU (-1, the default: all, as llama.cpp's own
            default and Ollama do; 0: none). Only a build with a GPU backend has a GPU to offload to (README,
            "GPU backends"); on a CPU build every value runs on the CPU. `layer_devices` says where each layer went.
        seed: seed of the sampling RNG; each call without its own seed draws from it.
        kv_f32: store K/V in F32 instead of F16 (twice the bytes; exact position rolling).
        type_k: the K cache's type by ggml name: "q8_0" (K at 0.53 of F16's bytes, a whole cell at 0.77), "q4_0"
            (0.28, a cell at 0.64), "q4_1", "q5_0", "q5_1", "iq4_nl", "bf16", "f16", "f32"; None: as V. Works with
            eviction, rolling (the K shift dequantizes and requantizes) and snapshots (restored only into the same
            types).
        type_v: the V cache's type; a quantized one ("q8_0": K and V at 0.53 of F16's bytes) needs flash attention
            (llama.cpp quantizes V only with it: "auto" turns it on, False refuses).
        rpc_servers: "host:port" of `h2o-local rpc-server` processes (llama.cpp's RPC backend); the offloaded
            layers (`n_gpu_layers`) run there and on this machine's GPUs, split by their free memory. Scores and
            eviction work as locally. A model uses its own servers only, never one an earlier `Llama` reached.
        flash_attn: llama.cpp's flash attention, with every policy: "auto" (the default) as llama.cpp's `-fa auto`
            where the layers run on a CUDA, Metal or Vulkan GPU (on where the device supports it: an 8k prompt on an
            H200 is read 4.4x faster), on for a quantized V cache, and off on the CPU, where it gains nothing for
            these models and costs the scoring policies a pass, as on a Vulkan device that is the CPU (Mesa's
            lavapipe; docs/gpu.md); True or "on", False or "off".
            `Llama.flash_attn` says what the context runs; a snapshot taken with it restores only into a context
            with it (V is kept untransposed). It forms no softmax: for the scoring policies the CPU kernel writes the softmax's column sums itself (a
            cache in CPU memory costs what `local` costs); a cache on a GPU gets them from a KQ softmax pass beside
            the flash kernel (no V product), at the cost of that pass. Either way the same scores as without it.
        op_offload: llama.cpp's (and llama-cpp-python's) setting: with a GPU backend, a large batch's products of
            weights held on the CPU still run on the GPU (False: layers kept on the CPU compute there).
        compact_cells: after a prompt (or `compress()`) evicted, move the kept entries to the lowest KV cells, so
            that decoding attends about `budget` cells rather than every cell the prompt went through (llama.cpp
            attends up to the highest used cell). Costs one copy of the kept K/V per prompt; off only to measure it.
        probe_rides: a prompt's question probe (the default policy's: the prompt's last tokens, decoded after each
            chunk to rank its entries before the eviction) is decoded in the same llama.cpp batch as the chunk, its
            attention summed apart from the chunk's (patch 0014), rather than in a decode of its own: the same
            scores for one pass over the weights instead of two (llama.cpp's batch and ubatch are larger by the
            probe's 32 tokens). Not with flash attention on the CPU, whose kernel sums every query together; off
            only to measure it.
        export_scores: export attention scores even when the policy does not rank by them, so that `kv_state()`
            and `last_scores()` show what H2O would see (costs a few percent of speed).
        keep: a protected prefix, never evicted whatever the policy decides (llama.cpp's `--keep`): an int keeps the
            first N tokens of every sequence; "system" keeps the system message(s) a chat starts with (chat calls
            only). The prefix counts inside the budget: the policy decides over the rest with budget - N entries
            (taken from the sinks, then the heavy part, then the recent window), so memory stays at `budget`.
            An int that leaves no room for the newest token raises ValueError; a system prompt longer than half
            the budget has its first budget // 2 tokens protected (logged as a warning on the "h2o_local" logger),
            the rest ranked by the policy like the conversation.
        chat_template: overrides the GGUF's chat template: Jinja source, or the name of a llama.cpp built-in
            template ("chatml", "llama3", ...).
        chat_format: llama-cpp-python's name for a built-in template ("chatml", "llama-2", "llama-3",
            "mistral-instruct", "qwen", "gemma", ...), in place of chat_template.
        recall: keep what the policy evicts in host memory instead of destroying it, and before each new prompt on a
            sequence (a chat's next turn, `generate(..., reset=False)`, a server conversation continued) bring back
            what that prompt's question ranks above the kept entries, within the budget: True keeps up to the
            model's trained context (`n_ctx_train` tokens) per sequence and at most 256 MiB of it
            (RECALL_DEFAULT_BYTES), an int that many tokens. Beyond it the oldest text loses its K and V but keeps
            its tokens (8 bytes each): a later question reads again the windows of it that hold its rarer tokens
            (the policy option `reread`, 256 tokens a step; 0 forgets what the cap drops). Host memory:
            `kv_bytes_per_cell` bytes per token kept there (SmolLM2-135M: 22.5 KiB, so 8,192 tokens take 180 MiB;
            Qwen2.5-0.5B: 12 KiB, 21,845 tokens in 256 MiB). The device cache stays at budget + n_batch cells.
            Needs a policy with the question probe (the default has it) and no per-head cells; a rolled sequence
            recalls too (its entries renumbered in the conversation's order). docs/recall.md.
        recall_type: how host memory keeps what recall spilled: None, the cache's own rows (a recalled entry is
            bit for bit the one that left); "q8_0", ggml's q8_0 blocks of the F16 rows (34 bytes per 32 values:
            0.53x the bytes, and twice the tokens in recall=True's 256 MiB; a recalled entry differs from the one
            that left by q8_0's rounding). "q8_0" needs an F16 cache (no kv_f32, type_k or type_v).

    llama-cpp-python's other keywords are taken where they ask for what this `Llama` does anyway: `type_k` / `type_v`
    as ggml type numbers (8: "q8_0"), `logits_all` and `no_perf` (ignored:
    logprobs need no logits_all here), and at their defaults the settings this library does not offer
    (`use_mmap=True`, `use_mlock=False`, `embedding=False`, `offload_kqv=True`, `lora_path=None`,
    `rope_freq_base=0.0`, ...; `h2o_local.llama_cpp_python`); any other value is a ValueError naming it, an unknown
    keyword a TypeError.
    """

    def __init__(
        self,
        model_path: Union[str, os.PathLike],
        *,
        budget: Optional[int] = None,
        policy: Union[str, Policy, None] = None,
        heavy: Optional[int] = None,
        recent: Optional[int] = None,
        sinks: Optional[int] = None,
        position_rolling: bool = ENGINE_DEFAULTS.position_rolling,
        roll_interval: int = ENGINE_DEFAULTS.roll_interval,
        n_ctx: int = ENGINE_DEFAULTS.n_ctx,
        n_batch: int = ENGINE_DEFAULTS.n_batch,
        n_ubatch: int = ENGINE_DEFAULTS.n_ubatch,
        n_seq_max: int = ENGINE_DEFAULTS.n_seq_max,
        kv_unified: bool = ENGINE_DEFAULTS.kv_unified,
        n_threads: Optional[int] = None,
        n_threads_batch: int = ENGINE_DEFAULTS.n_threads_batch,
        n_gpu_layers: int = ENGINE_DEFAULTS.n_gpu_layers,
        seed: int = 0,
        kv_f32: bool = ENGINE_DEFAULTS.kv_f32,
        type_k: Optional[str] = None,
        type_v: Optional[str] = None,
        flash_attn: Union[bool, str] = "auto",
        op_offload: bool = ENGINE_DEFAULTS.op_offload,
        rpc_servers: Optional[Sequence[str]] = None,
        compact_cells: bool = ENGINE_DEFAULTS.compact_cells,
        export_scores: bool = ENGINE_DEFAULTS.export_scores,
        keep: Union[int, str, None] = None,
        chat_template: Optional[str] = None,
        chat_format: Optional[str] = None,
        recall: Union[bool, int] = False,
        recall_type: Optional[str] = None,
        pooling_type: int = -1,
        verbose: bool = ENGINE_DEFAULTS.verbose,
        probe_rides: bool = ENGINE_DEFAULTS.probe_rides,
        _scores_sum_rows: bool = False,
        **_llama_cpp_python: Any,
    ):
        llama_cpp_python.check_constructor(_llama_cpp_python, n_threads=n_threads)
        type_k = llama_cpp_python.ggml_type_name("type_k", type_k)
        type_v = llama_cpp_python.ggml_type_name("type_v", type_v)
        if op_offload is None:  # llama-cpp-python's default: llama.cpp's
            op_offload = ENGINE_DEFAULTS.op_offload
        self.model_path = os.fspath(model_path)
        if not os.path.isfile(self.model_path):
            raise FileNotFoundError(f"model file not found: {self.model_path}")
        given = {name: value for name, value in locals().items() if name in _ENGINE_KEYWORDS}
        _check_settings(given, n_threads=n_threads, seed=seed, rpc_servers=rpc_servers, type_k=type_k, type_v=type_v,
                        pooling_type=pooling_type, recall_type=recall_type, keep=keep)
        self.policy: Policy = resolve(policy, budget, heavy=heavy, recent=recent, sinks=sinks)
        chat_template = _chat_template_of(chat_template, chat_format)
        self.keep: Union[int, str, None] = keep

        params = _engine.EngineParams()
        for name, value in given.items():  # same name and meaning: copied as given
            setattr(params, name, type(getattr(ENGINE_DEFAULTS, name))(value))
        params.policy = self.policy.cpp
        params.n_keep = keep if isinstance(keep, int) else 0
        params.n_threads = int(n_threads) if n_threads else physical_cores()
        params.scores_sum_rows = bool(_scores_sum_rows)
        params.type_k = "" if type_k is None else type_k
        params.type_v = "" if type_v is None else type_v
        params.flash_attn = _flash_attn_setting(flash_attn)
        params.rpc_servers = rpc.parse_endpoints(rpc_servers)
        params.host_q8_0 = recall_type == "q8_0"
        self._engine = _engine.Engine(self.model_path, params)
        facts = self._engine.facts()
        self.info = ModelInfo.from_facts(self.model_path, facts)
        # per layer, the ggml device holding its weights and KV cache: "CPU", "Vulkan0", "CUDA0", "Metal", "RPC[...]"
        self.layer_devices: Tuple[str, ...] = tuple(facts["layer_devices"])
        self.flash_attn: bool = bool(self._engine.flash_attn)  # what the context runs ("auto" resolved)
        self._embeddings = embeddings.Embeddings(
            _weakly(self._open_engine), n_ctx=embeddings.context_size(self._engine.n_batch, self.info.n_ctx_train),
            n_threads=params.n_threads, pooling_type=pooling_type)
        self.position_rolling = bool(self._engine.position_rolling)  # as the engine resolved it
        self.export_scores = bool(export_scores)
        self.roll_interval = int(roll_interval)
        self.n_seq_max = int(n_seq_max)
        self.kv_unified = bool(kv_unified)
        self._rng = random.Random(seed)
        self.last_eog_token: Optional[int] = None  # the end-of-generation token the last generation sampled
        self.finish_reasons: List[Optional[str]] = []  # of the last generate_batch, per prompt
        self._eog: Optional[List[int]] = None
        # calls from several threads are serialized by `lock` (hold it to make several calls one); a generation
        # checks at every step that no other call took the context over since its last step (then it raises
        # RuntimeError instead of going on on a changed cache)
        self.lock = threading.RLock()
        self._generation: Optional[object] = None  # the generation that owns the context now
        self._pending: List[int] = []                # shown to the user, not yet fed: a continued session feeds it
        self._warned_past_context = False
        self._chat_template_source = chat_template
        self._chat_template: Optional[ChatTemplate] = None
        self._seq_policies: Dict[int, Policy] = {}  # sequences with a policy of their own (set_policy(seq_id=))
        self.recall: int = 0  # host entries kept per sequence (0: off)
        self.recall_type: Optional[str] = recall_type
        if recall is not False and recall is not None:
            self.set_recall(recall)
        if chat_format is not None:  # a name, not source: one that is no template is refused now, not at the first chat
            self.apply_chat_template([{"role": "user", "content": "x"}])
        self._warn_surprises(n_ctx_given=n_ctx, n_gpu_layers=n_gpu_layers, rpc_servers=rpc_servers)

    def _warn_surprises(self, n_ctx_given: int, n_gpu_layers: int, rpc_servers: Optional[Sequence[str]]) -> None:
        """What a setting does that its user may not expect, said once (as llama.cpp's log says it): a cache larger
        than the model's trained context, GPU layers asked of a build without a GPU."""
        n_train = self.info.n_ctx_train
        mib = self._engine.kv_bytes / 2**20
        if self.budget is not None and self.budget > n_train > 0:
            warnings.warn(f"budget={self.budget} is larger than the model's trained context ({n_train} tokens): a "
                          f"conversation's kept positions span more than the model was trained on, so its output "
                          f"degrades past {n_train} tokens; the cache allocates {mib:.0f} MiB", RuntimeWarning,
                          stacklevel=3)
        elif self.budget is None and n_ctx_given and n_ctx_given > n_train * self.n_seq_max > 0:
            warnings.warn(f"n_ctx={n_ctx_given} is larger than the model's trained context ({n_train} tokens per "
                          f"sequence): the output degrades past it; the cache allocates {mib:.0f} MiB",
                          RuntimeWarning, stacklevel=3)
        if n_gpu_layers > 0 and not rpc_servers and not gpu_offload_supported() and \
                "n_gpu_layers" not in _WARNED:
            _WARNED.add("n_gpu_layers")
            warnings.warn(f"n_gpu_layers={n_gpu_layers}: this build has no GPU backend (devices: "
                          f"{', '.join(d.name for d in devices())}), so every layer runs on the CPU; build "
                          f"one with CMAKE_ARGS=\"-DGGML_CUDA=on\" (or VULKAN, METAL) pip install .",
                          RuntimeWarning, stacklevel=3)

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
        `h2o_local.capacity`). The returned object has `n_seq_max` set to that largest batch and its cache
        allocated within the limit (checked, in bytes, after llama.cpp's rounding). Other keyword arguments go to
        `Llama(...)`. Raises ValueError when not even one sequence fits.
        """
        if kv_limit_bytes < 1 or prompt_tokens < 1 or max_tokens < 0:
            raise ValueError("kv_limit_bytes and prompt_tokens must be >= 1 and max_tokens >= 0")
        per_cell = kv_bytes_per_cell(ModelInfo.load(model_path).kv_bytes_per_cell, kv_f32=kwargs.get("kv_f32", False),
                                     type_k=kwargs.get("type_k"), type_v=kwargs.get("type_v"))
        n_seq = largest_batch(kv_limit_bytes, bytes_per_cell=max(per_cell, 1), prompt_tokens=prompt_tokens,
                              max_tokens=max_tokens, budget=budget, n_batch=n_batch, kv_unified=kv_unified)
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

    # ------------------------------------------------------------------ the policy's split, for short
    @property
    def budget(self) -> Optional[int]:
        """KV entries kept per sequence (None: the full cache)."""
        return self.policy.budget

    @property
    def sinks(self) -> int:
        return self.policy.split[0]

    @property
    def heavy(self) -> int:
        return self.policy.split[1]

    @property
    def recent(self) -> int:
        return self.policy.split[2]

    # ------------------------------------------------------------------ model and context facts
    def n_ctx(self) -> int:
        """KV cells (tokens, all sequences together) the cache fills at most: `n_ctx` as given, or its default.

        llama.cpp allocates this rounded up to a multiple of 256 (`kv_state().kv_cells`); the extra cells stay unused.
        """
        return self._engine.capacity

    @property
    def n_threads(self) -> int:
        """CPU threads of each decode of one token (generation)."""
        return self._engine.n_threads

    @property
    def n_threads_batch(self) -> int:
        """CPU threads of each decode of more tokens (prompts)."""
        return self._engine.n_threads_batch

    @property
    def n_batch(self) -> int:
        """Tokens per llama_decode."""
        return self._engine.n_batch

    @property
    def kv_bytes_per_cell(self) -> int:
        """Bytes of one allocated KV cell: one token's K and V in every layer (models with sliding-window layers add
        a fixed part on top, so for them this is an average over the allocated cells)."""
        return self._engine.kv_bytes // self._engine.n_ctx

    def n_vocab(self) -> int:
        return self.info.n_vocab

    def n_embd(self) -> int:
        """The model's embedding width (values per token)."""
        return self.info.n_embd

    @functools.cached_property
    def metadata(self) -> Dict[str, str]:
        """The GGUF's key-value metadata, every value as text (as llama-cpp-python's `Llama.metadata`)."""
        return dict(self._engine.metadata())

    def set_seed(self, seed: int) -> None:
        """Seed the draws of calls that give no `seed` of their own (as at construction)."""
        check_int("seed", seed, maximum=None)
        self._rng = random.Random(seed)

    def n_ctx_train(self) -> int:
        """The context length the model was trained with (tokens)."""
        return self.info.n_ctx_train

    def token_bos(self) -> int:
        return self.info.token_bos

    def token_eos(self) -> int:
        return self.info.token_eos

    def token_nl(self) -> int:
        """The newline token (-1 where the vocabulary has none)."""
        return self.info.token_nl

    def embed(self, input: Union[str, List[str], List[int], List[List[int]]], normalize: bool = False,
              truncate: bool = True, return_count: bool = False) -> Any:
        """llama-cpp-python's: the embedding of a text (a list of `n_embd()` floats), or a list of them for a list of
        texts (or of token-id lists). A text is tokenized as `tokenize(text)` (BOS where the model adds one); its
        vector is the model's last hidden states pooled (`pooling_type()`; pooling none gives a row per token) in a
        context of their own, made at the first call: the generation's KV cache is untouched (llama-cpp-python's
        `embed` clears it). At most `embedding_max_tokens` per input (n_batch, at least 512): longer ones are cut
        there (`truncate`) or refused (ValueError). `normalize` scales each vector to length 1; `return_count` also returns the tokens read.
        docs/embeddings.md."""
        inputs, alone = embeddings.as_inputs(input)
        n_ctx = self._embeddings.n_ctx
        token_lists = [embeddings.truncated(self.tokenize(x) if isinstance(x, str) else _token_list(x), n_ctx,
                                            truncate) for x in inputs]
        out = self._embeddings.embed(token_lists, normalize=normalize)
        vectors = out.vectors[0] if alone else out.vectors
        return (vectors, out.n_tokens) if return_count else vectors

    def create_embedding(self, input: Union[str, List[str], List[int], List[List[int]]],
                         model: Optional[str] = None) -> CreateEmbeddingResponse:
        """llama-cpp-python's: OpenAI's embeddings response for `input` (`embed(input)`'s vectors, not normalized,
        each input cut at `embedding_max_tokens`), `model` its model name (default: the model's path)."""
        inputs, _ = embeddings.as_inputs(input)
        vectors, n_tokens = self.embed(inputs, return_count=True)
        return {"object": "list", "model": model if model is not None else self.model_path,
                "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

    @property
    def embedding_max_tokens(self) -> int:
        """The most tokens of one input `embed` reads (its context's size: n_batch, at least 512 where the model was
        trained on as many)."""
        return self._embeddings.n_ctx

    def _open_engine(self) -> Any:
        if isinstance(self._engine, _Closed):
            raise RuntimeError("this Llama was closed: make a new one")
        return self._engine

    def pooling_type(self) -> int:
        """The pooling `embed` runs (llama.cpp's: 0 none, 1 mean, 2 cls, 3 last): the constructor's `pooling_type`,
        or for -1 the model's own, mean where its GGUF names none."""
        return self._embeddings.pooling_type

    def tokenizer(self) -> "llama_cpp_python.LlamaTokenizer":
        """llama-cpp-python's tokenizer object over this model (`encode` / `decode` text, `tokenize` / `detokenize`)."""
        return llama_cpp_python.LlamaTokenizer(self)

    @staticmethod
    def logits_to_logprobs(logits: Any, axis: int = -1) -> np.ndarray:
        """Log-probabilities (float32) from logits along `axis` (a log-softmax, as llama-cpp-python's)."""
        x = np.asarray(logits, dtype=np.float32)
        top = np.amax(x, axis=axis, keepdims=True)
        top[~np.isfinite(top)] = 0
        shifted = x - top
        with np.errstate(divide="ignore"):
            return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))

    @staticmethod
    def longest_token_prefix(a: Sequence[int], b: Sequence[int]) -> int:
        """How many tokens `a` and `b` share from their start."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    def is_eog(self, token: int) -> bool:
        """True for an end-of-generation token (EOS, EOT, ...)."""
        return bool(self._engine.is_eog(_token_list([token])[0]))

    def eog_tokens(self) -> List[int]:
        """Every end-of-generation token of the vocabulary."""
        if self._eog is None:
            self._eog = [t for t in range(self.n_vocab()) if self._engine.is_eog(t)]
        return list(self._eog)

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: Union[str, bytes], add_bos: bool = True, special: bool = False) -> List[int]:
        """Token ids of `text`; `add_bos` adds the model's BOS if it uses one; `special` parses special tokens."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise TypeError(f"text must be str or bytes, got {type(text).__name__}")
        return list(self._engine.tokenize(check_text("the text", text), bool(add_bos), bool(special)))

    def detokenize(self, tokens: Sequence[int], special: bool = False, *,
                   prev_tokens: Optional[Sequence[int]] = None) -> bytes:
        """The bytes of `tokens` (bytes, like llama-cpp-python: a token may hold part of a UTF-8 character);
        `prev_tokens`: the tokens before them, so that the bytes are those `tokens` add after them (a tokenizer
        that drops a text's leading space keeps it there)."""
        if not prev_tokens:
            return self._engine.detokenize(_token_list(tokens), special)
        before = self._engine.detokenize(_token_list(prev_tokens), special)
        whole = self._engine.detokenize(_token_list(list(prev_tokens) + list(tokens)), special)
        if whole.startswith(before):
            return whole[len(before):]
        return self._engine.detokenize(_token_list(tokens), special)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token."""
        return self._engine.token_to_piece(_token_list([token])[0], bool(special))

    # ------------------------------------------------------------------ low level
    def eval(self, tokens: Sequence[int], *, seq_id: int = 0, logits_all: bool = False,
             progress: Optional[Callable[[int, int], None]] = None) -> Optional[np.ndarray]:
        """Feed tokens to a sequence, evicting as the policy says; the last token's logits are then in
        `last_logits`. With `logits_all=True`, returns every fed token's logits (float32 [n, n_vocab]).
        `progress(fed, total)`: called between the pieces of a long prompt (whole batches; it may raise to stop)."""
        seq_id = self._check_seq(seq_id)
        tokens = _token_list(tokens)
        with self.lock:
            self._take_over([seq_id])
            self._engine.eval({seq_id: tokens}, bool(logits_all), _feed_progress(progress, len(tokens), self.n_batch))
            return self._engine.logits_all(seq_id) if logits_all else None

    def eval_batch(self, tokens: Dict[int, Sequence[int]]) -> None:
        """Feed several sequences in one batch: {seq_id: tokens}. Each keeps its own budget and scores."""
        if not isinstance(tokens, dict):
            raise TypeError(f"eval_batch takes {{seq_id: [token, ...]}}, got {type(tokens).__name__}")
        batch = {self._check_seq(s): _token_list(toks) for s, toks in tokens.items()}
        with self.lock:
            self._take_over(batch)
            self._engine.eval(batch, False)

    def last_logits(self, seq_id: int = 0) -> np.ndarray:
        """float32 [n_vocab]: the logits after the last token fed to `seq_id`."""
        return self._engine.last_logits(self._check_seq(seq_id))

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor: Any = None,
               grammar: Optional[str] = None, idx: Optional[int] = None, *, seq_id: int = 0) -> int:
        """llama-cpp-python's: a token drawn from the logits after the last token fed to `seq_id` (`eval`), with
        its keywords and defaults (`temp`: 0 greedy, < 0 the plain softmax; `grammar`: GBNF text). `idx`: the
        logits after that token of the last `eval(..., logits_all=True)` instead (0 its first). As llama-cpp-python's
        one-off draw, the penalties see no earlier tokens; `tfs_z` and `penalize_nl` are ignored, as there. The
        seed is the next of this `Llama`'s (`set_seed`)."""
        llama_cpp_python.without_not_done({"logits_processor": logits_processor}, llama_cpp_python.CALL_NOT_DONE)
        if isinstance(temp, (int, float)) and not isinstance(temp, bool) and temp < 0:  # llama.cpp's dist alone
            temp, top_k, top_p, min_p, typical_p = 1.0, 0, 1.0, 0.0, 1.0
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                                repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                                mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar)
        if idx is None:
            logits = self.last_logits(seq_id)
        else:
            rows = self.prompt_logits(seq_id)
            if not len(rows):
                raise ValueError("idx needs the rows of an eval(..., logits_all=True) on this sequence; it kept none")
            check_int("idx", idx, minimum=0, maximum=len(rows) - 1)
            logits = rows[idx]
        return int(self._sampler(params).sample(logits))

    def last_scores(self, seq_id: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """What the last llama_decode exported for `seq_id`: (positions int32 [n], column sums float32
        [n, n_head]), the attention each cached position received from that decode's queries, summed over layers.
        Empty when scores are not exported (a policy that does not need them, without `export_scores=True`)."""
        return self._engine.last_scores(self._check_seq(seq_id))

    def reset(self, seq_id: Optional[int] = None) -> None:
        """Forget a sequence (or all, with None): its KV entries, scores and counters."""
        seq = None if seq_id is None else self._check_seq(seq_id)
        with self.lock:
            self._take_over(None if seq is None else [seq])
            if seq is None:
                self._engine.reset()
            else:
                self._engine.reset_seq(seq)

    def truncate(self, n_tokens: int, seq_id: int = 0) -> None:
        """Forget what `seq_id` was fed from its `n_tokens`-th token on (tokens, not positions): those entries leave
        the cache and the recall store, the token shown and not fed too, and the next token fed is its
        `n_tokens`-th again; what the cache evicted meanwhile stays evicted (its host copies recallable). As
        llama-server reuses the common prefix of a cached prompt: a conversation whose re-rendered history differs
        from what was fed near its end (an answer whose first spaces merge with the template's newline) goes on from
        the common part instead of reading everything again. ValueError outside [0, tokens fed]."""
        seq = self._check_seq(seq_id)
        check_int("n_tokens", n_tokens, 0, maximum=None)
        with self.lock:
            self._take_over([seq])  # the token shown and not fed goes too
            self._engine.truncate(seq, int(n_tokens))

    def warm_up(self, anywhere: bool = False) -> bool:
        """Read a made-up prompt the way a prompt is read (a full chunk of n_batch tokens and, in a bounded cache whose
        budget is within three chunks, an eviction with its probe; within the trained context), decode one step, then
        forget it all, as llama.cpp's own tools do at load (`--no-warmup`): a GPU loads each kernel on its first use
        (Metal and Vulkan compile theirs), which the first prompt would otherwise wait for. Runs where a layer is on a
        device other than the CPU, or `anywhere` (the CPU loads nothing on first use: there it only reads the weights
        from the file early), and returns whether it ran. For an empty cache (before the first prompt): ValueError
        otherwise."""
        if not anywhere and all(d == "CPU" for d in self.layer_devices):
            return False
        with self.lock:
            if self._engine.cells_used:
                raise ValueError("warm_up() reads a made-up prompt into an empty cache: call it before the first "
                                 "prompt")
            # a chunk, and past a budget within reach an eviction; never past four chunks or the trained context
            n = min(self.n_ctx() - 2, self.n_batch) if self.budget is None else self.budget + self.n_batch + 1
            n = max(1, min(n, 4 * self.n_batch, self.n_ctx_train() - 1))
            words = self.tokenize("The quick brown fox jumps over the lazy dog while the sun sets. " * 8)
            tokens = (words * (n // len(words) + 1))[:n]
            try:
                self.eval(tokens)
                self.eval(tokens[-1:])
            finally:
                self.reset()
        return True

    def stats(self) -> LlamaStats:
        """The context's counters since it was made: llama_decode calls (`decodes`: a prompt's chunks, each generated
        token, each probe), the ubatches among them that reused the previous compute graph (`graphs_reused`), the KV
        cache's size (`kv_bytes`, bytes) and the cells holding an entry now across sequences (`cells_used`)."""
        e = self._engine
        with self.lock:
            return {"decodes": int(e.n_decode), "graphs_reused": int(e.n_graphs_reused), "kv_bytes": int(e.kv_bytes),
                    "cells_used": int(e.cells_used)}

    def kv_state(self, seq_id: int = 0) -> KVState:
        """The kept positions of `seq_id`, their scores, and the cache counters."""
        st = self._engine.state(self._check_seq(seq_id))
        return KVState(positions=st["positions"], scores=st["scores"], head_scores=st["head_scores"],
                       queries=st["queries"], n_evicted=st["n_evicted"], n_seen=st["n_seen"],
                       peak_cells=st["peak_cells"], kv_bytes=self._engine.kv_bytes, kv_cells=self._engine.n_ctx,
                       n_keep=st["n_keep"], tokens=st["tokens"], probe_scores=st["probe_scores"],
                       reply_marks=st["reply_marks"],
                       head_positions=st["head_positions"], head_layers=st["head_layers"],
                       evict_seconds=st["evict_seconds"], n_head_moves=st["n_head_moves"],
                       probe_seconds=st["probe_seconds"], n_probes=st["n_probes"],
                       decode_seconds=st["decode_seconds"], compact_seconds=st["compact_seconds"],
                       host_positions=st["host_positions"], host_bytes=st["host_bytes"], n_spilled=st["n_spilled"],
                       n_recalled=st["n_recalled"], n_dropped=st["n_dropped"], origins=st["origins"],
                       host_origins=st["host_origins"], text_origins=st["text_origins"])

    def set_policy(self, policy: Union[str, Policy, None], budget: Optional[int] = None, *, heavy: Optional[int] = None,
                   recent: Optional[int] = None, sinks: Optional[int] = None, seq_id: Optional[int] = None) -> None:
        """Switch the eviction policy for what follows (arguments as `Llama`'s); `compress()` applies it to the
        cache now.

        seq_id: switch that sequence alone (a server slot, one conversation of a batch). It keeps the policy when it
        is reset, until another `set_policy(..., seq_id=...)`, or a `set_policy` without seq_id, which switches
        every sequence. `policy_of(seq_id)` says which policy a sequence follows.

        The budget and probe must fit in the cells the `Llama` was created with (`n_ctx`), and a policy that needs
        scores (h2o) needs a `Llama` created with one (or `export_scores=True`), so that scores were accumulated:
        ValueError otherwise, with nothing changed.
        """
        value = resolve(policy, budget, heavy=heavy, recent=recent, sinks=sinks)
        seq = None if seq_id is None else self._check_seq(seq_id)
        with self.lock:
            self._take_over(())  # no cache changes until the next eval or compress()
            if seq is None:
                self._engine.set_policy(value.cpp)
                self.policy = value
                self._seq_policies.clear()
            else:
                self._engine.set_seq_policy(seq, value.cpp)
                self._seq_policies[seq] = value

    def set_recall(self, recall: Union[bool, int, None], *, seq_id: Optional[int] = None) -> None:
        """Turn recall on (True: up to `n_ctx_train` host entries per sequence, at most RECALL_DEFAULT_BYTES of them;
        an int: that many) or off (False or 0: what the sequences spilled is dropped). See `Llama(recall=...)`.
        `seq_id`: for that sequence alone (a server's conversation; None as `recall`: the Llama's setting again).
        ValueError when the policy cannot recall."""
        if recall is None and seq_id is None:
            raise ValueError("recall=None means the Llama's own setting: give it with seq_id")
        cap = self._recall_cap(recall)
        with self.lock:
            if seq_id is None:
                self._engine.set_recall(cap)
                self.recall = cap
            else:
                self._engine.set_seq_recall(self._check_seq(seq_id), cap)

    def _recall_cap(self, recall: Union[bool, int, None]) -> int:
        """Host entries per sequence as the engine takes them: -1 for None (the Llama's own setting)."""
        if recall is None:
            return -1
        if isinstance(recall, (bool, np.bool_)):
            return min(self.info.n_ctx_train, RECALL_DEFAULT_BYTES // max(self.host_entry_bytes, 1)) if recall else 0
        check_int("recall", recall, minimum=0)
        return int(recall)

    @property
    def host_entry_bytes(self) -> int:
        """Bytes of host memory per token recall keeps there (its K and V of every layer, as `recall_type` says)."""
        raw = self._engine.entry_size
        return _engine.q8_0_entry_bytes(raw) if self.recall_type == "q8_0" else raw

    def check_recall(self, policy: Optional[Policy] = None) -> None:
        """Raise ValueError, saying why, when `policy` (default: this Llama's) cannot recall here (no question probe,
        per-head cells, a cache that cannot keep entries apart)."""
        self._engine.check_recall((policy or self.policy).cpp)

    def policy_of(self, seq_id: int = 0) -> Policy:
        """The policy sequence `seq_id` follows: its own (`set_policy(..., seq_id=...)`) or the `Llama`'s."""
        return self._seq_policies.get(self._check_seq(seq_id), self.policy)

    def configure(self, seq_id: int, *, policy: Optional[Policy] = None, recall: Union[bool, int, None] = None,
                  keep: Optional[int] = None) -> None:
        """One sequence's settings at once (a server slot, between two requests): its `policy` (a resolved value;
        None: the `Llama`'s), its `recall` (as `set_recall`; None: the `Llama`'s) and, when given, its protected
        prefix `keep` (tokens, as `keep` caps it). The policy and recall are checked together before either
        changes: ValueError with nothing changed."""
        seq = self._check_seq(seq_id)
        cap = self._recall_cap(recall)
        with self.lock:
            self._take_over(())  # as set_policy: no cache changes until the next eval
            self._engine.configure_seq(seq, None if policy is None else policy.cpp, cap)
            if policy is None:
                self._seq_policies.pop(seq, None)
            else:
                self._seq_policies[seq] = policy
            if keep is not None:
                self._set_keep(seq, keep)

    @property
    def pending(self) -> List[int]:
        """The token the last generation on sequence 0 showed and did not feed (0 or 1 of them): a session that
        goes on (`reset=False`) feeds it first; `save_state()` keeps it."""
        return list(self._pending)

    def slots(self, **options: Any) -> "Slots":
        """The sequences as slots that concurrent generations fill and leave, stepped together (what a server
        needs; see `h2o_local.slots`; `options` are its own). Using them ends any generation of this `Llama` left
        suspended."""
        from .slots import Slots

        return Slots(self, self._engine, **options)

    def recall_for(self, question: Prompt, seq_id: int = 0) -> int:
        """Bring back now, within the budget, what `question` (text or token ids; not fed) ranks above the kept
        entries of what `seq_id` spilled to host memory (`recall`); every new prompt does this by itself. Returns
        the entries brought back."""
        seq_id = self._check_seq(seq_id)
        tokens = self.prompt_tokens(question, False)
        with self.lock:
            self._take_over([seq_id])
            before = self.kv_state(seq_id).n_recalled
            self._engine.recall_for(seq_id, tokens)
            return self.kv_state(seq_id).n_recalled - before

    def compress(self, seq_id: int = 0) -> None:
        """Evict now what the current policy does not keep. A policy with a query-agnostic probe (`probe="repeat"`
        or `"catalyst"`) runs it first, so a document compressed here is ranked by what a reader would look at
        before any question is asked; the question probe has no question here and ranks by what it saw before."""
        seq_id = self._check_seq(seq_id)
        with self.lock:
            self._take_over([seq_id])
            self._engine.compress(seq_id)

    def save_state(self, seq_id: int = 0):
        """A snapshot of one sequence: its KV cells, positions, scores, counters and last logits (in memory;
        `.to_bytes()` / `Snapshot.from_bytes()` for a file), and the token the last generation showed but did
        not feed (fed first when the restored session goes on)."""
        seq_id = self._check_seq(seq_id)
        with self.lock:
            snap = self._engine.snapshot(seq_id)
            if seq_id == 0:
                snap.pending = list(self._pending)
            return snap

    def load_state(self, state, seq_id: int = 0) -> None:
        """Put a `save_state` snapshot back into `seq_id` (replacing what it holds), to branch from a prefix.

        Refused (ValueError, the sequence unchanged) for a snapshot of another model or cache layout, or one that
        holds more entries than the sequence has room for, or whose KV cells llama.cpp refuses (damaged): the
        sequence then holds what it held before, and the token the last generation showed stays to be fed."""
        seq_id = self._check_seq(seq_id)
        if not isinstance(state, Snapshot):
            raise TypeError(f"state must come from save_state(), got {type(state).__name__}")
        with self.lock:
            self._engine.restore(seq_id, state)  # all or nothing: a refused snapshot leaves the sequence as it was
            self._take_over([seq_id])
            if seq_id == 0:
                self._pending = list(state.pending)

    def _take_over(self, seq_ids: Optional[Iterable[int]] = None) -> Optional[object]:
        """A call that changes the cache of `seq_ids` (None: all): a suspended generation may not go on after it.
        The token a generation showed and did not feed belongs to sequence 0: only a call on it drops that token.
        Returns the new owner."""
        self._generation = owner = object()
        if seq_ids is None or 0 in seq_ids:
            self._pending = []
        return owner

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold this `Llama` for steps of one's own (a server's slots): its lock, with any generation left suspended
        ended first (it raises at its next step)."""
        with self.lock:
            self._take_over()
            yield

    def close(self) -> None:
        """Free the model and its KV cache now, as llama-cpp-python's `close()` (also `with Llama(...) as llm:`).
        A generation still running stops at its next step; any later call raises RuntimeError."""
        with self.lock:
            self._take_over()
            self._engine = _Closed()
            self._embeddings.close()

    def __enter__(self) -> "Llama":
        return self

    def __repr__(self) -> str:
        """The model, the policy's label, the budget in tokens, where the layers run; "closed" once closed."""
        budget = "full cache" if self.policy.budget is None or not self.policy.bounded else f"budget={self.policy.budget}"
        state = "closed" if isinstance(self._engine, _Closed) else \
            f"on {where_layers_run(self.layer_devices)}, recall={'on' if self.recall else 'off'}"
        return (f"Llama({os.path.basename(self.model_path)!r}, policy={self.policy.label}, {budget}, "
                f"n_seq_max={self.n_seq_max}, {state})")

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def max_system_keep(self) -> Optional[int]:
        """The most tokens `keep="system"` protects (half the budget; None for the full cache)."""
        return self._max_system_keep(self.policy)

    @staticmethod
    def _max_system_keep(policy: Policy) -> Optional[int]:
        return policy.budget // 2 if policy.bounded and policy.budget else None

    def _set_keep(self, seq_id: int, n_keep: int) -> None:
        policy = self.policy_of(seq_id)
        if not policy.bounded:
            return
        limit = self._max_system_keep(policy)
        if self.keep == "system" and limit is not None and n_keep > limit:
            _log.warning("the system prompt has %d tokens; keep='system' protects its first %d (half the budget of "
                         "%d), the policy ranks the rest", n_keep, limit, policy.budget)
            n_keep = limit
        try:
            self._engine.set_keep(seq_id, int(n_keep))
        except ValueError:
            raise ValueError(f"the protected prefix ({n_keep} tokens, keep={self.keep!r}) does not fit in the budget "
                             f"({policy.budget} tokens) with room for the newest token: raise the budget, shorten the "
                             f"system prompt, or use keep=None") from None

    def _check_context(self, seq_id: int = 0) -> None:
        """Warn once when positions pass the trained context (without position rolling: the output degrades)."""
        if self._warned_past_context:
            return
        if self._engine.next_pos(seq_id) > self.info.n_ctx_train:
            self._warned_past_context = True
            warnings.warn(f"positions passed the model's trained context ({self.info.n_ctx_train} tokens) without "
                          "position rolling (off, a per-head policy, or a cache that cannot shift its positions): the "
                          "output degrades from here", RuntimeWarning, stacklevel=3)

    def _check_seq(self, seq_id: int) -> int:
        check_int("seq_id", seq_id)
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} out of range [0, {self.n_seq_max})")
        return int(seq_id)

    # ------------------------------------------------------------------ generation
    def prompt_tokens(self, prompt: Prompt, add_bos: Optional[bool] = None) -> List[int]:
        """The tokens a prompt (str, bytes or token ids) feeds; `add_bos` None: as the model's metadata says. A text
        prompt's special tokens (`<|im_start|>`) are parsed, as llama-cpp-python's create_completion and
        llama-server parse them; token ids from `tokenize(text, special=False)` feed such text literally."""
        if isinstance(prompt, (str, bytes)):
            return self.tokenize(prompt, add_bos=self.info.add_bos if add_bos is None else add_bos, special=True)
        return self.check_token_ids(prompt, "prompt token id")

    def check_token_ids(self, tokens: Sequence[int], what: str = "token id") -> List[int]:
        """`tokens` as a list of ints, each one of this model's tokens: TypeError for one that is not an int,
        ValueError naming the first outside [0, n_vocab) ("{what} N is outside this model's ... tokens")."""
        out, n_vocab = _token_list(tokens), self.n_vocab()
        outside = next((t for t in out if t >= n_vocab), None)
        if outside is not None:
            raise ValueError(f"{what} {outside} is outside this model's {n_vocab} tokens")
        return out

    def _answer_limit(self, params: SamplingParams) -> Optional[int]:
        """Tokens a generation may make: `max_tokens`, or with none a bounded cache's trained context (it never fills
        up, so a model that never ends would otherwise generate for good); the full cache stops at its end."""
        if params.max_tokens is not None or not self.policy.bounded:
            return params.max_tokens
        return self.info.n_ctx_train

    def check_sampling(self, params: SamplingParams) -> None:
        """Raise ValueError when `params` cannot sample on this model (a token id outside the vocabulary, a grammar
        that does not parse), before anything runs; nothing changes."""
        self.sampler(params, seed=0)

    def sampler(self, params: SamplingParams, *, seed: Optional[int] = None, history: Sequence[int] = (),
                grammar_of: Any = None):
        """The sampler a generation with `params` draws with (`seed` None: params.seed, else the next one of this
        Llama's generator; `history`: the prompt, for the penalties). Raises ValueError as `check_sampling`. Safe
        from any thread (it reads the vocabulary only): a server builds a grammar's sampler (its parse and its
        check of the vocabulary) beside the decoding thread, with the GIL released. `grammar_of`: a sampler this
        Llama made for the same grammar, whose checked grammar is copied (no parse, no check: n samples of one
        grammar are checked once)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {params!r}")
        return self._sampler(params, seed=seed, history=history, grammar_of=grammar_of)

    def probe_cells(self, policy: Union[str, Policy, None] = None) -> int:
        """KV cells a policy's probe takes beside its budget while it ranks (0 without a probe; default: this
        `Llama`'s policy)."""
        value = self.policy if policy is None else resolve(policy) if isinstance(policy, str) else policy
        if not isinstance(value, Policy):
            raise TypeError(f"policy must be a Policy or a name, got {policy!r}")
        return int(self._engine.probe_cells(value.cpp))

    def _sampler(self, params: SamplingParams, seed: Optional[int] = None, history: Sequence[int] = (),
                 grammar_of: Any = None):
        if seed is None:
            seed = self._rng.getrandbits(32) if params.seed is None else params.seed
        try:
            return params.sampler(self.n_vocab(), seed, self.eog_tokens() if params.ignore_eos else (), history,
                                  engine=self._engine, grammar_of=grammar_of)
        except ValueError as e:
            if "token id" not in str(e):
                raise
            raise ValueError(f"{e} (this model has {self.n_vocab()} tokens)") from None

    def _generate_one(self, prompt_tokens: List[int], params: SamplingParams, *, reset: bool,
                      want_logits: bool = False, prompt_logits: bool = False,
                      n_keep: Optional[int] = None,
                      progress: Optional[Callable[[int, int], None]] = None) -> Iterator[generation.Event]:
        """One sequence (seq 0): feed the prompt, then the generation loop as a batch of one. `n_keep`: the
        protected prefix of a new session (None: the Llama's `keep`)."""
        if not prompt_tokens and reset:
            raise ValueError("the prompt is empty: pass at least one token (or reset=False to continue)")
        sampler = self._sampler(params, history=prompt_tokens)
        run = generation.SeqRun(0, 0, sampler, TextAssembler(params.stop), self._answer_limit(params),
                                shown_special=params.preserved_tokens)
        with self.lock:
            # the token the last generation showed but did not feed goes first when the session goes on
            feed = prompt_tokens if reset else self._pending + prompt_tokens
            owner = self._take_over([0])
            if reset:
                self._engine.reset()
                if n_keep is not None:
                    self._set_keep(0, n_keep)
            if feed:
                self._engine.eval({0: feed}, prompt_logits, _feed_progress(progress, len(feed), self.n_batch))
            self._check_context()
            self.last_eog_token = None
        events = generation.run(self._engine, [run], unbounded=not self.policy.bounded, want_logits=want_logits)
        try:
            yield from self._owned_steps(events, owner)
        finally:
            events.close()
            with self.lock:
                if self._generation is owner:
                    self._pending = [run.pending] if run.pending is not None else []
        self.last_eog_token = run.eog_token  # sampled, not fed: a session that goes on feeds it first

    def _owned_steps(self, events: Iterator[Any], owner: object) -> Iterator[Any]:
        """Advance a generation one step at a time under the lock, as long as it still owns the context."""
        while True:
            with self.lock:
                if self._generation is not owner:
                    raise RuntimeError("this generation was interrupted by another call on the same Llama (a new "
                                       "generation, eval, reset, load_state, close, ...): it cannot go on")
                try:
                    e = next(events)
                except StopIteration:
                    return
                self._check_context()
            yield e

    def generate(self, prompt: Prompt, *, stream: bool = False, reset: bool = True, add_bos: Optional[bool] = None,
                 sampling: Optional[SamplingParams] = None, **params: Any) -> Union[str, Iterator[str]]:
        """Generate text after `prompt` (str, bytes or token ids).

        Sampling keywords (`max_tokens=128`, `temperature=0.8` (<= 0: greedy), `top_p`, `top_k`, `min_p`, `stop`,
        `seed`, `ignore_eos`, `repeat_penalty`, `frequency_penalty`, `presence_penalty`, `penalty_last_n`,
        `logit_bias`; see `SamplingParams`) apply on top of `sampling` or these defaults. Returns the text,
        or with `stream=True` an iterator of text pieces. `reset=False` continues the session: the prompt is
        appended to what the cache already holds (an empty prompt continues from the last token fed).
        """
        p = sampling_.merge(sampling_.GENERATE, sampling, params)
        events = self._generate_one(self.prompt_tokens(prompt, add_bos), p, reset=reset)
        if stream:
            return (e.text for e in events if e.text)
        with self.lock:  # a whole call: another thread's calls wait instead of interrupting it
            return "".join(e.text for e in events)

    def generate_events(self, prompt: Prompt, *, reset: bool = True, add_bos: Optional[bool] = None,
                        keep: Optional[int] = None, sampling: Optional[SamplingParams] = None,
                        progress: Optional[Callable[[int, int], None]] = None, logits: bool = False,
                        prompt_logits: bool = False, **params: Any) -> Iterator[generation.Event]:
        """Like `generate(..., stream=True)`, one `generation.Event` per generated token (`token`, `text`) and a
        last one with the `finish_reason` ("stop" or "length"); `last_eog_token` then holds the end-of-generation
        token sampled, if any (not fed: a session that goes on should feed it first). `keep`: with `reset`, the
        protected prefix of the new session in tokens (default: the Llama's `keep`). `progress(fed, total)`: called
        between the pieces of a long prompt with the tokens fed so far (whole batches; it may raise to stop).
        `logits`: each token's event carries the logits it was sampled from; `prompt_logits`: the prompt's own are
        kept for `prompt_logits()`."""
        p = sampling_.merge(sampling_.GENERATE, sampling, params)
        if keep is not None:
            check_int("keep", keep, minimum=0)
        return self._generate_one(self.prompt_tokens(prompt, add_bos), p, reset=reset, n_keep=keep, progress=progress,
                                  want_logits=bool(logits), prompt_logits=bool(prompt_logits))

    def prompt_logits(self, seq_id: int = 0) -> np.ndarray:
        """float32 [n, n_vocab]: the logits after each token of the last prompt fed to `seq_id` with `logits_all`
        (`eval`) or `prompt_logits` (`generate_events`); empty otherwise."""
        return self._engine.logits_all(self._check_seq(seq_id))
    def generate_batch(self, prompts: Sequence[Prompt], *, stream: bool = False, add_bos: Optional[bool] = None,
                       sampling: Optional[SamplingParams] = None,
                       **params: Any) -> Union[List[str], Iterator[Tuple[int, Optional[str]]]]:
        """Generate for several prompts decoded together: one llama_decode per step for all live sequences.

        Each sequence has its own KV budget, scores and sampler (seeded `seed + i`, so sequence i samples what
        `generate(prompts[i], seed=seed + i)` would, up to batching round-off); finished sequences leave the
        batch. At most `n_seq_max` prompts run at once; more are processed in waves. Returns the texts, or with
        `stream=True` an iterator of (index, text piece) pairs, and (index, None) when sequence `index` ends;
        `finish_reasons` then holds each prompt's. Sampling keywords as in `generate`.
        """
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of prompts (str, bytes or token lists), not one string")
        p = sampling_.merge(sampling_.GENERATE, sampling, params)
        token_lists = [self.prompt_tokens(q, add_bos) for q in prompts]
        if any(not t for t in token_lists):
            raise ValueError("a prompt is empty: pass at least one token per prompt")
        base_seed = self._rng.getrandbits(32) if p.seed is None else int(p.seed)
        it = self._batch_events(token_lists, p, base_seed)
        if stream:
            return it
        texts = [""] * len(prompts)
        with self.lock:
            for i, piece in it:
                if piece:
                    texts[i] += piece
        return texts

    def _batch_events(self, token_lists: List[List[int]], p: SamplingParams, base_seed: int) -> Iterator[Tuple[int, Optional[str]]]:
        self.finish_reasons = [None] * len(token_lists)
        for wave in range(0, len(token_lists), self.n_seq_max):
            idx = list(range(wave, min(wave + self.n_seq_max, len(token_lists))))
            runs = [generation.SeqRun(i, s, self._sampler(p, seed=base_seed + i, history=token_lists[i]),
                                      TextAssembler(p.stop), self._answer_limit(p),
                                      shown_special=p.preserved_tokens)
                    for s, i in enumerate(idx)]
            with self.lock:
                owner = self._take_over()
                self._engine.reset()
                self._engine.eval({s: token_lists[i] for s, i in enumerate(idx)}, False)
            events = generation.run(self._engine, runs, unbounded=not self.policy.bounded, free_finished=True)
            for e in self._owned_steps(events, owner):
                if e.text:
                    yield e.index, e.text
                if e.token is None:
                    self.finish_reasons[e.index] = e.finish_reason
                    yield e.index, None


    # ------------------------------------------------------------------ OpenAI-shaped calls (completions.py)
    @functools.cached_property
    def completions(self) -> Completions:
        """The OpenAI-shaped calls on this `Llama` (create_completion, create_chat_completion)."""
        return Completions(self)

    create_completion = _handed_to_completions("create_completion")
    create_chat_completion = _handed_to_completions("create_chat_completion")
    create_chat_completion_openai_v1 = _handed_to_completions("create_chat_completion_openai_v1")
    __call__ = create_completion

    @property
    def chat_template(self) -> ChatTemplate:
        """The chat template in use: `chat_template=` as given, else the GGUF's (see `h2o_local.chat_template`)."""
        if self._chat_template is None:
            special = lambda t: self._engine.token_to_piece(t, True).decode("utf-8", errors="replace") if t >= 0 else ""
            self._chat_template = ChatTemplate(
                self._chat_template_source or self.info.chat_template, bos_token=special(self.info.token_bos),
                eos_token=special(self.info.token_eos),
                builtin=lambda pairs, agp, source: self._engine.apply_chat_template(pairs, agp, source),
                given_by_user=self._chat_template_source is not None)
        return self._chat_template

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            time_limit_s: Optional[float] = None, tools: Optional[List[Dict[str, Any]]] = None,
                            chat_template_kwargs: Optional[Dict[str, Any]] = None) -> str:
        """The prompt text the chat template makes of OpenAI-style `messages` ([{"role": ..., "content": ...}];
        content may be a string, a list of text parts or None). `time_limit_s`: a template whose loops run longer
        raises ValueError. `tools`: OpenAI tool definitions, for templates that describe them.
        `chat_template_kwargs`: more variables the template reads (`{"enable_thinking": False}` for Qwen3)."""
        return self.chat_template.render(messages, add_generation_prompt, time_limit_s, tools, chat_template_kwargs)

    def chat_tokens(self, messages: Sequence[Message], time_limit_s: Optional[float] = None,
                    tools: Optional[List[Dict[str, Any]]] = None, *, special_in_content: bool = False,
                    chat_template_kwargs: Optional[Dict[str, Any]] = None,
                    continue_final: bool = False) -> Tuple[List[int], Optional[int]]:
        """The prompt tokens of a chat, and its protected prefix with `keep="system"` (the tokens of the leading
        system messages, or without one of the system turn the template writes by default, as SmolLM2's and
        Qwen2.5's do; None with another `keep`, which then applies as set).

        The template's markup is tokenized with its special tokens, each message's content as text: a message that
        holds `<|im_end|>` cannot close its turn and open a system one (OpenAI's behaviour). A content that holds
        such text and that the template does not write out as it is raises ValueError. `special_in_content=True`
        parses the contents' special tokens too (llama-server's and Ollama's behaviour), for a client that writes
        turns into messages on purpose. Every other string a template writes (tool names, descriptions and schemas,
        a call's name and arguments, a message's `name`, the template's variables) cannot be told from its markup
        once written, so one that spells a special token raises ValueError unless `special_in_content=True`.
        `continue_final`: a final assistant message is continued (an assistant prefill: JSON started, "go on"), not
        closed with a new turn opened after it (transformers' `continue_final_message`, llama-server's and
        Anthropic's prefill); ValueError where the template does not write it as given."""
        msgs = normalize_messages(messages)
        contents = None if special_in_content else [m["content"] for m in msgs]
        if not special_in_content:
            self._check_markup_strings(msgs, tools, chat_template_kwargs)
        continues_final = continue_final and msgs and msgs[-1]["role"] == "assistant"
        text = self.apply_chat_template(msgs, add_generation_prompt=not continues_final, time_limit_s=time_limit_s,
                                        tools=tools, chat_template_kwargs=chat_template_kwargs)
        if continues_final:
            final = msgs[-1]["content"]
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ValueError("the final assistant message cannot be continued: the chat template does not write "
                                 "it as given (or it is empty)")
            text = text[:at + len(final)]
        tokens = self._template_tokens(text, contents)
        if self.keep != "system":
            return tokens, None
        n_system = 0
        while n_system < len(msgs) and msgs[n_system]["role"] in ("system", "developer"):
            n_system += 1
        if n_system == 0:  # the template's own system turn, if it writes one, is the conversation's
            default = self.chat_template.default_system
            if not default:
                return tokens, 0
            prefix = self._template_tokens(default)
        else:
            prefix = self._template_tokens(self._system_text(msgs[:n_system], time_limit_s, tools, chat_template_kwargs),
                                           None if contents is None else contents[:n_system])
        n = 0
        while n < min(len(prefix), len(tokens)) and prefix[n] == tokens[n]:
            n += 1
        return tokens, n

    def _system_text(self, system: List[Message], time_limit_s: Optional[float], tools: Optional[List[Dict[str, Any]]],
                     variables: Optional[Dict[str, Any]]) -> str:
        """The text the template writes for a conversation's leading system messages: rendered alone, or where the
        template refuses that (Llama 3.x puts tools in the first user message and raises without one) the text
        before a placeholder user message's content."""
        try:
            return self.apply_chat_template(system, add_generation_prompt=False, time_limit_s=time_limit_s,
                                            tools=tools, chat_template_kwargs=variables)
        except ValueError:
            placeholder = "\ue000"  # private-use text no template writes itself
            text = self.apply_chat_template(system + [{"role": "user", "content": placeholder}],
                                            add_generation_prompt=False, time_limit_s=time_limit_s, tools=tools,
                                            chat_template_kwargs=variables)
            return text[:text.find(placeholder)] if placeholder in text else ""

    def _check_markup_strings(self, messages: Sequence[Message], tools: Optional[List[Dict[str, Any]]],
                              variables: Optional[Dict[str, Any]]) -> None:
        """ValueError naming the first string of `messages` (besides contents), `tools` or `variables` that spells a
        special token (`markup_strings`): written by the template, it would become a control token."""
        found = list(markup_strings(messages, tools, variables))
        if not found or not self._holds_special_text("\x00".join(text for _, text in found)):
            return  # the common case: one look at all of them together
        for where, text in found:
            if self._holds_special_text(text):
                raise ValueError(f"{where} holds the text of a special token; the chat template writes it as its "
                                 f"own markup, where it would become a control token (a forged turn): remove it, or "
                                 f"ask for special tokens in content (special_in_content)")

    def _template_tokens(self, text: str, contents: Optional[List[str]] = None) -> List[int]:
        """The tokens of a rendered chat: special tokens parsed, but inside the spans of `contents` that hold
        special-token text (None: parsed everywhere)."""
        # a template that writes the BOS itself (llama 3, say) must not get a second one from the tokenizer
        bos = self.chat_template.bos_token
        add_bos = self.info.add_bos and not (bos and text.startswith(bos))
        plain = [c for c in contents or () if self._holds_special_text(c)]
        if not plain:  # the common case: one tokenization, as llama-server's
            return self.tokenize(text, add_bos=add_bos, special=True)
        tokens: List[int] = []
        for piece, special in content_pieces(text, contents, plain):
            tokens += self.tokenize(piece, add_bos=add_bos and not tokens, special=special)
        return tokens

    def preserved_tokens(self, texts: Iterable[str]) -> Tuple[int, ...]:
        """The tokens among `texts` that are one special token each whose text an answer would not show (control
        tokens): what a chat keeps in its answer to read its tool calls and reasoning (`SamplingParams.
        preserved_tokens`, llama-server's)."""
        out = []
        for text in texts:
            ids = self.tokenize(text, add_bos=False, special=True)
            if len(ids) == 1 and not self._engine.token_to_piece(ids[0], False) and \
                    self._engine.token_to_piece(ids[0], True).decode("utf-8", errors="replace") == text:
                out.append(ids[0])
        return tuple(out)

    def _holds_special_text(self, text: str) -> bool:
        """Whether `text` spells a special token (it tokenizes otherwise with special tokens parsed)."""
        return bool(text) and self.tokenize(text, add_bos=False, special=True) != \
            self.tokenize(text, add_bos=False, special=False)



_FLASH_ATTN = {"auto": -1, "off": 0, "on": 1, False: 0, True: 1}


def _flash_attn_setting(value: Any) -> int:
    """`flash_attn=` as EngineParams takes it: -1 auto, 0 off, 1 on."""
    if isinstance(value, (bool, np.bool_)):
        return _FLASH_ATTN[bool(value)]
    if isinstance(value, str) and value in _FLASH_ATTN:
        return _FLASH_ATTN[value]
    raise ValueError(f"flash_attn must be 'auto', 'on', 'off', True or False, got {value!r}")


def _feed_progress(progress: Optional[Callable[[int, int], None]], total: int,
                   n_batch: int) -> Optional[Callable[[], None]]:
    """The engine's between-pieces hook that reports `progress(fed, total)` (pieces are at most one batch)."""
    if progress is None:
        return None
    pieces = [0]

    def between() -> None:
        pieces[0] += 1
        progress(min(total, pieces[0] * n_batch), total)

    return between


def _weakly(method: Callable[[], Any]) -> Callable[[], Any]:
    """A Llama's method, as a part of it holds it: without a reference back (a cycle would keep a dropped Llama, its
    model and its RPC connections until the garbage collector ran)."""
    ref = weakref.WeakMethod(method)

    def call() -> Any:
        bound = ref()
        if bound is None:
            raise RuntimeError("this Llama was closed: make a new one")
        return bound()
    return call


class _Closed:
    """The engine of a closed Llama: any use says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("this Llama was closed: make a new one")


def _token_list(tokens: Sequence[int]) -> List[int]:
    if isinstance(tokens, (str, bytes)):
        raise TypeError("expected token ids (a list of ints), got text: tokenize it first")
    if not hasattr(tokens, "__iter__"):
        raise TypeError(f"expected a prompt (str, bytes or a list of token ids), got {type(tokens).__name__}")
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"token ids must be ints, got {t!r}")
        if not 0 <= t < 2**31:
            raise ValueError(f"token id {t} is out of range")
        out.append(int(t))
    return out
