#include "recall_ranking.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
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

// the x86-64 baseline has neither AVX2 nor FMA: the kernels below are also compiled for x86-64-v3 (AVX2, FMA),
// chosen at run time by what the CPU supports (GCC 12 dispatches on the ISA level; "arch=haswell" would ask for
// that very CPU); the dispatch is an ifunc: glibc's, on Linux
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && defined(__linux__) && \
    defined(__GLIBC__)
#define H2O_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define H2O_VECTOR_CLONES
#endif

constexpr size_t kChunk = 64;                   // entries whose keys are read together
constexpr size_t kLogitBytes = 64u*1024u*1024u; // at most this many bytes of logits at once

// e^x for x <= 0 (below -87 as -87: 2^-125), branch-free so that a loop of them vectorises: 2^i by the exponent
// bits, e^f for f in (-ln 2, 0] by its Taylor series to degree 7 (relative error below 5e-6)
inline float exp_nonpositive(float x) {
    x = std::max(x, -87.0f);
    const float t = x*1.44269504f;
    const int32_t i = (int32_t) t; // towards zero: t - i in (-1, 0]
    const float f = (t - (float) i)*0.693147181f;
    float p = 1.0f/5040.0f;
    p = p*f + 1.0f/720.0f;
    p = p*f + 1.0f/120.0f;
    p = p*f + 1.0f/24.0f;
    p = p*f + 1.0f/6.0f;
    p = p*f + 0.5f;
    p = p*f + 1.0f;
    p = p*f + 1.0f;
    const int32_t bits = (i + 127) << 23;
    float two_i;
    std::memcpy(&two_i, &bits, sizeof(two_i));
    return p*two_i;
}

// logits[r][j] = q[r] . keys_t[.][j] for rows r < n_rows and entries j < n <= kChunk (q: [n_rows][d], keys_t: d rows
// of kChunk, logits: rows of ld), one row at a time
inline void row_logits(const float * q, size_t n_rows, size_t d, const float * keys_t, size_t n,
                       float * logits, size_t ld) {
    for (size_t r = 0; r < n_rows; ++r) {
        float acc[kChunk] = {};
        for (size_t e = 0; e < d; ++e) {
            const float qe = q[r*d + e];
            const float * k = keys_t + e*kChunk;
            for (size_t j = 0; j < n; ++j) {
                acc[j] += qe*k[j];
            }
        }
        std::copy(acc, acc + n, logits + r*ld);
    }
}

// the same for two rows and 32 entries at a time (what fits the registers: twice as fast as a row at a time)
inline void tile_logits(const float * q, size_t d, const float * keys_t, float * logits, size_t ld) {
    constexpr size_t kRows = 2, kCols = 32;
    float acc[kRows][kCols] = {};
    for (size_t e = 0; e < d; ++e) {
        const float * k = keys_t + e*kChunk;
        for (size_t i = 0; i < kRows; ++i) {
            const float qi = q[i*d + e];
            for (size_t j = 0; j < kCols; ++j) {
                acc[i][j] += qi*k[j];
            }
        }
    }
    for (size_t i = 0; i < kRows; ++i) {
        std::copy(acc[i], acc[i] + kCols, logits + i*ld);
    }
}

H2O_VECTOR_CLONES
void chunk_logits(const float * q, size_t n_rows, size_t d, const float * keys_t, size_t n, float * logits,
                  size_t ld) {
    size_t r = 0;
    if (n == kChunk) {
        for (; r + 2 <= n_rows; r += 2) {
            for (size_t j = 0; j < kChunk; j += 32) {
                tile_logits(q + r*d, d, keys_t + j, logits + r*ld + j, ld);
            }
        }
    }
    row_logits(q + r*d, n_rows - r, d, keys_t, n, logits + r*ld, ld);
}

// a row of logits as its softmax, in place (the max and the sum in kLanes partial lanes, so that they vectorise)
constexpr size_t kLanes = 16;

H2O_VECTOR_CLONES
void softmax_row(float * row, size_t n) {
    const size_t n_main = n/kLanes*kLanes;
    float top_l[kLanes];
    std::fill(top_l, top_l + kLanes, -std::numeric_limits<float>::infinity());
    for (size_t j = 0; j < n_main; j += kLanes) {
        for (size_t k = 0; k < kLanes; ++k) {
            top_l[k] = row[j + k] > top_l[k] ? row[j + k] : top_l[k];
        }
    }
    float top = *std::max_element(top_l, top_l + kLanes);
    for (size_t j = n_main; j < n; ++j) {
        top = std::max(top, row[j]);
    }
    for (size_t j = 0; j < n; ++j) {
        row[j] = exp_nonpositive(row[j] - top);
    }
    float total_l[kLanes] = {};
    for (size_t j = 0; j < n_main; j += kLanes) {
        for (size_t k = 0; k < kLanes; ++k) {
            total_l[k] += row[j + k];
        }
    }
    float total = std::accumulate(total_l, total_l + kLanes, 0.0f);
    for (size_t j = n_main; j < n; ++j) {
        total += row[j];
    }
    const float inv = 1.0f/total;
    for (size_t j = 0; j < n; ++j) {
        row[j] *= inv;
    }
}

