// Recall's page digests: for each block of entries kept in host memory, the element-wise bounds of their keys per
// layer and KV head (Quest's digest, ArkVale's page summary). A question's queries score every block by the upper
// bound of q.k over its keys, so that a recall step probes only the entries of the blocks ranked first instead of
// every page of the store.
#pragma once

#include "host_store.h"

#include "ggml.h"
#include "llama.h"

#include <cstddef>
#include <cstdint>
#include <map>
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

// A question's queries, as llama_attn_queries_get gives them per layer: [n_tokens][n_head][head_dim].
struct Queries {
    int32_t n_tokens = 0;
    int32_t n_head   = 0;
    int32_t head_dim = 0;
    std::vector<std::vector<float>> layers; // [n_layer]

    bool fits(const KeyLayout & layout) const;
};

// The host entries in blocks of kBlockEntries neighbouring places in the conversation (block k: origins
// [k*32, k*32 + 32)), each with its members' origins and the bounds of their keys:
// [n_layer][n_head_kv][max, min][head_dim]. What a block holds depends only on the store's entries, not on the order
// they came and went in: a store saved and loaded gives the same digests.
class PageDigests {
public:
    static constexpr llama_pos kBlockEntries = 32;

    struct Block {
        std::vector<llama_pos> origins;   // ascending
        std::vector<llama_pos> positions; // each key's rotation (HostStore::positions)
        std::vector<float>     bounds;
    };

    void clear() { blocks_.clear(); }
    const std::map<llama_pos, Block> & blocks() const { return blocks_; }

    // the digests brought to the store's entries (cache rows of entry_bytes each): blocks whose members changed
    // since the last sync are computed again from their rows, the others kept
    void sync(const KeyLayout & layout, const HostStore & store, size_t entry_bytes);

    // each block's score for the queries (in blocks()' order): per layer and query head, the best upper bound of
    // q.k over the question's tokens, as a softmax over the blocks (scaled by 1/sqrt(head_dim)), summed over
    // layers and heads
    std::vector<float> score(const KeyLayout & layout, const Queries & queries, int32_t n_threads) const;

private:
    std::map<llama_pos, Block> blocks_; // by block number
};

} // namespace h2o
