// How big a context is made: its KV cells, its batch, its rows of logits, and whether the machine can hold them.
// Functions of plain numbers, so that each rule can be tested without a model.
#pragma once

#include "engine_params.h"

#include <cstdint>
#include <string>

namespace h2o {

// KV cells a bounded cache needs: the budgets of all sequences + one batch of fresh tokens in one cell space
// (kv_unified), or a budget + one batch per sequence's stream. The one sizing rule (Python's capacity.py asks it).
uint32_t bounded_cells(uint32_t n_seq, uint32_t budget, uint32_t n_batch, bool kv_unified);
// KV cells llama.cpp allocates for n_cells: llama_context rounds n_ctx, and each stream's share, up to a multiple of
// 256 (llama-context.cpp); what a memory limit has to cover
uint32_t padded_cells(uint32_t n_cells, uint32_t n_seq, bool kv_unified);
struct ContextSize {
    uint32_t n_ctx         = 0; // KV cells asked of llama.cpp (it pads them: padded_cells)
    uint32_t n_batch       = 0; // tokens per llama_decode
    uint32_t n_ubatch      = 0; // tokens per ubatch: params' (0: n_batch), at most n_batch
    uint32_t n_outputs_max = 0; // rows of logits one decode may return
    // a probe's tokens that can ride with a whole batch in one llama_decode: llama.cpp's batch and ubatch are made
    // that much larger than n_batch and n_ubatch, which stay the tokens a prompt is read in per chunk
    uint32_t n_probe_ride  = 0;
};

// the context for params under policy: n_ctx as asked, or (0) the budgets plus one batch and one probe's cells
// (n_probe) per stream for a bounded policy, the trained context per stream for the full cache; refuses an n_ctx that
// leaves no room beside the budgets; n_ride: the probe's tokens that can ride with a chunk (the question or catalyst
// probe's; 0 for the repeat probe, which is a batch of its own)
ContextSize context_size(const EngineParams & params, const Policy & policy, int32_t n_ctx_train, int32_t n_probe,
                         int32_t n_ride = 0);

// refuses a context whose KV cells (when they are in host memory) and logits alone need more than `have` bytes
// (0: unknown, nothing refused): parts of it would be allocated, and the system would stop the process when they
// are touched
void check_host_memory(const ContextSize & size, uint64_t kv_bytes_per_cell, int32_t n_vocab, bool kv_on_host,
                       uint64_t have);

// The KV cache of the layers on devices (device_kv_bytes_per_cell: their share of a cell) against those devices'
// memory (have: their total in bytes, 0: unknown, as for an RPC server): throws std::invalid_argument before
// llama.cpp would try to allocate it there
void check_device_memory(const ContextSize & size, uint64_t device_kv_bytes_per_cell, const std::string & devices,
                         uint64_t have);

// this machine's memory in bytes (0: unknown)
uint64_t physical_memory_bytes();

} // namespace h2o