// fn(begin, end) over [0, n) in n_threads contiguous parts, the first on this thread
template <typename F>
void parallel_ranges(size_t n, int32_t n_threads, const F & fn) {
    const size_t n_work = std::max<size_t>(1, std::min<size_t>((size_t) std::max(n_threads, 1), n));
    std::vector<std::thread> workers;
    for (size_t w = 1; w < n_work; ++w) {
        workers.emplace_back(fn, n*w/n_work, n*(w + 1)/n_work);
    }
    fn(0, n/n_work);
    for (std::thread & t : workers) {
        t.join();
    }
}

// an F16 value's bits as F32, branch-free so that a loop of them vectorises (exact for every value)
inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    const float sub = (float) (int32_t) em*5.9604645e-8f; // a subnormal or zero: em * 2^-24, exact
    uint32_t sub_bits;
    std::memcpy(&sub_bits, &sub, sizeof(sub_bits));
    const uint32_t bits = em >= 0x7c00u ? (em << 13) | 0x7f800000u : em >= 0x400u ? (em << 13) + 0x38000000u : sub_bits;
    const uint32_t out_bits = bits | sign;
    float out;
    std::memcpy(&out, &out_bits, sizeof(out));
    return out;
}

H2O_VECTOR_CLONES
void f16_row_to_f32(const uint16_t * in, float * out, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        out[i] = f16_bits_to_f32(in[i]);
    }
}

// One ranking layer's keys: the kept entries' (F32 rows of n_key) then the host entries' (the store's rows), as
// entries [0, n_kept + n_host).
struct LayerKeys {
    const KeyLayout & layout;
    const HostStore & store;
    const float *     kept;
    size_t            n_kept;
    int32_t           il;

    size_t size() const { return n_kept + store.size(); }

    // the keys of entries [j0, j0 + n) of KV head g, transposed: out[e*kChunk + j - j0] for e < head_dim (n <= kChunk;
    // key: head_dim floats of room)
    void transposed(size_t g, size_t j0, size_t n, float * key, float * out) const {
        const size_t d = (size_t) layout.head_dim;
        for (size_t jj = 0; jj < n; ++jj) {
            const size_t j = j0 + jj;
            const float * k = key;
            if (j < n_kept) {
                k = kept + j*layout.n_key() + g*d;
            } else {
                const uint8_t * row = store.kv.data() + (j - n_kept)*store.entry_bytes + (size_t) il*layout.layer_bytes;
                if (layout.type_k == GGML_TYPE_F32) {
                    k = (const float *) row + g*d;
                } else {
                    f16_row_to_f32((const uint16_t *) row + g*d, key, d);
                }
            }
            for (size_t e = 0; e < d; ++e) {
                out[e*kChunk + jj] = k[e];
            }
        }
    }
};

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
        if (kept_keys[li].size() % n_key != 0) {
            return {};
        }
        const LayerKeys keys{layout, store, kept_keys[li].data(), kept_keys[li].size()/n_key, layers[li]};
        const size_t n_all = keys.size();
        const size_t n_chunks = (n_all + kChunk - 1)/kChunk;
        // a KV head's query rows (row r: head g*group + r/n_tok, token r%n_tok), scaled, read against every key of
        // the layer at once (the logits a block of rows at a time)
        const size_t n_rows = group*n_tok;
        const size_t block = std::max<size_t>(1, std::min(n_rows, kLogitBytes/(n_all*sizeof(float))));
        std::vector<float> q(block*d);
        std::vector<float> logits(block*n_all);
        for (size_t g = 0; g < (size_t) layout.n_head_kv; ++g) {
            for (size_t r0 = 0; r0 < n_rows; r0 += block) {
                const size_t nr = std::min(block, n_rows - r0);
                for (size_t r = 0; r < nr; ++r) {
                    const size_t h = g*group + (r0 + r)/n_tok;
                    const float * src = queries.layers[li].data() + (((r0 + r)%n_tok)*n_head + h)*d;
                    for (size_t e = 0; e < d; ++e) {
                        q[r*d + e] = src[e]*scale;
                    }
                }
                parallel_ranges(n_chunks, n_threads, [&](size_t c0, size_t c1) {
                    std::vector<float> keys_t(d*kChunk, 0.0f);
                    std::vector<float> key(d);
                    for (size_t c = c0; c < c1; ++c) {
                        const size_t j0 = c*kChunk;
                        const size_t n = std::min(kChunk, n_all - j0);
                        keys.transposed(g, j0, n, key.data(), keys_t.data());
                        chunk_logits(q.data(), nr, d, keys_t.data(), n, logits.data() + j0, n_all);
                    }
                });
                parallel_ranges(nr, n_threads, [&](size_t a, size_t b) {
                    for (size_t r = a; r < b; ++r) {
                        softmax_row(logits.data() + r*n_all, n_all);
                    }
                });
                // each thread its own host entries: no two write the same sums
                parallel_ranges(n_host, n_threads, [&](size_t a, size_t b) {
                    for (size_t r = 0; r < nr; ++r) {
                        const float * p = logits.data() + r*n_all + keys.n_kept;
                        float * into = sums.data() + (g*group + (r0 + r)/n_tok)*n_host;
                        for (size_t j = a; j < b; ++j) {
                            into[j] += p[j];
                        }
                    }
                });
            }
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
