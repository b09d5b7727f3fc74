#pragma once

#include "llama.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace h2o {

// How a feed of prompts is cut into llama_decode chunks, and where each sequence evicts: a pure function of sizes,
// so that it can be tested without a model. The engine runs the plan.
//
// A feed that fits in the free cells is decoded whole (in chunks of n_batch) and compressed once at the end (the
// reference mode). Otherwise each sequence is cut into pieces of n_batch tokens counted from its own start, a chunk
// takes whole pieces only (so a sequence is cut at the same places alone or beside others), and a sequence evicts
// after a chunk only when its next piece needs the cells (or always, in a cache shared by several sequences, where
// the cells one keeps would move where the others are cut). The last `query_window` tokens of a prompt (the policy's query
// window) go into a chunk of their own, whole.
struct PrefillInput {
    std::map<llama_seq_id, size_t>  sizes;  // tokens to feed, per sequence
    std::map<llama_seq_id, int32_t> cells;  // entries each sequence of the context holds now (fed or not)
    int32_t capacity = 0;       // cells of one stream (a unified cache: of the whole cache)
    bool    kv_unified = true;
    bool    defer_eviction = true;
    bool    bounded = true;     // false: the policy never evicts, and a feed that does not fit gets no plan
    int32_t budget = 0;         // entries a sequence holds after an eviction (bounded policies)
    size_t  n_batch = 512;      // tokens per piece and per chunk
    size_t  query_window = 0;   // the policy's query window (0: none), at most n_batch
};

struct PrefillStep {
    std::map<llama_seq_id, std::pair<size_t, size_t>> chunk; // seq -> (offset into its tokens, count)
    std::set<llama_seq_id>   query_windows; // sequences whose query window is this chunk
    std::vector<llama_seq_id> evict_after; // sequences that evict after this chunk's decode
};

struct PrefillPlan {
    bool fits = false;               // decoded whole, then every fed sequence evicts once at the end
    std::vector<PrefillStep> steps;
};

// throws std::logic_error when a chunk would find no free cell (a budget that leaves no room: checked earlier)
PrefillPlan plan_prefill(const PrefillInput & in);

} // namespace h2o
