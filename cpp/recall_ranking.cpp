#include "recall_ranking.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
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

std::vector<int32_t> ranking_layers(int32_t n_layer) {
    std::vector<int32_t> out;
    for (int32_t il = 0; il < n_layer; ++il) {
        if (n_layer < 3 || il % 3 == 1) {
            out.push_back(il);
        }
    }
    return out;
}

bool Queries::fits(const KeyLayout & layout) const {
    if (!layout.valid() || n_tokens <= 0 || head_dim != layout.head_dim || n_head < layout.n_head_kv ||
        n_head % layout.n_head_kv != 0 || layers.size() != ranking_layers(layout.n_layer).size()) {
        return false;
    }
    const size_t n = (size_t) n_tokens*n_head*head_dim;
    return std::all_of(layers.begin(), layers.end(), [&](const std::vector<float> & q) { return q.size() == n; });
}

namespace {

// layer il's keys of every host entry in F32, transposed per element: [n_key][n] (the logits of many keys are then
// one vectorisable loop per element)
std::vector<float> host_keys_t(const KeyLayout & layout, const HostStore & store, int32_t il) {
    const size_t n_key = layout.n_key();
    const size_t n = store.size();
    std::vector<float> out(n_key*n);
    std::vector<float> key(n_key);
    for (size_t i = 0; i < n; ++i) {
        const uint8_t * row = store.kv.data() + i*store.entry_bytes + (size_t) il*layout.layer_bytes;
        if (layout.type_k == GGML_TYPE_F32) {
            std::copy((const float *) row, (const float *) row + n_key, key.data());
        } else {
            ggml_fp16_to_fp32_row((const ggml_fp16_t *) row, key.data(), (int64_t) n_key);
        }
        for (size_t e = 0; e < n_key; ++e) {
            out[e*n + i] = key[e];
        }
    }
    return out;
}

// [n][n_key] -> [n_key][n]
std::vector<float> transposed(const std::vector<float> & rows, size_t n_key) {
    const size_t n = rows.size()/n_key;
    std::vector<float> out(rows.size());
    for (size_t i = 0; i < n; ++i) {
        for (size_t e = 0; e < n_key; ++e) {
            out[e*n + i] = rows[i*n_key + e];
        }
    }
    return out;
}

// logit[j] += sum over the head's elements of q[e] * keys_t[off + e][j], for j < n
void add_logits(const float * q, const float * keys_t, size_t off, size_t d, size_t n, float scale, float * logit) {
    for (size_t e = 0; e < d; ++e) {
        const float qe = q[e]*scale;
        const float * row = keys_t + (off + e)*n;
        for (size_t j = 0; j < n; ++j) {
            logit[j] += qe*row[j];
        }
    }
}

} // namespace

std::vector<float> host_lift(const KeyLayout & layout, const Queries & queries,
                             const std::vector<std::vector<float>> & kept_keys, const HostStore & store,
                             int32_t n_threads) {
    const size_t n_host = store.size();
    const std::vector<int32_t> layers = ranking_layers(layout.n_layer);
    if (n_host == 0 || store.q8_0 || !queries.fits(layout) || kept_keys.size() != layers.size() ||
        store.entry_bytes != layout.layer_bytes*layout.n_layer || store.scores.n_head != queries.n_head) {
        return {};
    }
    const size_t d = (size_t) layout.head_dim;
    const size_t n_key = layout.n_key();
    const size_t n_head = (size_t) queries.n_head;
    const size_t group = n_head / (size_t) layout.n_head_kv;
    const size_t n_tok = (size_t) queries.n_tokens;
    const float scale = 1.0f/std::sqrt((float) d);
    std::vector<float> sums(n_head*n_host, 0.0f); // [head][host entry]: attention summed over layers and queries
    for (size_t li = 0; li < layers.size(); ++li) {
        const std::vector<float> & kept = kept_keys[li];
        if (kept.size() % n_key != 0) {
            return {};
        }
        const size_t n_kept = kept.size()/n_key;
        const std::vector<float> kept_t = transposed(kept, n_key);
        const std::vector<float> host_t = host_keys_t(layout, store, layers[li]);
        const float * q_all = queries.layers[li].data();
        // each thread its own heads: no two write the same sums
        const auto heads = [&](size_t h0, size_t h1) {
            std::vector<float> logit(n_kept + n_host);
            for (size_t h = h0; h < h1; ++h) {
                const size_t off = (h/group)*d;
                float * into = sums.data() + h*n_host;
                for (size_t t = 0; t < n_tok; ++t) {
                    const float * q = q_all + (t*n_head + h)*d;
                    std::fill(logit.begin(), logit.end(), 0.0f);
                    add_logits(q, kept_t.data(), off, d, n_kept, scale, logit.data());
                    add_logits(q, host_t.data(), off, d, n_host, scale, logit.data() + n_kept);
                    const float top = *std::max_element(logit.begin(), logit.end());
                    float total = 0.0f;
                    for (float & v : logit) {
                        v = std::exp(v - top);
                        total += v;
                    }
                    const float inv = 1.0f/total;
                    for (size_t j = 0; j < n_host; ++j) {
                        into[j] += logit[n_kept + j]*inv;
                    }
                }
            }
        };
        const size_t n_work = std::max<size_t>(1, std::min<size_t>((size_t) std::max(n_threads, 1), n_head));
        std::vector<std::thread> workers;
        for (size_t w = 1; w < n_work; ++w) {
            workers.emplace_back(heads, n_head*w/n_work, n_head*(w + 1)/n_work);
        }
        heads(0, n_head/n_work);
        for (std::thread & t : workers) {
            t.join();
        }
    }
    const std::vector<float> base = probe_baseline(store.scores); // as observe_probe divides by it
    std::vector<float> lift(n_host, 0.0f);
    for (size_t i = 0; i < n_host; ++i) {
        for (size_t h = 0; h < n_head; ++h) {
            lift[i] = std::max(lift[i], sums[h*n_host + i]/(float) n_tok/base[i*n_head + h]);
        }
    }
    return lift;
}

std::vector<llama_pos> best_blocks(const std::vector<llama_pos> & origins, const std::vector<float> & score,
                                   size_t limit) {
    std::map<llama_pos, std::vector<llama_pos>> members;
    std::map<llama_pos, float> best;
    for (size_t i = 0; i < origins.size() && i < score.size(); ++i) {
        const llama_pos b = origins[i] / kBlockEntries;
        members[b].push_back(origins[i]);
        const auto it = best.find(b);
        best[b] = it == best.end() ? score[i] : std::max(it->second, score[i]);
    }
    std::vector<std::pair<float, llama_pos>> order;
    for (const auto & kv : best) {
        order.emplace_back(-kv.second, kv.first);
    }
    std::stable_sort(order.begin(), order.end(), [](const auto & a, const auto & b) { return a.first < b.first; });
    std::vector<llama_pos> out;
    for (const auto & ob : order) {
        std::vector<llama_pos> & m = members[ob.second];
        std::sort(m.begin(), m.end());
        for (const llama_pos o : m) {
            if (out.size() >= limit) {
                return out;
            }
            out.push_back(o);
        }
    }
    return out;
}

} // namespace h2o
