// Which host entries a recall step probes, when it does not probe every page (the policy option recall_pages): the
// question's queries read against the stored keys on the host, so that the question is decoded twice (once for its
// queries, once for the chosen pages) whatever the history's length.
#pragma once

#include "host_store.h"

#include "ggml.h"
#include "llama.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace h2o {

// Where the keys lie in an entry of llama_kv_entries_get (layer by layer: the K row, then the V row): every layer
// the same size, keys of n_head_kv heads of head_dim elements as F16 or F32. Not valid for other layouts (a
// quantized K row, layers of different sizes): recall then probes every page.
struct KeyLayout {
    int32_t   n_layer   = 0;
    int32_t   n_head_kv = 0;
    int32_t   head_dim  = 0;
    ggml_type type_k    = GGML_TYPE_F16;
    size_t    layer_bytes = 0; // one layer's K and V rows in an entry

    bool valid() const { return n_layer > 0 && n_head_kv > 0 && head_dim > 0 && layer_bytes > 0; }
    size_t n_key() const { return (size_t) n_head_kv*head_dim; } // elements of one layer's key row
    // the layout of entries of entry_bytes, when it is one this reads; an invalid one otherwise
    static KeyLayout of(int32_t n_layer, int32_t n_head_kv, int32_t head_dim, ggml_type type_k, size_t entry_bytes);
};

// The layers the ranking reads: every third from the second (all of them below three). Measured on SmolLM2's
// retrieval rows: a third of the layers ranks the needle's block as all of them do (docs/recall.md).
std::vector<int32_t> ranking_layers(int32_t n_layer);

// A question's queries in the ranking layers, as llama_attn_queries_get gives them: [n_tokens][n_head][head_dim].
struct Queries {
    int32_t n_tokens = 0;
    int32_t n_head   = 0;
    int32_t head_dim = 0;
    std::vector<std::vector<float>> layers; // [ranking_layers(n_layer).size()]

    bool fits(const KeyLayout & layout) const;
};

// Each host entry's lift for the question: per query head, the attention its queries would give the entry in a cache
// holding the kept entries (kept_keys: per ranking layer [n_kept][n_key] in F32, as llama_attn_keys_get gives them)
// and every host entry at once, summed over the ranking layers, per query; divided by the entry's baseline (its
// SeqScores::seen per query, shrunk towards the host entries' mean as observe_probe does); the best head's. Empty
// when the store's rows cannot be read so (a q8_0 copy) or the inputs do not fit the layout.
std::vector<float> host_lift(const KeyLayout & layout, const Queries & queries,
                             const std::vector<std::vector<float>> & kept_keys, const HostStore & store,
                             int32_t n_threads);

// The host entries (by origin) a recall step probes, best first, at most `limit`: blocks of kBlockEntries
// neighbouring places in the conversation (block k: origins k*32 .. k*32 + 31), ranked by their best member's
// score, all of a block's members together (a found key brings its value).
constexpr llama_pos kBlockEntries = 32;
std::vector<llama_pos> best_blocks(const std::vector<llama_pos> & origins, const std::vector<float> & score,
                                   size_t limit);

} // namespace h2o
