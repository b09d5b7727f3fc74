"""
h2o_local engine: a patched llama.cpp context with per-sequence KV eviction
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
__all__: list[str] = ['DEFAULT_QUESTION_TOKENS', 'ENGINE_SETTINGS', 'Embedder', 'Engine', 'EngineParams', 'GrammarError', 'GrammarWorkExceeded', 'LLAMA_CPP_COMMIT', 'Model', 'POLICY_OPTIONS', 'PROBE_TEXTS', 'Policy', 'PolicyConfig', 'RPC_PROTO_VERSION', 'RankedPolicy', 'Sampler', 'SeqSnapshot', 'apply_label_suffix', 'backend_devices', 'bounded_cells', 'check_device_memory', 'check_host_memory', 'choose_kv_types', 'context_size', 'default_policy_config', 'flash_attn_type', 'kv_type_bytes', 'padded_cells', 'parse_policy_label', 'plain_run', 'plan_prefill', 'policy_names', 'q8_0_entry_bytes', 'reread_choice', 'rpc_serve']
class GrammarError(ValueError):
    pass
class GrammarWorkExceeded(GrammarError):
    pass
class PolicyConfig:
    """
    A policy as asked for; < 0: not given.
    """
    name: str
    probe: str
    def __init__(self) -> None:
        ...
    @property
    def block(self) -> int:
        ...
    @block.setter
    def block(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def budget(self) -> int:
        ...
    @budget.setter
    def budget(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def follow(self) -> int:
        ...
    @follow.setter
    def follow(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def handoff(self) -> int:
        ...
    @handoff.setter
    def handoff(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def heavy(self) -> int:
        ...
    @heavy.setter
    def heavy(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def per_head(self) -> int:
        ...
    @per_head.setter
    def per_head(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def pool(self) -> int:
        ...
    @pool.setter
    def pool(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def probe_share(self) -> int:
        ...
    @probe_share.setter
    def probe_share(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def query_window(self) -> int:
        ...
    @query_window.setter
    def query_window(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def question(self) -> int:
        ...
    @question.setter
    def question(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def recall_pages(self) -> int:
        ...
    @recall_pages.setter
    def recall_pages(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def recent(self) -> int:
        ...
    @recent.setter
    def recent(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def reply(self) -> int:
        ...
    @reply.setter
    def reply(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def reread(self) -> int:
        ...
    @reread.setter
    def reread(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def sinks(self) -> int:
        ...
    @sinks.setter
    def sinks(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class Policy:
    """
    A resolved eviction policy (see h2o_local.policies).
    """
    @typing.overload
    def __init__(self, config: PolicyConfig) -> None:
        ...
    @typing.overload
    def __init__(self, name: str, budget: typing.SupportsInt | typing.SupportsIndex = -1, **kwargs) -> None:
        """
        A policy from its name, budget and the fields of PolicyConfig by keyword (None or < 0: not given).
        """
    def option(self, name: str) -> int:
        """
        An option's value (policy_options()), resolved: its unset value when not given.
        """
    def select(self, positions: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], total: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex], head: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], queries: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], probe: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] = [], incoming: typing.SupportsInt | typing.SupportsIndex = 0, reply: collections.abc.Sequence[bool] = []) -> list[int]:
        """
        The indices the policy keeps of n entries with these scores (its rule alone, on synthetic scores); incoming: as recall ranks before a prompt of that many tokens (the handoff option); reply: the last exchange's entries (the reply option).
        """
    @property
    def bounded(self) -> bool:
        ...
    @property
    def budget(self) -> int:
        ...
    @property
    def heavy(self) -> int:
        ...
    @property
    def label(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def needs_keys(self) -> bool:
        ...
    @property
    def needs_scores(self) -> bool:
        ...
    @property
    def per_head(self) -> bool:
        ...
    @property
    def probe(self) -> str:
        ...
    @property
    def query_window(self) -> int:
        ...
    @property
    def question(self) -> int:
        ...
    @property
    def recent(self) -> int:
        ...
    @property
    def sinks(self) -> int:
        ...
class RankedPolicy(Policy):
    """
    Subclass it and define rank(total, head, queries) to score entries in Python.
    """
    def __init__(self, name: str, budget: typing.SupportsInt | typing.SupportsIndex, heavy: typing.SupportsInt | typing.SupportsIndex = -1, recent: typing.SupportsInt | typing.SupportsIndex = -1, sinks: typing.SupportsInt | typing.SupportsIndex = -1) -> None:
        ...
class Model:
    """
    The model's metadata and vocabulary, without its weights.
    """
    def __init__(self, model_path: str) -> None:
        ...
    def apply_chat_template(self, messages: collections.abc.Sequence[tuple[str, str]], add_assistant: bool = True, template: str = '') -> str:
        ...
    def detokenize(self, tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], special: bool = False) -> bytes:
        ...
    def facts(self) -> dict:
        ...
    def is_eog(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def metadata(self) -> dict:
        ...
    def token_to_piece(self, token: typing.SupportsInt | typing.SupportsIndex, special: bool = False) -> bytes:
        ...
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        ...
class EngineParams:
    host_q8_0: bool
    policy: Policy
    scores_sum_rows: bool
    type_k: str
    type_v: str
    def __init__(self) -> None:
        ...
    @property
    def compact_cells(self) -> bool:
        """
        after a prompt evicted, move the kept cells to the bottom
        """
    @compact_cells.setter
    def compact_cells(self, arg0: bool) -> None:
        ...
    @property
    def export_scores(self) -> bool:
        """
        export scores even when the policy does not use them
        """
    @export_scores.setter
    def export_scores(self, arg0: bool) -> None:
        ...
    @property
    def flash_attn(self) -> int:
        """
        -1: auto (on where the layers run on a GPU), 0: off, 1: on
        """
    @flash_attn.setter
    def flash_attn(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def host_entries(self) -> int:
        ...
    @host_entries.setter
    def host_entries(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def kv_f32(self) -> bool:
        """
        F32 instead of F16 K/V cells (exact K shifts, twice the bytes)
        """
    @kv_f32.setter
    def kv_f32(self, arg0: bool) -> None:
        ...
    @property
    def kv_unified(self) -> bool:
        """
        one cell space for all sequences (else a stream each)
        """
    @kv_unified.setter
    def kv_unified(self, arg0: bool) -> None:
        ...
    @property
    def n_batch(self) -> int:
        """
        tokens per decode; the cache holds budget + n-batch cells
        """
    @n_batch.setter
    def n_batch(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def n_ctx(self) -> int:
        """
        the full cache's context, with --budget 0 (0: the model's trained context); a bounded cache needs none: it holds --budget entries and a conversation runs past any length
        """
    @n_ctx.setter
    def n_ctx(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def n_gpu_layers(self) -> int:
        """
        layers offloaded to the GPU or RPC servers (-1: all; 0: none; a CPU build runs all on the CPU)
        """
    @n_gpu_layers.setter
    def n_gpu_layers(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def n_keep(self) -> int:
        ...
    @n_keep.setter
    def n_keep(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def n_seq_max(self) -> int:
        """
        sequences in one context, each with its own budget and scores
        """
    @n_seq_max.setter
    def n_seq_max(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def n_threads(self) -> int:
        ...
    @n_threads.setter
    def n_threads(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def n_threads_batch(self) -> int:
        """
        CPU threads for prompts (batches of more than one token; llama.cpp's --threads-batch); 0: as the threads for generation
        """
    @n_threads_batch.setter
    def n_threads_batch(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def n_ubatch(self) -> int:
        """
        tokens per ubatch, llama.cpp's physical batch (its compute buffers); a prompt is evicted after each whole batch (0: the batch size)
        """
    @n_ubatch.setter
    def n_ubatch(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def op_offload(self) -> bool:
        """
        large batches' products of CPU-held weights run on the GPU (llama.cpp's)
        """
    @op_offload.setter
    def op_offload(self, arg0: bool) -> None:
        ...
    @property
    def position_rolling(self) -> bool:
        """
        renumber a bounded cache's kept positions so that a conversation runs past the trained context (on: only when needed; --no-position-rolling keeps them as fed)
        """
    @position_rolling.setter
    def position_rolling(self, arg0: bool) -> None:
        ...
    @property
    def probe_rides(self) -> bool:
        """
        a prompt's probe decoded with the chunk before the eviction it ranks for
        """
    @probe_rides.setter
    def probe_rides(self, arg0: bool) -> None:
        ...
    @property
    def roll_interval(self) -> int:
        """
        with rolling, renumber positions once they drifted this many tokens (0: only near the trained context)
        """
    @roll_interval.setter
    def roll_interval(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def rpc_servers(self) -> list[str]:
        ...
    @rpc_servers.setter
    def rpc_servers(self, arg0: collections.abc.Sequence[str]) -> None:
        ...
    @property
    def verbose(self) -> bool:
        """
        llama.cpp's log on stderr
        """
    @verbose.setter
    def verbose(self, arg0: bool) -> None:
        ...
class Engine:
    def __init__(self, model_path: str, params: EngineParams) -> None:
        ...
    def apply_chat_template(self, messages: collections.abc.Sequence[tuple[str, str]], add_assistant: bool = True, template: str = '') -> str:
        ...
    def check_recall(self, policy: Policy) -> None:
        """
        Raise ValueError when this policy cannot recall on this engine.
        """
    def compress(self, seq_id: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def configure_seq(self, seq_id: typing.SupportsInt | typing.SupportsIndex, policy: Policy, recall_cap: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        One sequence's policy (None: the engine's) and recall cap (-1: the engine's), checked together.
        """
    def detokenize(self, tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], special: bool = False) -> bytes:
        ...
    def eval(self, tokens: collections.abc.Mapping[typing.SupportsInt | typing.SupportsIndex, collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]], logits_all: bool = False, between_chunks: typing.Any = None) -> None:
        """
        Feed {seq_id: [token, ...]} in one batch, evicting as the policy says. between_chunks() is called between the chunks of a long feed and may return {seq_id: [token]} of other sequences (each with a stream of its own) to decode with the next chunk; it may also eval such sequences, or raise.
        """
    def facts(self) -> dict:
        ...
    def has_seq_policy(self, seq_id: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def host_kv(self, seq_id: typing.SupportsInt | typing.SupportsIndex) -> tuple[list[int], bytes]:
        """
        What seq spilled: (positions, K and V bytes, entry_size each, in that order).
        """
    def is_eog(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def keys(self, seq_id: typing.SupportsInt | typing.SupportsIndex, layer: typing.SupportsInt | typing.SupportsIndex) -> tuple[numpy.typing.NDArray[numpy.int32], numpy.typing.NDArray[numpy.float32]]:
        """
        The cached keys of seq_id's kept entries in a layer, F32 after RoPE: (positions, [n, n_embd_k_gqa]).
        """
    def kv_entries(self, seq_id: typing.SupportsInt | typing.SupportsIndex, positions: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> bytes:
        """
        K and V bytes of the cells at these positions (entry_size each).
        """
    def last_logits(self, seq_id: typing.SupportsInt | typing.SupportsIndex = 0) -> numpy.typing.NDArray[numpy.float32]:
        ...
    def last_scores(self, seq_id: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[numpy.typing.NDArray[numpy.int32], numpy.typing.NDArray[numpy.float32]]:
        """
        The raw scores the patch exported for seq_id in the last llama_decode: (positions, [n, n_head]).
        """
    def logits_all(self, seq_id: typing.SupportsInt | typing.SupportsIndex = 0) -> numpy.typing.NDArray[numpy.float32]:
        ...
    def metadata(self) -> dict:
        ...
    def next_pos(self, seq_id: typing.SupportsInt | typing.SupportsIndex = 0) -> int:
        ...
    def probe_cells(self, policy: Policy) -> int:
        """
        KV cells the policy's probe needs beside a sequence's entries.
        """
    def recall_for(self, seq_id: typing.SupportsInt | typing.SupportsIndex, question: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
        ...
    def reset(self) -> None:
        ...
    def reset_seq(self, seq_id: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def restore(self, seq_id: typing.SupportsInt | typing.SupportsIndex, snapshot: SeqSnapshot) -> None:
        ...
    def room(self, seq_id: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        KV cells still free for seq_id: its stream's, or the whole unified cache's (shared by all sequences).
        """
    def sample(self, seq_id: typing.SupportsInt | typing.SupportsIndex, sampler: Sampler) -> int:
        """
        The next token of seq_id, drawn from its last logits in place.
        """
    def seq_pos_range(self, seq_id: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[int, int]:
        """
        llama.cpp's own (min, max) position of seq_id; (-1, -1) when empty
        """
    def set_keep(self, seq_id: typing.SupportsInt | typing.SupportsIndex, n_keep: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def set_policy(self, policy: Policy) -> None:
        ...
    def set_recall(self, cap: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def set_seq_policy(self, seq_id: typing.SupportsInt | typing.SupportsIndex, policy: Policy) -> None:
        """
        A policy for one sequence until it is reset (None: the engine's again).
        """
    def set_seq_recall(self, seq_id: typing.SupportsInt | typing.SupportsIndex, cap: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def snapshot(self, seq_id: typing.SupportsInt | typing.SupportsIndex = 0) -> SeqSnapshot:
        ...
    def state(self, seq_id: typing.SupportsInt | typing.SupportsIndex = 0) -> dict:
        ...
    def take_logits_all(self, seq_id: typing.SupportsInt | typing.SupportsIndex = 0) -> numpy.typing.NDArray[numpy.float32]:
        """
        logits_all's rows moved out, without a copy: the engine keeps none of them
        """
    def token_to_piece(self, token: typing.SupportsInt | typing.SupportsIndex, special: bool = False) -> bytes:
        ...
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        ...
    def truncate(self, seq_id: typing.SupportsInt | typing.SupportsIndex, n_tokens: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def capacity(self) -> int:
        ...
    @property
    def cells_used(self) -> int:
        ...
    @property
    def entry_size(self) -> int:
        ...
    @property
    def flash_attn(self) -> bool:
        """
        Whether the context runs flash attention.
        """
    @property
    def kv_bytes(self) -> int:
        ...
    @property
    def kv_unified(self) -> bool:
        ...
    @property
    def n_batch(self) -> int:
        ...
    @property
    def n_ctx(self) -> int:
        ...
    @property
    def n_decode(self) -> int:
        """
        llama_decode calls made so far
        """
    @property
    def n_graphs_reused(self) -> int:
        """
        ubatches that reused the previous compute graph (llama.cpp's graph reuse)
        """
    @property
    def n_threads(self) -> int:
        ...
    @property
    def n_threads_batch(self) -> int:
        ...
    @property
    def n_ubatch(self) -> int:
        ...
    @property
    def params(self) -> EngineParams:
        """
        The settings the engine was created with (its defaults filled in where they were left at theirs).
        """
    @property
    def position_rolling(self) -> bool:
        """
        Whether bounded sequences' positions are renumbered (off where this cache cannot shift them, with roll_interval 0).
        """
    @property
    def probe_rides(self) -> bool:
        """
        Whether a prompt's probe is decoded with the chunk before its eviction.
        """
    @property
    def scores_sum_rows(self) -> bool:
        ...
    @property
    def stream_capacity(self) -> int:
        ...
class Sampler:
    def __init__(self, n_vocab: typing.SupportsInt | typing.SupportsIndex, *, temperature: typing.SupportsFloat | typing.SupportsIndex, top_p: typing.SupportsFloat | typing.SupportsIndex, top_k: typing.SupportsInt | typing.SupportsIndex, min_p: typing.SupportsFloat | typing.SupportsIndex, seed: typing.SupportsInt | typing.SupportsIndex, banned: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], logit_bias: collections.abc.Mapping[typing.SupportsInt | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex] = {}, penalty_last_n: typing.SupportsInt | typing.SupportsIndex = 64, repeat_penalty: typing.SupportsFloat | typing.SupportsIndex = 1.0, frequency_penalty: typing.SupportsFloat | typing.SupportsIndex = 0.0, presence_penalty: typing.SupportsFloat | typing.SupportsIndex = 0.0, history: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], grammar: str = '', grammar_max_work: typing.SupportsInt | typing.SupportsIndex = 0, engine: Engine = None, typical_p: typing.SupportsFloat | typing.SupportsIndex = 1.0, mirostat: typing.SupportsInt | typing.SupportsIndex = 0, mirostat_tau: typing.SupportsFloat | typing.SupportsIndex = 5.0, mirostat_eta: typing.SupportsFloat | typing.SupportsIndex = 0.10000000149011612, grammar_of: Sampler = None) -> None:
        """
        grammar_of: a sampler whose grammar (parsed and checked) this one copies instead of parsing `grammar`; give the same engine
        """
    def sample(self, logits: typing.Annotated[numpy.typing.ArrayLike, numpy.float32]) -> int:
        """
        The next token drawn from a row of logits given from Python.
        """
    @property
    def has_grammar(self) -> bool:
        """
        Whether a grammar constrains it (its draws can take long: a server draws them aside).
        """
class SeqSnapshot:
    @staticmethod
    def from_bytes(data: bytes) -> SeqSnapshot:
        ...
    def __getstate__(self) -> bytes:
        ...
    def __setstate__(self, arg0: bytes) -> None:
        ...
    def to_bytes(self) -> bytes:
        ...
    @property
    def n_cells(self) -> int:
        ...
    @property
    def n_host(self) -> int:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def origin(self) -> str:
        ...
    @property
    def pending(self) -> list[int]:
        ...
    @pending.setter
    def pending(self, arg0: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
        ...
class Embedder:
    """
    Embeddings in a context of their own, on the engine's model (embedder.h).
    """
    def __init__(self, engine: Engine, n_ctx: typing.SupportsInt | typing.SupportsIndex, n_threads: typing.SupportsInt | typing.SupportsIndex = 0, pooling: typing.SupportsInt | typing.SupportsIndex = -1) -> None:
        ...
    def embed(self, tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> list[list[float]]:
        """
        The input's rows: one if pooled, one per token with pooling none.
        """
    @property
    def n_ctx(self) -> int:
        ...
    @property
    def n_embd(self) -> int:
        ...
    @property
    def pooling(self) -> int:
        ...
def apply_label_suffix(config: PolicyConfig, suffix: str) -> bool:
    """
    Set what one label suffix ("s4", "q32", "p9", "ph") says; False when it is no policy suffix.
    """
def backend_devices() -> list:
    """
    The ggml devices this build and machine offer: name, description, type (cpu, gpu, igpu, accel), memory in bytes.
    """
def bounded_cells(n_seq: typing.SupportsInt | typing.SupportsIndex, budget: typing.SupportsInt | typing.SupportsIndex, n_batch: typing.SupportsInt | typing.SupportsIndex, kv_unified: bool) -> int:
    """
    KV cells a bounded cache needs: budgets + one batch (unified), or a budget + one batch per stream.
    """
def check_device_memory(n_ctx: typing.SupportsInt | typing.SupportsIndex, device_kv_bytes_per_cell: typing.SupportsInt | typing.SupportsIndex, devices: str, have: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Raises ValueError when the KV cells on `devices` need more than their `have` bytes.
    """
def check_host_memory(n_ctx: typing.SupportsInt | typing.SupportsIndex, n_outputs_max: typing.SupportsInt | typing.SupportsIndex, kv_bytes_per_cell: typing.SupportsInt | typing.SupportsIndex, n_vocab: typing.SupportsInt | typing.SupportsIndex, kv_on_host: bool, have: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Raises ValueError when the context needs more than `have` bytes.
    """
def choose_kv_types(params: EngineParams, key_head: typing.SupportsInt | typing.SupportsIndex, offloaded_to: str = '', rotation_disabled: bool = False) -> tuple[str, str]:
    """
    The (K, V) cache types a context gets from params on a model with key heads of key_head values whose layers are on offloaded_to (empty: the CPU); raises ValueError for what llama.cpp cannot do with them.
    """
def context_size(params: EngineParams, policy: Policy, n_ctx_train: typing.SupportsInt | typing.SupportsIndex, n_probe: typing.SupportsInt | typing.SupportsIndex = 0, n_ride: typing.SupportsInt | typing.SupportsIndex = 0) -> dict:
    """
    The KV cells, batch and logits rows of a context for params under policy (n_probe: one probe's cells; n_ride: the probe's tokens that can ride with a chunk's decode).
    """
def default_policy_config(given: PolicyConfig) -> PolicyConfig:
    """
    The default policy's config with what was given (cpp/policy_config.h).
    """
def flash_attn_type(params: EngineParams, offloaded_to: str = '', software_device: bool = False) -> str:
    """
    What a context with params asks llama.cpp for ("enabled", "disabled" or "auto") when its layers are on offloaded_to (empty: the CPU; software_device: a device that runs on the CPU, as Mesa's lavapipe).
    """
def kv_type_bytes(name: str) -> float:
    """
    Bytes per element of a KV cache type (ggml name).
    """
def padded_cells(n_cells: typing.SupportsInt | typing.SupportsIndex, n_seq: typing.SupportsInt | typing.SupportsIndex, kv_unified: bool) -> int:
    """
    KV cells llama.cpp allocates for n_cells (rounded up per stream).
    """
def parse_policy_label(text: str) -> PolicyConfig:
    """
    The config a label names ("tova-256+s4+q32"); ValueError when it is no label.
    """
def plain_run(model: str, prompt: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], n_decode: typing.SupportsInt | typing.SupportsIndex, n_gpu_layers: typing.SupportsInt | typing.SupportsIndex = 0, flash_attn: bool = False, n_batch: typing.SupportsInt | typing.SupportsIndex = 512, n_threads: typing.SupportsInt | typing.SupportsIndex = 0, warmup_tokens: typing.SupportsInt | typing.SupportsIndex = 0) -> dict:
    """
    llama.cpp's own API on this build, nothing of h2o_local around it (plain_run.h): a warm-up of the prompt's first warmup_tokens (then cleared), the prompt, then greedy steps (their tokens and seconds). The benchmarks' baseline.
    """
def plan_prefill(sizes: collections.abc.Mapping[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex], cells: collections.abc.Mapping[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex], capacity: typing.SupportsInt | typing.SupportsIndex, kv_unified: bool, defer_eviction: bool, bounded: bool, budget: typing.SupportsInt | typing.SupportsIndex, n_batch: typing.SupportsInt | typing.SupportsIndex, query_window: typing.SupportsInt | typing.SupportsIndex) -> tuple[bool, list]:
    """
    How a feed is cut (cpp/prefill_plan.h): (fits, [({seq: (offset, n)}, window seqs, seqs evicting after), ...]).
    """
def policy_names() -> list[str]:
    """
    The registered eviction policies, sorted.
    """
def q8_0_entry_bytes(raw_bytes: typing.SupportsInt | typing.SupportsIndex) -> int:
    """
    Bytes of one F16 entry kept as q8_0 blocks.
    """
def reread_choice(tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], question: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], max_tokens: typing.SupportsInt | typing.SupportsIndex, window: typing.SupportsInt | typing.SupportsIndex = 64) -> list[int]:
    """
    The indices (ascending) of the dropped text `tokens` whose windows a question reads again (recall_text.h).
    """
def rpc_serve(endpoint: str, n_threads: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Serve this machine's CPU backend to ggml RPC clients at host:port (blocks; never returns on success).
    """
DEFAULT_QUESTION_TOKENS: int = 32
ENGINE_SETTINGS: list = [{'name': 'position_rolling', 'flags': ['--position-rolling'], 'minimum': None, 'maximum': None, 'unit': '', 'help': "renumber a bounded cache's kept positions so that a conversation runs past the trained context (on: only when needed; --no-position-rolling keeps them as fed)", 'default': True}, {'name': 'roll_interval', 'flags': ['--roll-interval'], 'minimum': 0, 'maximum': None, 'unit': 'tokens', 'help': 'with rolling, renumber positions once they drifted this many tokens (0: only near the trained context)', 'default': 0}, {'name': 'n_ctx', 'flags': ['-c', '--ctx-size'], 'minimum': 0, 'maximum': None, 'unit': 'tokens', 'help': "the full cache's context, with --budget 0 (0: the model's trained context); a bounded cache needs none: it holds --budget entries and a conversation runs past any length", 'default': 0}, {'name': 'n_batch', 'flags': ['-b', '--n-batch', '--batch-size'], 'minimum': 1, 'maximum': None, 'unit': 'tokens', 'help': 'tokens per decode; the cache holds budget + n-batch cells', 'default': 512}, {'name': 'n_ubatch', 'flags': ['-ub', '--ubatch-size'], 'minimum': 0, 'maximum': None, 'unit': 'tokens', 'help': "tokens per ubatch, llama.cpp's physical batch (its compute buffers); a prompt is evicted after each whole batch (0: the batch size)", 'default': 0}, {'name': 'n_threads_batch', 'flags': ['-tb', '--threads-batch'], 'minimum': 0, 'maximum': 512, 'unit': 'threads', 'help': "CPU threads for prompts (batches of more than one token; llama.cpp's --threads-batch); 0: as the threads for generation", 'default': 0}, {'name': 'n_seq_max', 'flags': list(), 'minimum': 1, 'maximum': None, 'unit': 'sequences', 'help': 'sequences in one context, each with its own budget and scores', 'default': 1}, {'name': 'kv_unified', 'flags': list(), 'minimum': None, 'maximum': None, 'unit': '', 'help': 'one cell space for all sequences (else a stream each)', 'default': True}, {'name': 'n_gpu_layers', 'flags': ['-ngl', '--n-gpu-layers', '--gpu-layers'], 'minimum': None, 'maximum': None, 'unit': 'layers', 'help': 'layers offloaded to the GPU or RPC servers (-1: all; 0: none; a CPU build runs all on the CPU)', 'default': -1}, {'name': 'kv_f32', 'flags': list(), 'minimum': None, 'maximum': None, 'unit': '', 'help': 'F32 instead of F16 K/V cells (exact K shifts, twice the bytes)', 'default': False}, {'name': 'op_offload', 'flags': list(), 'minimum': None, 'maximum': None, 'unit': '', 'help': "large batches' products of CPU-held weights run on the GPU (llama.cpp's)", 'default': True}, {'name': 'compact_cells', 'flags': list(), 'minimum': None, 'maximum': None, 'unit': '', 'help': 'after a prompt evicted, move the kept cells to the bottom', 'default': True}, {'name': 'export_scores', 'flags': list(), 'minimum': None, 'maximum': None, 'unit': '', 'help': 'export scores even when the policy does not use them', 'default': False}, {'name': 'verbose', 'flags': list(), 'minimum': None, 'maximum': None, 'unit': '', 'help': "llama.cpp's log on stderr", 'default': False}, {'name': 'probe_rides', 'flags': list(), 'minimum': None, 'maximum': None, 'unit': '', 'help': "a prompt's probe decoded with the chunk before the eviction it ranks for", 'default': True}]
LLAMA_CPP_COMMIT: str = '0c1e57098bba43ac29e6e3b677cdceebdd22334f'
POLICY_OPTIONS: list = [{'name': 'pool', 'suffix': 'p', 'unset': 1, 'minimum': 1, 'maximum': 2147483647, 'unit': 'entries', 'flag': False, 'help': "rank each entry by the best of the N entries centred on it, so that a fact's neighbours go with it"}, {'name': 'follow', 'suffix': 'f', 'unset': 0, 'minimum': 0, 'maximum': 2147483647, 'unit': 'entries', 'flag': False, 'help': 'and by the best of the N entries before it: what follows an entry a probe found (a value after its key) is kept with it'}, {'name': 'block', 'suffix': 'b', 'unset': 1, 'minimum': 1, 'maximum': 2147483647, 'unit': 'positions', 'flag': False, 'help': 'and by the best entry of its block of N positions, so that what is kept (and recalled) comes in whole blocks, as the pages of paged caches do'}, {'name': 'probe_share', 'suffix': 'm', 'unset': 100, 'minimum': 0, 'maximum': 100, 'unit': 'percent', 'flag': False, 'help': "with a probe: the percent of the heavy entries the probe's ranking chooses; the rest by the scorer's own rank (tova: what the newest query looks at)"}, {'name': 'per_head', 'suffix': 'ph', 'unset': 0, 'minimum': 0, 'maximum': 1, 'unit': '', 'flag': True, 'help': "H2O's published rule: every layer and KV head keeps its own entries by its own scores, inside the same budget of cells (attention scorers only, no probe, no position rolling)"}, {'name': 'reply', 'suffix': 'reply', 'unset': 0, 'minimum': 0, 'maximum': 1, 'unit': '', 'flag': True, 'help': "with a probe: the last exchange (the previous prompt's question, its last `question` tokens, and the answer generated after it) is kept before what a new prompt's probe ranks, until another answer follows, so that a conversation's next answer still reads the last one"}, {'name': 'handoff', 'suffix': 'handoff', 'unset': 0, 'minimum': 0, 'maximum': 1, 'unit': '', 'flag': True, 'help': "with recall: while a new prompt's question ranks what comes back, the recent window protects only what the prompt will not replace (recent - the prompt's tokens, at least 1): its place goes to what the question finds, as the prompt's own tokens are the recent window after it"}, {'name': 'recall_pages', 'suffix': 'd', 'unset': 8, 'minimum': 0, 'maximum': 2147483647, 'unit': 'pages', 'flag': False, 'help': "with recall: past N pages (a batch of entries each; at least the budget's worth) of host memory, a new prompt's question probes only the N pages whose entries its queries lift most against the stored keys, so that the step does not grow with the history; 0: every page"}, {'name': 'reread', 'suffix': 't', 'unset': 256, 'minimum': 0, 'maximum': 2147483647, 'unit': 'tokens', 'flag': False, 'help': "with recall: past its cap the host store keeps only the tokens of the oldest text; a new prompt's question reads again up to N tokens of it, the windows of 64 that hold the question's rarer tokens, so that recall can bring them back however long the chat; 0: what the cap drops is forgotten"}]
PROBE_TEXTS: dict = {'catalyst': '\n\nSummarize the previous context highlighting the most important parts.', 'repeat': '\n\nRepeat the previous context exactly.\n\n'}
RPC_PROTO_VERSION: tuple = (7, 0, 0)
