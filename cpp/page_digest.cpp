#include "page_digest.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <thread>

namespace h2o {

KeyLayout KeyLayout::of(int32_t n_layer, int32_t n_head_kv, int32_t head_dim, ggml_type type_k, size_t entry_bytes) {
    KeyLayout l;
    if (n_layer <= 0 || n_head_kv <= 0 || head_dim <= 0 || entry_bytes == 0 || entry_bytes % (size_t) n_layer != 0 ||
        (type_k != GGML_TYPE_F16 && type_k != GGML_TYPE_F32)) {
        return l;
    }
    const size_t layer_bytes = entry_bytes / (size_t) n_layer;
    if (ggml_row_size(type_k, (int64_t) n_head_kv*head_dim) >= layer_bytes) { // a V row after it
        return l;
    }
    l.n_layer     = n_layer;
    l.n_head_kv   = n_head_kv;
    l.head_dim    = head_dim;
    l.type_k      = type_k;
    l.layer_bytes = layer_bytes;
    return l;
}

bool Queries::fits(const KeyLayout & layout) const {
    if (!layout.valid() || n_tokens <= 0 || head_dim != layout.head_dim || n_head < layout.n_head_kv ||
        n_head % layout.n_head_kv != 0 || layers.size() != (size_t) layout.n_layer) {
        return false;
    }
    const size_t n = (size_t) n_tokens*n_head*head_dim;
    return std::all_of(layers.begin(), layers.end(), [&](const std::vector<float> & q) { return q.size() == n; });
}

namespace {

// one layer's key of an entry in F32
void read_key(const KeyLayout & layout, const uint8_t * entry, int32_t il, float * out) {
    const uint8_t * row = entry + (size_t) il*layout.layer_bytes;
    const size_t n = layout.n_key();
    if (layout.type_k == GGML_TYPE_F32) {
        std::copy((const float *) row, (const float *) row + n, out);
    } else {
        ggml_fp16_to_fp32_row((const ggml_fp16_t *) row, out, (int64_t) n);
    }
}

} // namespace

void PageDigests::sync(const KeyLayout & layout, const HostStore & store, size_t entry_bytes) {
    if (!layout.valid() || entry_bytes != layout.layer_bytes*layout.n_layer) {
        blocks_.clear();
        return;
    }
    // block -> (origin, store index); a block is computed again when its members or their keys' positions changed
    std::map<llama_pos, std::vector<std::pair<llama_pos, size_t>>> members;
    for (size_t i = 0; i < store.size(); ++i) {
        members[store.origins[i] / kBlockEntries].emplace_back(store.origins[i], i);
    }
    std::map<llama_pos, Block> out;
    const size_t d = (size_t) layout.head_dim;
    const size_t per_layer = (size_t) layout.n_head_kv*2*d;
    std::vector<float> key(layout.n_key());
    for (auto & kv : members) {
        std::sort(kv.second.begin(), kv.second.end());
        Block b;
        std::vector<size_t> indices;
        for (const auto & m : kv.second) {
            b.origins.push_back(m.first);
            b.positions.push_back(store.positions[m.second]);
            indices.push_back(m.second);
        }
        const auto was = blocks_.find(kv.first);
        if (was != blocks_.end() && was->second.origins == b.origins && was->second.positions == b.positions) {
            out[kv.first] = std::move(was->second);
            continue;
        }
        b.bounds.resize(per_layer*layout.n_layer);
        for (size_t j = 0; j < b.bounds.size(); ++j) { // [max | min] per head
            b.bounds[j] = (j / d) % 2 == 0 ? -std::numeric_limits<float>::infinity()
                                           : std::numeric_limits<float>::infinity();
        }
        const std::vector<uint8_t> rows = store.raw_rows(indices, entry_bytes);
        for (size_t i = 0; i < indices.size(); ++i) {
            for (int32_t il = 0; il < layout.n_layer; ++il) {
                read_key(layout, rows.data() + i*entry_bytes, il, key.data());
                float * bound = b.bounds.data() + (size_t) il*per_layer;
                for (int32_t h = 0; h < layout.n_head_kv; ++h) {
                    float * mx = bound + (size_t) h*2*d;
                    float * mn = mx + d;
                    const float * k = key.data() + (size_t) h*d;
                    for (size_t e = 0; e < d; ++e) {
                        mx[e] = std::max(mx[e], k[e]);
                        mn[e] = std::min(mn[e], k[e]);
                    }
                }
            }
        }
        out[kv.first] = std::move(b);
    }
    blocks_ = std::move(out);
}

std::vector<float> PageDigests::score(const KeyLayout & layout, const Queries & queries, int32_t n_threads) const {
    const size_t n_blocks = blocks_.size();
    std::vector<float> out(n_blocks, 0.0f);
    if (n_blocks == 0 || !queries.fits(layout)) {
        return out;
    }
    const size_t d = (size_t) layout.head_dim;
    const size_t n_head = (size_t) queries.n_head;
    const size_t group = n_head / (size_t) layout.n_head_kv;
    const size_t n_tok = (size_t) queries.n_tokens;
    const size_t n_layer = (size_t) layout.n_layer;
    // q split into its positive and negative parts: max(q*hi, q*lo) = q+ * hi + q- * lo, a plain dot product with
    // the [max | min] bounds; [layer][head][token][q+ | q-]
    std::vector<float> split(n_layer*n_head*n_tok*2*d);
    for (size_t il = 0; il < n_layer; ++il) {
        for (size_t h = 0; h < n_head; ++h) {
            for (size_t t = 0; t < n_tok; ++t) {
                const float * q = queries.layers[il].data() + (t*n_head + h)*d;
                float * s = split.data() + ((il*n_head + h)*n_tok + t)*2*d;
                for (size_t e = 0; e < d; ++e) {
                    s[e]     = std::max(q[e], 0.0f);
                    s[d + e] = std::min(q[e], 0.0f);
                }
            }
        }
    }
    // best bound over the question's tokens: [layer][head][block]
    std::vector<float> best(n_layer*n_head*n_blocks);
    std::vector<const float *> digest;
    for (const auto & kv : blocks_) {
        digest.push_back(kv.second.bounds.data());
    }
    const auto bound_blocks = [&](size_t b0, size_t b1) {
        for (size_t b = b0; b < b1; ++b) {
            const float * bounds = digest[b];
            for (size_t il = 0; il < n_layer; ++il) {
                for (size_t h = 0; h < n_head; ++h) {
                    const float * dig = bounds + (il*layout.n_head_kv + h/group)*2*d;
                    const float * s = split.data() + (il*n_head + h)*n_tok*2*d;
                    float top = -std::numeric_limits<float>::infinity();
                    for (size_t t = 0; t < n_tok; ++t, s += 2*d) {
                        float acc = 0.0f;
                        for (size_t e = 0; e < 2*d; ++e) {
                            acc += s[e]*dig[e];
                        }
                        top = std::max(top, acc);
                    }
                    best[(il*n_head + h)*n_blocks + b] = top;
                }
            }
        }
    };
    const size_t n_work = std::max<size_t>(1, std::min<size_t>((size_t) std::max(n_threads, 1), n_blocks/8 + 1));
    std::vector<std::thread> workers;
    for (size_t w = 1; w < n_work; ++w) {
        workers.emplace_back(bound_blocks, n_blocks*w/n_work, n_blocks*(w + 1)/n_work);
    }
    bound_blocks(0, n_blocks/n_work);
    for (std::thread & t : workers) {
        t.join();
    }
    const float scale = 1.0f/std::sqrt((float) d);
    for (size_t lh = 0; lh < n_layer*n_head; ++lh) {
        const float * u = best.data() + lh*n_blocks;
        const float top = *std::max_element(u, u + n_blocks);
        double sum = 0.0;
        for (size_t b = 0; b < n_blocks; ++b) {
            sum += std::exp((double) ((u[b] - top)*scale));
        }
        for (size_t b = 0; b < n_blocks; ++b) {
            out[b] += (float) (std::exp((double) ((u[b] - top)*scale))/sum);
        }
    }
    return out;
}

} // namespace h2o
