// The settings of an Engine, in a header of their own: the units that choose from them (kv_types, context_size) need
// them without the engine. FLASH_ATTN_* (kv_types.h) are flash_attn's values. The defaults here are the Python
// API's too: `Llama`'s keywords of the same name take theirs from EngineParams() (llama.py, _ENGINE_KEYWORDS).
#pragma once

#include "policy.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace h2o {

struct EngineParams {
    PolicyPtr policy;                // required: make_policy(...), resolved once
    // position rolling: a bounded sequence's kept positions renumbered 0..n-1 (llama.cpp's K shift), so that it runs
    // past the trained context. roll_interval 0: only when its next position, plus what one feed can add, would pass
    // the trained context (every position below it stays as it was fed), and only where the cache can shift its
    // positions (else off, as for a per-head policy); N >= 1: once the kept positions span N gaps or more, and an
    // error where the cache cannot
    bool     position_rolling = true;
    int32_t  roll_interval = 0;
    uint32_t n_ctx     = 0;          // KV cells; 0: budget + n_batch per sequence (bounded) or the trained context (full)
    uint32_t n_batch   = 512;        // tokens per llama_decode: a prompt is evicted between batches
    uint32_t n_ubatch  = 0;          // tokens per ubatch (llama.cpp's physical batch: its compute buffers); 0: n_batch
    uint32_t n_seq_max = 1;
    int32_t  n_keep    = 0;          // every sequence starts with its first n_keep tokens protected (see set_keep)
    bool     kv_unified = true;      // one cell space for all sequences; false: a stream of n_ctx / n_seq_max cells each
    int32_t  n_threads = 0;          // 0: llama.cpp's default
    int32_t  n_threads_batch = 0;    // threads for batches of more than one token (prompts); 0: as n_threads
    int32_t  n_gpu_layers = -1;      // layers on the GPU (llama.cpp's count: the output layer is one); -1: all of them
    bool     scores_sum_rows = false; // force the portable score paths on any backend: the sum_rows reduction
                                      // (Metal's) and, with flash attention, the separate KQ softmax pass (a GPU's)
    bool     export_scores = false;   // export scores even when the policy does not use them
    bool     kv_f32 = false;          // F32 instead of F16 K/V cells (exact K shifts, twice the bytes)
    std::string type_k;               // K cells' type by ggml name ("q8_0", "q4_0", ...); empty: as V (F16 or F32)
    std::string type_v;               // V cells' type; a quantized one needs flash attention (llama.cpp)
    // llama.cpp's flash attention (scores from the CPU kernel, or a KQ softmax pass on a GPU): FLASH_ATTN_AUTO (on
    // where the layers run on a GPU device, off on the CPU: flash_attn_type), FLASH_ATTN_OFF or FLASH_ATTN_ON
    int32_t  flash_attn = -1;
    bool     op_offload = true;       // llama.cpp's: large batches' products of CPU-held weights run on the GPU
    std::vector<std::string> rpc_servers; // "host:port" of ggml RPC servers that take the offloaded layers
    bool     compact_cells = true;    // after a prompt or compress() evicted, move the kept cells to the bottom
    // a prompt's question (or catalyst) probe decoded in the same llama_decode as the chunk before the eviction it
    // ranks for, its attention summed apart, rather than in a decode of its own after it: the same scores
    bool     probe_rides = true;
    // recall: each sequence keeps up to this many evicted entries in host memory (K and V of every layer) and, before
    // each new prompt, brings back those the prompt's question ranks above the kept ones (0: evicted entries are gone)
    int64_t  host_entries = 0;
    bool     host_q8_0 = false;       // recall keeps q8_0 blocks of the F16 rows (about half the bytes, not exact)
    bool     verbose = false;
    // asked between the chunks of a long prompt; it may throw to stop the feed there (Ctrl-C), leaving the
    // sequences with what was fed so far
    std::function<void()> check_interrupt;
};

// The engine's plain settings, one row each: the EngineParams field, the CLI's flags and help. The binding of the
// field, Llama's check of its keyword and the CLI's argument are made from the row (a new setting is one field above
// and one row in engine_params.cpp; tests/unit/test_engine_settings.py checks Llama's signature and README's table
// against the rows). The settings with a meaning of their own in Python (policy, threads, types, flash attention,
// RPC, recall) are not rows.
struct EngineSetting {
    const char *           name;    // the EngineParams field and Llama's keyword
    const char *           flags;   // the CLI's flags, space-separated, llama.cpp's first; "": not on the CLI
    std::optional<int64_t> minimum; // an int's lowest value (none: any int); a bool has none
    const char *           unit;    // what an int counts ("tokens", "layers", ...); "" for a bool
    const char *           help;    // what it does, for the CLI's help (its default is added there)
    std::variant<bool EngineParams::*, int32_t EngineParams::*, uint32_t EngineParams::*> field;
    std::optional<int64_t> maximum = std::nullopt; // an int's highest value (none: the type's)
};

const std::vector<EngineSetting> & engine_settings();

} // namespace h2o
