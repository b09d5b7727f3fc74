#include "recall_ranking.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <thread>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define H2O_X86_F16C
#include <immintrin.h>
#endif

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

constexpr size_t kTileEntries = 6;              // entries whose logits a tile computes together
constexpr size_t kRowStep = 16;                 // query rows are padded to a multiple of this
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

// logits[j][r] = keys[j] . qt[.][r] for kTileEntries entries and rp rows (qt: d rows of rp, rp a multiple of
// kRowStep; keys: kTileEntries rows of d, ks apart; logits: kTileEntries rows of ld). The rows are the vector lanes:
// a key element times 16 rows at once, the 12 sums in registers (the keys need no transposing)
H2O_VECTOR_CLONES
void tile_logits(const float * qt, size_t rp, size_t d, const float * keys, size_t ks, float * logits, size_t ld) {
#if defined(__GNUC__)
    typedef float lanes8 __attribute__((vector_size(32)));
    for (size_t r0 = 0; r0 < rp; r0 += kRowStep) {
        lanes8 acc[kTileEntries][2] = {};
        for (size_t e = 0; e < d; ++e) {
            lanes8 a0, a1;
            std::memcpy(&a0, qt + e*rp + r0, sizeof(a0));
            std::memcpy(&a1, qt + e*rp + r0 + 8, sizeof(a1));
            for (size_t j = 0; j < kTileEntries; ++j) {
                const float k = keys[j*ks + e];
                acc[j][0] += a0*k;
                acc[j][1] += a1*k;
            }
        }
        for (size_t j = 0; j < kTileEntries; ++j) {
            std::memcpy(logits + j*ld + r0, &acc[j][0], sizeof(acc[j][0]));
            std::memcpy(logits + j*ld + r0 + 8, &acc[j][1], sizeof(acc[j][1]));
        }
    }
#else
    for (size_t j = 0; j < kTileEntries; ++j) {
        float * out = logits + j*ld;
        std::fill(out, out + rp, 0.0f);
        for (size_t e = 0; e < d; ++e) {
            const float k = keys[j*ks + e];
            for (size_t r = 0; r < rp; ++r) {
                out[r] += qt[e*rp + r]*k;
            }
        }
    }
#endif
}

// top[r] = the max of top[r] and rows[j][r] for j < n (rows: n rows of rp)
H2O_VECTOR_CLONES
void max_into(const float * rows, size_t n, size_t rp, float * top) {
    for (size_t j = 0; j < n; ++j) {
        for (size_t r = 0; r < rp; ++r) {
            top[r] = rows[j*rp + r] > top[r] ? rows[j*rp + r] : top[r];
        }
    }
}

// rows[j][r] = e^(rows[j][r] - top[r]) for j < n, their sums over j added to total[r]
H2O_VECTOR_CLONES
void exp_rows(float * rows, size_t n, size_t rp, const float * top, float * total) {
    for (size_t j = 0; j < n; ++j) {
        float * row = rows + j*rp;
        for (size_t r = 0; r < rp; ++r) {
            row[r] = exp_nonpositive(row[r] - top[r]);
            total[r] += row[r];
        }
    }
}

// the parts fn(part, begin, end) of [0, n) that parallel_parts runs: at most n_threads, none empty
size_t parts_of(size_t n, int32_t n_threads) {
    return std::max<size_t>(1, std::min<size_t>((size_t) std::max(n_threads, 1), n));
}

// fn(part, begin, end) over [0, n) in parts_of(n, n_threads) contiguous parts, the first on this thread
template <typename F>
void parallel_parts(size_t n, int32_t n_threads, const F & fn) {
    const size_t n_work = parts_of(n, n_threads);
    std::vector<std::thread> workers;
    for (size_t w = 1; w < n_work; ++w) {
        workers.emplace_back(fn, w, n*w/n_work, n*(w + 1)/n_work);
    }
    fn(0, 0, n/n_work);
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

void f16_row_to_f32(const uint16_t * in, float * out, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        out[i] = f16_bits_to_f32(in[i]);
    }
}

#if defined(H2O_X86_F16C)
// the same by the F16C instruction (what CPUs with AVX have had since 2012: 2x the scan's speed, measured)
__attribute__((target("avx,f16c"))) void f16_row_to_f32_f16c(const uint16_t * in, float * out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (in + i))));
    }
    f16_row_to_f32(in + i, out + i, n - i);
}
#endif

using F16Rows = void (*)(const uint16_t * in, float * out, size_t n);

F16Rows f16_rows() {
#if defined(H2O_X86_F16C)
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) {
        return f16_row_to_f32_f16c;
    }
#endif
    return f16_row_to_f32;
}

// One ranking layer's keys: the kept entries' (F32 rows of n_key) then the host entries' (the store's rows), as
// entries [0, n_kept + n_host).
struct LayerKeys {
    const KeyLayout & layout;
    const HostStore & store;
    const float *     kept;
    size_t            n_kept;
    int32_t           il;
    F16Rows           from_f16;

