// SeqCache's per-head cells (HeadParts): each scored layer and KV head keeps its own entries inside the same
// cells; what the policy chooses per head, and the moves between cells that follow (llama_kv_heads_move).
#include "seq_cache.h"

#include "llama-attn-scores.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace h2o {

void SeqCache::init_parts() {
    const llama_model * model = llama_get_model(ctx_);
    HeadParts & hp = st_.parts;
    hp = HeadParts();
    hp.n_head_kv = llama_model_n_head_kv(model);
    for (int32_t il = 0; il < llama_model_n_layer(model); ++il) {
        const llama_pos * pos = nullptr;
        const float * sums = nullptr;
        if (llama_attn_scores_get_layer(ctx_, seq_, il, &pos, &sums) >= 0) {
            hp.layers.push_back(il);
        }
    }
    if (hp.layers.empty() || hp.n_head_kv < 1 || st_.scores.n_head % hp.n_head_kv != 0) {
        throw std::logic_error("no per-layer attention scores for sequence " + std::to_string(seq_));
    }
    // until now every cell held its own position everywhere; each part starts from its KV head's share of the
    // scores summed over layers (what a switch from a whole-token policy has), until it observes its own
    const int32_t group = st_.scores.n_head/hp.n_head_kv;
    const float per_layer = 1.0f/(float) hp.layers.size();
    const size_t n_parts = hp.layers.size()*hp.n_head_kv;
    std::vector<int32_t> cells(size());
    std::iota(cells.begin(), cells.end(), 0);
    hp.pos.assign(n_parts, st_.positions);
    hp.cell.assign(n_parts, cells);
    hp.scores.resize(n_parts);
    for (size_t k = 0; k < n_parts; ++k) {
        SeqScores & s = hp.scores[k];
        s.n_head  = group;
        s.queries = st_.scores.queries;
        s.total.assign(size(), 0.0f);
        s.probe.assign(size(), 0.0f);
        s.head.assign((size_t) size()*group, 0.0f);
        const int32_t h = (int32_t) (k % hp.n_head_kv);
        for (int32_t i = 0; i < size(); ++i) {
            for (int32_t g = 0; g < group; ++g) {
                const float v = st_.scores.head[(size_t) i*st_.scores.n_head + h*group + g]*per_layer;
                s.head[(size_t) i*group + g] = v;
                s.total[i] += v;
            }
        }
    }
}

void SeqCache::observe_heads(const Policy & policy, int32_t n_new, bool in_query_window) {
    if (st_.parts.empty()) {
        init_parts();
    }
    HeadParts & hp = st_.parts;
    const int32_t n_head = st_.scores.n_head;
    const int32_t group  = n_head/hp.n_head_kv; // query head j reads KV head j / group
    const int32_t n = size();
    std::vector<float> sums((size_t) n*group);
    for (size_t l = 0; l < hp.layers.size(); ++l) {
        const llama_pos * pos = nullptr;
        const float * layer_sums = nullptr;
        const int32_t got = llama_attn_scores_get_layer(ctx_, seq_, hp.layers[l], &pos, &layer_sums);
        if (got != n || !std::equal(st_.positions.begin(), st_.positions.end(), pos)) {
            throw std::logic_error("layer " + std::to_string(hp.layers[l]) + "'s attention scores of sequence " +
                                   std::to_string(seq_) + " do not cover its cells");
        }
        for (int32_t h = 0; h < hp.n_head_kv; ++h) {
            const size_t k = l*hp.n_head_kv + h;
            for (int32_t j = 0; j < n; ++j) { // the part's entries in position order, from the cells that hold them
                std::copy_n(layer_sums + (size_t) hp.cell[k][j]*n_head + h*group, group, sums.begin() + (size_t) j*group);
            }
            policy.observe(hp.scores[k], {sums.data(), n, group, n_new, in_query_window});
        }
    }
}

void SeqCache::evict_heads(const Policy & policy) {
    if (st_.parts.empty()) {
        init_parts(); // no decode observed under this policy yet (compress() after set_policy)
    }
    HeadParts & hp = st_.parts;
    const size_t n = st_.positions.size();
    const size_t n_parts = hp.pos.size();

    // each part's choice, over its entries in position order
    std::vector<std::vector<size_t>> keep(n_parts);
    std::vector<int32_t> n_kept_in(n, 0); // parts that keep what they hold in cell i
    for (size_t k = 0; k < n_parts; ++k) {
        keep[k] = select(policy, hp.pos[k], hp.scores[k], (size_t) st_.n_keep);
        if (keep[k].empty() || keep[k].back() != n - 1) {
            throw std::logic_error("policy '" + policy.name() + "' evicted the newest token");
        }
        for (const size_t j : keep[k]) {
            ++n_kept_in[hp.cell[k][j]];
        }
    }
    const size_t budget = keep[0].size();
    // the cells that stay: those most parts keep (every part keeps the newest cell and the protected prefix)
    std::vector<size_t> stay(n);
    std::iota(stay.begin(), stay.end(), 0);
    std::stable_sort(stay.begin(), stay.end(), [&](size_t a, size_t b) { return n_kept_in[a] > n_kept_in[b]; });
    stay.resize(budget);
    std::sort(stay.begin(), stay.end());
    std::vector<int32_t> new_index(n, -1); // a staying cell's index once the others are gone
    for (size_t i = 0; i < budget; ++i) {
        new_index[stay[i]] = (int32_t) i;
    }

    // in each part, what it keeps in a leaving cell moves into a staying cell whose part it evicts
    std::vector<int32_t> mv_layer, mv_head;
    std::vector<llama_pos> mv_src, mv_dst;
    std::vector<bool> holds(n);
    for (size_t k = 0; k < n_parts; ++k) {
        std::fill(holds.begin(), holds.end(), false);
        for (const size_t j : keep[k]) {
            holds[hp.cell[k][j]] = true;
        }
        size_t hole = 0;
        keep_rows(hp.cell[k], 1, keep[k]);
        keep_rows(hp.pos[k], 1, keep[k]);
        hp.scores[k].keep_only(keep[k]);
        for (auto & c : hp.cell[k]) {
            if (new_index[c] < 0) {
                while (holds[stay[hole]]) {
                    ++hole;
                }
                holds[stay[hole]] = true;
                mv_layer.push_back(hp.layers[k/hp.n_head_kv]);
                mv_head.push_back((int32_t) (k % hp.n_head_kv));
                mv_src.push_back(st_.positions[c]);
                mv_dst.push_back(st_.positions[stay[hole]]);
                c = (int32_t) stay[hole];
            }
            c = new_index[c];
        }
    }
    st_.n_head_moves += (int64_t) mv_src.size();
    if (!mv_src.empty()) {
        const int32_t rc = llama_kv_head_move(ctx_, seq_, (int32_t) mv_src.size(), mv_layer.data(), mv_head.data(),
                                              mv_src.data(), mv_dst.data());
        if (rc != 0) {
            throw std::runtime_error("llama_kv_head_move failed with status " + std::to_string(rc));
        }
    }

    keep_entries(stay);
    st_.n_evicted += (int64_t) (n - budget);
}

} // namespace h2o
