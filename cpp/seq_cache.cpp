#include "seq_cache.h"

#include <algorithm>
#include <stdexcept>

namespace h2o {

SeqCache::SeqCache(llama_context * ctx, llama_seq_id seq, int32_t n_head)
    : ctx_(ctx), mem_(llama_get_memory(ctx)), seq_(seq) {
    st_.scores.n_head = n_head;
}

void SeqCache::append(int32_t n_new) {
    for (int32_t i = 0; i < n_new; ++i) {
        st_.positions.push_back(st_.next_pos + i);
    }
    SeqScores & s = st_.scores;
    // every old entry is attended by the n_new queries, new token i by the n_new - i from itself on (causal)
    for (auto & q : s.queries) {
        q += n_new;
    }
    for (int32_t i = 0; i < n_new; ++i) {
        s.queries.push_back(n_new - i);
    }
    s.total.resize(st_.positions.size(), 0.0f);
    s.head.resize(st_.positions.size()*s.n_head, 0.0f);
    st_.next_pos  += n_new;
    st_.n_seen    += n_new;
    st_.peak_cells = std::max(st_.peak_cells, size());
}

void SeqCache::observe(const Policy & policy, const llama_pos * pos, const float * head_sums, int32_t n, int32_t n_new,
                       bool window) {
    if (n != size() || !std::equal(st_.positions.begin(), st_.positions.end(), pos)) {
        throw std::logic_error("attention scores of sequence " + std::to_string(seq_) + " cover " + std::to_string(n) +
                               " positions, the engine tracks " + std::to_string(size()));
    }
    policy.observe(st_.scores, {head_sums, n, st_.scores.n_head, n_new, window});
}

void SeqCache::evict(const Policy & policy, bool rolling, int32_t roll_interval) {
    const size_t n = st_.positions.size();
    if (!policy.bounded() || n <= (size_t) policy.split().total()) {
        return;
    }

    const std::vector<size_t> keep = policy.keep(st_.positions, st_.scores);
    std::vector<bool> kept(n, false);
    for (const size_t k : keep) {
        kept[k] = true;
    }
    if (!kept[n - 1]) {
        throw std::logic_error("policy '" + policy.name() + "' evicted the newest token");
    }

    // remove the evicted positions in runs: positions between two kept ones are exactly the run's
    for (size_t i = 0; i < n; ) {
        if (kept[i]) {
            ++i;
            continue;
        }
        size_t e = i;
        while (e + 1 < n && !kept[e + 1]) {
            ++e;
        }
        llama_memory_seq_rm(mem_, seq_, st_.positions[i], st_.positions[e] + 1);
        i = e + 1;
    }

    const SeqScores & s = st_.scores;
    const size_t n_head = s.n_head;
    std::vector<llama_pos> positions;
    SeqScores kept_scores;
    kept_scores.n_head = s.n_head;
    positions.reserve(keep.size());
    kept_scores.total.reserve(keep.size());
    kept_scores.head.reserve(keep.size()*n_head);
    kept_scores.queries.reserve(keep.size());
    for (const size_t k : keep) {
        positions.push_back(st_.positions[k]);
        kept_scores.total.push_back(s.total[k]);
        kept_scores.head.insert(kept_scores.head.end(), s.head.begin() + k*n_head, s.head.begin() + (k + 1)*n_head);
        kept_scores.queries.push_back(s.queries[k]);
    }
    st_.positions.swap(positions);
    st_.scores = std::move(kept_scores);
    st_.n_evicted += (int64_t) (n - keep.size());

    // a K shift rotates every cached key in every layer: deferring it keeps positions below budget + interval
    if (rolling && st_.next_pos - (llama_pos) st_.positions.size() >= roll_interval) {
        roll_positions();
    }
}

void SeqCache::roll_positions() {
    auto & p = st_.positions;
    const size_t n = p.size();

    // runs of consecutive positions move by the same delta; ascending order never collides
    for (size_t a = 0; a < n; ) {
        size_t b = a;
        while (b + 1 < n && p[b + 1] == p[b] + 1) {
            ++b;
        }
        const llama_pos delta = (llama_pos) a - p[a];
        if (delta != 0) {
            llama_memory_seq_add(mem_, seq_, p[a], p[b] + 1, delta);
        }
        a = b + 1;
    }
    for (size_t i = 0; i < n; ++i) {
        p[i] = (llama_pos) i;
    }
    st_.next_pos = (llama_pos) n;
}

void SeqCache::drop_unfinished() {
    llama_memory_seq_rm(mem_, seq_, st_.next_pos, -1);
}

void SeqCache::clear() {
    llama_memory_seq_rm(mem_, seq_, -1, -1);
    const int32_t n_head = st_.scores.n_head;
    st_ = SeqState();
    st_.scores.n_head = n_head;
}

std::vector<uint8_t> SeqCache::save_kv() const {
    std::vector<uint8_t> kv(llama_state_seq_get_size(ctx_, seq_));
    kv.resize(llama_state_seq_get_data(ctx_, kv.data(), kv.size(), seq_));
    return kv;
}

bool SeqCache::restore(const std::vector<uint8_t> & kv, const SeqState & state) {
    clear();
    if (!kv.empty() && llama_state_seq_set_data(ctx_, kv.data(), kv.size(), seq_) == 0) {
        return false;
    }
    st_ = state;
    return true;
}

} // namespace h2o