    size_t size() const { return n_kept + store.size(); }

    const uint8_t * host_row(size_t j) const {
        return store.kv().data() + (j - n_kept)*store.entry_bytes() + (size_t) il*layout.layer_bytes;
    }

    // the keys (every KV head's) of entries [j0, j0 + n) as n rows of n_key floats in out, zeros after them up to
    // kTileEntries rows; the next tile's rows asked of memory meanwhile (each entry's lie a page or more apart)
    void rows(size_t j0, size_t n, float * out) const {
        const size_t n_key = layout.n_key();
        const size_t key_bytes = n_key*(layout.type_k == GGML_TYPE_F32 ? 4 : 2);
        for (size_t j = std::max(j0 + kTileEntries, n_kept); j < std::min(j0 + 2*kTileEntries, size()); ++j) {
            for (size_t b = 0; b < key_bytes; b += 64) {
#if defined(__GNUC__)
                __builtin_prefetch(host_row(j) + b);
#endif
            }
        }
        for (size_t jj = 0; jj < n; ++jj) {
            const size_t j = j0 + jj;
            float * to = out + jj*n_key;
            if (j < n_kept) {
                std::copy_n(kept + j*n_key, n_key, to);
            } else if (layout.type_k == GGML_TYPE_F32) {
                std::copy_n((const float *) host_row(j), n_key, to);
            } else {
                from_f16((const uint16_t *) host_row(j), to, n_key);
            }
        }
        std::fill(out + n*n_key, out + kTileEntries*n_key, 0.0f);
    }
};

// The softmax of query rows against every key of a layer, entry-major: KV head g's rows are the columns
// [g*rp, (g + 1)*rp) of each entry's row of ld = n_head_kv*rp. The entries go in spans of kSpanTiles tiles, each
// span's logits turned into e^(logit - the span's max) while they are in the cache; the attention of column c to
// entry j of span s is then logits[j*ld + c]*factor[s*ld + c]. Columns past a head's rows are padding, read by nobody.
struct RowBlock {
    static constexpr size_t kSpanTiles = 64;
    static constexpr size_t kSpan = kSpanTiles*kTileEntries; // entries

    size_t             rp = 0; // columns of each KV head: its rows, padded to a multiple of kRowStep
    size_t             ld = 0;
    std::vector<float> logits;
    std::vector<float> factor; // [span][ld]: e^(the span's max - the column's max) / the column's sum

    // logits of each KV head's queries (qt: per head d rows of rp) against every entry's keys, then each column's
    // softmax over the entries
    void attend(const LayerKeys & keys, const std::vector<float> & qt, int32_t n_threads) {
        const size_t n_all = keys.size();
        const size_t n_spans = (n_all + kSpan - 1)/kSpan;
        logits.resize(n_all*ld);
        std::vector<float> top(n_spans*ld, -std::numeric_limits<float>::infinity());
        std::vector<float> total(n_spans*ld, 0.0f);
        parallel_parts(n_spans, n_threads, [&](size_t, size_t s0, size_t s1) {
            std::vector<float> key(kTileEntries*keys.layout.n_key());
            std::vector<float> tile(kTileEntries*ld);
            for (size_t s = s0; s < s1; ++s) {
                const size_t j0 = s*kSpan;
                const size_t n = std::min(kSpan, n_all - j0);
                for (size_t t = 0; t*kTileEntries < n; ++t) {
                    tile_rows(keys, qt, j0 + t*kTileEntries, std::min(kTileEntries, n - t*kTileEntries), key, tile);
                }
                max_into(logits.data() + j0*ld, n, ld, top.data() + s*ld);
                exp_rows(logits.data() + j0*ld, n, ld, top.data() + s*ld, total.data() + s*ld);
            }
        });
        std::vector<float> col_top(top.begin(), top.begin() + ld);
        max_into(top.data(), n_spans, ld, col_top.data());
        std::vector<float> col_total(ld, 0.0f);
        factor.assign(n_spans*ld, 0.0f);
        for (size_t s = 0; s < n_spans; ++s) {
            for (size_t c = 0; c < ld; ++c) {
                factor[s*ld + c] = exp_nonpositive(top[s*ld + c] - col_top[c]);
                col_total[c] += total[s*ld + c]*factor[s*ld + c];
            }
        }
        for (size_t s = 0; s < n_spans; ++s) {
            for (size_t c = 0; c < ld; ++c) {
                factor[s*ld + c] /= col_total[c];
            }
        }
    }

    // the logits of entries [j0, j0 + n) (n <= kTileEntries) into their rows
    void tile_rows(const LayerKeys & keys, const std::vector<float> & qt, size_t j0, size_t n, std::vector<float> & key,
                   std::vector<float> & tile) {
        const size_t d = (size_t) keys.layout.head_dim;
        keys.rows(j0, n, key.data());
        float * out = n == kTileEntries ? logits.data() + j0*ld : tile.data();
        for (size_t g = 0; g*rp < ld; ++g) {
            tile_logits(qt.data() + g*d*rp, rp, d, key.data() + g*d, keys.layout.n_key(), out + g*rp, ld);
        }
        if (out == tile.data()) {
            std::copy_n(tile.data(), n*ld, logits.data() + j0*ld);
        }
    }

    // the attention of columns [c0, c1) to entry j, summed
    float attention(size_t j, size_t c0, size_t c1) const {
        const float * p = logits.data() + j*ld;
        return std::inner_product(p + c0, p + c1, factor.data() + j/kSpan*ld + c0, 0.0f);
    }
};

} // namespace

std::vector<float> host_lift(const KeyLayout & layout, const Queries & queries,
                             const std::vector<std::vector<float>> & kept_keys, const HostStore & store,
                             int32_t n_threads) {
    const size_t n_host = store.size();
    const std::vector<int32_t> layers = ranking_layers(layout.n_layer);
    if (n_host == 0 || store.q8_0() || !queries.fits(layout) || kept_keys.size() != layers.size() ||
        store.entry_bytes() != layout.layer_bytes*layout.n_layer || store.scores().n_head != queries.n_head) {
        return {};
    }
    const size_t d = (size_t) layout.head_dim;
    const size_t n_key = layout.n_key();
    const size_t n_kv = (size_t) layout.n_head_kv;
    const size_t n_head = (size_t) queries.n_head;
    const size_t group = n_head / n_kv;
    const size_t n_tok = (size_t) queries.n_tokens;
    const size_t n_rows = group*n_tok; // a KV head's query rows: row r is head g*group + r/n_tok, token r%n_tok
    const float scale = 1.0f/std::sqrt((float) d);
    const F16Rows from_f16 = f16_rows();
    std::vector<float> sums(n_host*n_head, 0.0f); // [host entry][head]: attention summed over layers and queries
    RowBlock rb; // its logits' memory reused from layer to layer
    for (size_t li = 0; li < layers.size(); ++li) {
        if (kept_keys[li].size() % n_key != 0) {
            return {};
        }
        const LayerKeys keys{layout, store, kept_keys[li].data(), kept_keys[li].size()/n_key, layers[li], from_f16};
        const size_t n_all = keys.size();
        // as many of each KV head's rows at once as kLogitBytes of logits hold, whole steps of kRowStep
        const size_t fit = kLogitBytes/(n_all*n_kv*sizeof(float))/kRowStep*kRowStep;
        const size_t block = std::min(std::max(kRowStep, fit), (n_rows + kRowStep - 1)/kRowStep*kRowStep);
        for (size_t r0 = 0; r0 < n_rows; r0 += block) {
            const size_t nr = std::min(block, n_rows - r0);
            rb.rp = (nr + kRowStep - 1)/kRowStep*kRowStep;
            rb.ld = n_kv*rb.rp;
            std::vector<float> qt(n_kv*d*rb.rp, 0.0f); // each KV head's rows' queries, scaled, transposed: [g][e][r]
            for (size_t g = 0; g < n_kv; ++g) {
                for (size_t r = 0; r < nr; ++r) {
                    const size_t h = g*group + (r0 + r)/n_tok;
                    const float * src = queries.layers[li].data() + (((r0 + r)%n_tok)*n_head + h)*d;
                    for (size_t e = 0; e < d; ++e) {
                        qt[(g*d + e)*rb.rp + r] = src[e]*scale;
                    }
                }
            }
            rb.attend(keys, qt, n_threads);
            // each host entry's attention from each query head's rows of the block (each thread its own entries)
            struct HeadColumns {
                size_t h, c0, c1;
            };
            std::vector<HeadColumns> heads;
            for (size_t g = 0; g < n_kv; ++g) {
                for (size_t r = 0; r < nr;) {
                    const size_t h = g*group + (r0 + r)/n_tok;
                    const size_t r_end = std::min(nr, (h - g*group + 1)*n_tok - r0);
                    heads.push_back({h, g*rb.rp + r, g*rb.rp + r_end});
                    r = r_end;
                }
            }
            parallel_parts(n_host, n_threads, [&](size_t, size_t a, size_t b) {
                for (size_t j = a; j < b; ++j) {
                    for (const HeadColumns & hc : heads) {
                        sums[j*n_head + hc.h] += rb.attention(keys.n_kept + j, hc.c0, hc.c1);
                    }
                }
            });
        }
    }
    const std::vector<float> base = probe_baseline(store.scores()); // as observe_probe divides by it
    std::vector<float> lift(n_host, 0.0f);
    for (size_t i = 0; i < n_host; ++i) {
        for (size_t h = 0; h < n_head; ++h) {
            lift[i] = std::max(lift[i], sums[i*n_head + h]/(float) n_tok/base[i*n_head + h]);
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
