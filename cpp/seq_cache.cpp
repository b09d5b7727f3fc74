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

SeqCache::SeqCache(llama_context * ctx, llama_seq_id seq, int32_t n_head)
    : ctx_(ctx), mem_(llama_get_memory(ctx)), seq_(seq) {
    st_.scores.n_head = n_head;
}

void SeqCache::append(const std::vector<llama_token> & tokens) {
    const int32_t n_new = (int32_t) tokens.size();
    for (int32_t i = 0; i < n_new; ++i) {
        st_.positions.push_back(st_.next_pos + i);
        st_.origins.push_back((llama_pos) (st_.n_seen + i));
    }
    st_.tokens.insert(st_.tokens.end(), tokens.begin(), tokens.end());
    st_.scores.append(n_new);
    for (size_t k = 0; k < st_.parts.pos.size(); ++k) { // new entries: the newest positions, in new cells
        for (int32_t i = 0; i < n_new; ++i) {
            st_.parts.pos[k].push_back(st_.next_pos + i);
            st_.parts.cell[k].push_back(size() - n_new + i);
        }
        st_.parts.scores[k].append(n_new);
    }
    st_.next_pos  += n_new;
    st_.n_seen    += n_new;
    st_.peak_cells = std::max(st_.peak_cells, size());
}

void SeqCache::observe(const Policy & policy, const llama_pos * pos, const float * head_sums, int32_t n, int32_t n_new,
                       bool in_query_window, bool add_to_baseline) {
    if (n != size() || !std::equal(st_.positions.begin(), st_.positions.end(), pos)) {
        throw std::logic_error("attention scores of sequence " + std::to_string(seq_) + " cover " + std::to_string(n) +
                               " positions, the engine tracks " + std::to_string(size()));
    }
    policy.observe(st_.scores, {head_sums, n, st_.scores.n_head, n_new, in_query_window});
    if (policy.probe().source != ProbeSource::none) {
        auto & seen = st_.scores.seen;
        seen.resize((size_t) n*st_.scores.n_head, 0.0f); // entries since the last observation start from nothing
        if (add_to_baseline) {
            for (size_t i = 0; i < seen.size(); ++i) {
                seen[i] += head_sums[i];
            }
        } else {
            // these queries are left out: each older entry's mean per query stays that of the others
            const int32_t n_head = st_.scores.n_head;
            for (int32_t i = 0; i < n - n_new; ++i) {
                const int64_t q = st_.scores.queries[i];
                const float scale = q > n_new ? (float) q/(float) (q - n_new) : 0.0f;
                for (int32_t h = 0; h < n_head; ++h) {
                    seen[(size_t) i*n_head + h] *= scale;
                }
            }
        }
    }
}

void SeqCache::observe_probe(const Policy & policy, const std::vector<float> & head_sums, int32_t n_queries,
                             bool keep_best) {
    if (head_sums.size() != (size_t) size()*st_.scores.n_head) {
        throw std::logic_error("probe scores of sequence " + std::to_string(seq_) + " do not cover its entries");
    }
    h2o::observe_probe(st_.scores, head_sums.data(), n_queries, keep_best);
    std::vector<uint8_t> & reply = st_.scores.reply;
    if (!policy.keeps_reply()) {
        reply.clear();
        return;
    }
    reply.assign(st_.origins.size(), 0);
    for (size_t i = 0; i < reply.size(); ++i) {
        reply[i] = st_.origins[i] >= exchange_.reply_from && st_.origins[i] < exchange_.reply_to;
    }
}

void SeqCache::note_feed(size_t n, int32_t question) {
    Exchange & ex = exchange_;
    if (n == 1) {
        ex.generated_from = ex.generated_from < 0 ? (llama_pos) st_.n_seen : ex.generated_from;
        return;
    }
    llama_pos from = ex.generated_from;
    if (from < 0 && ex.reply_to < 0) {
        // not seen here (a sequence restored from a snapshot): the answer is the newest entries no probe judged
        // (generation's single tokens run none), when an older one was judged
        size_t i = st_.positions.size();
        while (i > 0 && st_.scores.probe[i - 1] == 0.0f) {
            --i;
        }
        from = i > 0 && i < st_.origins.size() ? st_.origins[i] : -1;
    }
    if (from >= 0) {
        ex.reply_from = std::max<llama_pos>(0, from - std::max(question, 0));
        ex.reply_to = (llama_pos) st_.n_seen;
    }
    ex.generated_from = -1;
}

void SeqCache::evict(const Policy & policy, const RollRule & roll, int32_t incoming) {
    const size_t n = st_.positions.size();
    if (!policy.bounded()) {
        return;
    }
    if (n <= (size_t) policy.split().total()) {
        if (roll.after > 0 && roll.due(st_)) { // near the trained context, with or without an eviction
            roll_positions();
        }
        return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    struct AddTime {
        double & total;
        std::chrono::steady_clock::time_point t0;
        ~AddTime() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
    } add_time {st_.evict_seconds, t0};

    if (policy.per_head()) {
        evict_heads(policy);
        return;
    }
    if (policy.needs_keys()) {
        observe_keys(policy);
    }
    const std::vector<size_t> keep = select(policy, policy.split_before(incoming), st_.positions, st_.scores,
                                            (size_t) st_.n_keep);
    if (!std::is_sorted(keep.begin(), keep.end()) || std::adjacent_find(keep.begin(), keep.end()) != keep.end() ||
        keep.empty() || keep.back() >= n) {
        throw std::logic_error("policy '" + policy.name() + "' chose entries that are not ascending indices");
    }
    if (keep.back() != n - 1) {
        throw std::logic_error("policy '" + policy.name() + "' evicted the newest token");
    }

    keep_entries(keep);
    if (key_rows_ == n && !keys_.empty()) {
        for (auto & rows : keys_) {
            rows = gather_rows(rows, rows.size()/n, keep);
        }
        key_rows_ = keep.size();
    } else {
        forget_keys();
    }
    st_.n_evicted += (int64_t) (n - keep.size());

    // a K shift rotates every cached key in every layer: deferring it keeps positions below budget + interval
    if (roll.due(st_)) {
        roll_positions();
    }
}

void SeqCache::keep_entries(const std::vector<size_t> & keep) {
    // the others' cells go in runs: positions between two kept ones are exactly the run's
    const size_t n = st_.positions.size();
    if (spill_cap_ > 0) {
        std::vector<size_t> evicted;
        for (size_t k = 0, i = 0; i < n; ++i) {
            if (k < keep.size() && keep[k] == i) {
                ++k;
            } else {
                evicted.push_back(i);
            }
        }
        spill(evicted);
    }
    for (size_t k = 0, i = 0; i < n; ) {
        if (k < keep.size() && keep[k] == i) {
            ++k;
            ++i;
            continue;
        }
        const size_t e = k < keep.size() ? keep[k] : n; // the run ends before the next kept entry
        llama_memory_seq_rm(mem_, seq_, st_.positions[i], st_.positions[e - 1] + 1);
        i = e;
    }
    st_.positions = gather_rows(st_.positions, 1, keep);
    st_.origins   = gather_rows(st_.origins, 1, keep);
    st_.tokens    = gather_rows(st_.tokens, 1, keep);
    st_.scores    = st_.scores.gather(keep);
}

bool SeqCache::rolled() const {
    return st_.positions != st_.origins || host_.positions() != host_.origins();
}

std::vector<size_t> SeqCache::select(const Policy & policy, const std::vector<llama_pos> & positions,
                                     const SeqScores & scores, size_t n_keep) {
    return select(policy, policy.split(), positions, scores, n_keep);
}

std::vector<size_t> SeqCache::select(const Policy & policy, const BudgetSplit & split,
                                     const std::vector<llama_pos> & positions, const SeqScores & scores, size_t n_keep) {
    n_keep = std::min(n_keep, positions.size());
    if (n_keep == 0) {
        return policy.select(positions, scores, split);
    }
    // the policy decides over the entries after the prefix, within what the prefix leaves of the budget
    std::vector<size_t> after(positions.size() - n_keep);
    std::iota(after.begin(), after.end(), n_keep);
    const std::vector<llama_pos> tail = gather_rows(positions, 1, after);

    std::vector<size_t> keep(n_keep);
    std::iota(keep.begin(), keep.end(), 0);
    for (const size_t k : policy.select(tail, scores.gather(after), split.after_prefix((int32_t) n_keep))) {
        keep.push_back(n_keep + k);
    }
    return keep;
}

void SeqCache::observe_keys(const Policy & policy) {
    const llama_model * model = llama_get_model(ctx_);
    const size_t n = st_.positions.size();
    if (key_rows_ > n) {
        forget_keys();
    }
    const llama_pos p_min = key_rows_ == 0 ? std::numeric_limits<llama_pos>::min() : st_.positions[key_rows_ - 1] + 1;
    const bool fresh = keys_.empty();
    KeyView view;
    view.n_head_kv = llama_model_n_head_kv(model);
    for (int32_t il = 0; il < llama_model_n_layer(model); ++il) {
        const llama_pos * pos = nullptr;
        const float * keys = nullptr;
        int32_t n_embd = 0;
        const int32_t n_new = llama_attn_keys_get(ctx_, seq_, il, p_min, &pos, &n_embd, &keys);
        if (n_new < 0) {
            continue; // a layer that reads another layer's cache
        }
        if (fresh) {
            keys_.emplace_back();
        }
        if ((size_t) view.layer >= keys_.size() || key_rows_ + (size_t) n_new != n ||
            !std::equal(pos, pos + n_new, st_.positions.begin() + key_rows_)) {
            forget_keys();
            throw std::logic_error("the cached keys of sequence " + std::to_string(seq_) + " do not match its positions");
        }
        auto & rows = keys_[view.layer];
        rows.insert(rows.end(), keys, keys + (size_t) n_new*n_embd);
        view.keys = rows.data();
        view.n = (int32_t) n;
        view.head_dim = n_embd / view.n_head_kv;
        policy.observe_keys(st_.scores, view);
        ++view.layer;
    }
    key_rows_ = n;
}

void SeqCache::roll_positions() {
    forget_keys(); // the K shift at the next decode rotates every key
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

void SeqCache::set_keep(const Policy & policy, int32_t n) {
    check_policy(n >= 0, "keep must be >= 0 tokens, got " + std::to_string(n));
    if (policy.bounded()) {
        policy.split().after_prefix(n); // checks that it fits
    }
    st_.n_keep = n;
}

std::vector<size_t> SeqCache::keep_oldest(size_t kept) {
    if (kept < st_.positions.size()) {
        llama_memory_seq_rm(mem_, seq_, st_.positions[kept], -1);
    }
    std::vector<size_t> older(kept);
    std::iota(older.begin(), older.end(), 0);
    st_.positions.resize(kept);
    st_.origins.resize(kept);
    st_.tokens.resize(kept);
    st_.scores = st_.scores.gather(older);
    forget_keys();
    return older;
}

void SeqCache::drop_newest(int32_t n) {
    const std::vector<size_t> older = keep_oldest(st_.positions.size() - (size_t) n);
    const size_t kept = older.size();
    for (auto & q : st_.scores.queries) {
        q -= n; // the removed tokens' queries are not counted
    }
    for (size_t k = 0; k < st_.parts.pos.size(); ++k) { // the newest entries, last in every part, in the newest cells
        st_.parts.pos[k].resize(kept);
        st_.parts.cell[k].resize(kept);
        st_.parts.scores[k] = st_.parts.scores[k].gather(older);
        for (auto & q : st_.parts.scores[k].queries) {
            q -= n;
        }
    }
    st_.next_pos -= n;
    st_.n_seen   -= n;
}

void SeqCache::truncate(int64_t n) {
    if (n < 0 || n > st_.n_seen) {
        throw std::invalid_argument("cannot go back to token " + std::to_string(n) + ": the sequence was fed " +
                                    std::to_string(st_.n_seen));
    }
    if (!st_.parts.empty()) {
        throw std::invalid_argument("a sequence of per-head cells cannot be truncated");
    }
    if (n == st_.n_seen) {
        return;
    }
    const bool was_rolled = rolled();
    size_t kept = st_.origins.size();
    while (kept > 0 && st_.origins[kept - 1] >= n) { // fed from n on: the newest entries, the highest positions
        --kept;
    }
    keep_oldest(kept);
    host_.keep_before((llama_pos) n);
    st_.n_seen = n;
    // never rolled: the next token takes its own position again; rolled: the one after the newest kept
    st_.next_pos = !was_rolled ? (llama_pos) n : kept > 0 ? st_.positions.back() + 1 : 0;
    exchange_ = Exchange();
}

void SeqCache::drop_unfinished() {
    forget_keys();
    llama_memory_seq_rm(mem_, seq_, st_.next_pos, -1);
}

void SeqCache::roll_back(const SeqState & before) {
    forget_keys();
    llama_memory_seq_rm(mem_, seq_, before.next_pos, -1);
    st_ = before;
}

void SeqCache::clear() {
    forget_keys();
    llama_memory_seq_rm(mem_, seq_, -1, -1);
    const int32_t n_head = st_.scores.n_head;
    st_ = SeqState();
    st_.scores.n_head = n_head;
    host_ = host_.empty_like();
    host_.set_heads(n_head);
    exchange_ = Exchange();
}

std::vector<uint8_t> SeqCache::save_kv() const {
    llama_memory_update(ctx_); // a K-shift left by rolling goes into the keys first (the state holds shifted positions)
    std::vector<uint8_t> kv(llama_state_seq_get_size(ctx_, seq_));
    kv.resize(llama_state_seq_get_data(ctx_, kv.data(), kv.size(), seq_));
    return kv;
}

bool SeqCache::restore(const std::vector<uint8_t> & kv, const SeqState & state) {
    HostStore host = std::move(host_); // the cells and their bookkeeping change, not what was spilled
    clear();
    host_ = std::move(host);
    if (!kv.empty() && llama_state_seq_set_data(ctx_, kv.data(), kv.size(), seq_) == 0) {
        return false;
    }
    st_ = state;
    exchange_ = Exchange();
    return true;
}

// The kept entries are taken out (a few copies per layer, whatever their cells: llama_state_seq_get_data copies each
// run of cells apart, a transfer each on a device), their cells freed, and put back at their own positions in the
// lowest free cells. A cache whose entries cannot be taken apart (SWA layers) saves and restores the sequence.
bool SeqCache::compact_cells() {
    llama_memory_update(ctx_); // a K-shift left by rolling goes into the keys first
    const size_t entry = llama_kv_entry_size(ctx_);
    const int32_t n = (int32_t) st_.positions.size();
    std::vector<uint8_t> kv((size_t) n*entry);
    if (entry == 0 || llama_kv_entries_get(ctx_, seq_, n, st_.positions.data(), kv.data()) != 0) {
        const SeqState state = st_;
        const Exchange exchange = exchange_;
        if (!restore(save_kv(), state)) {
            return false;
        }
        exchange_ = exchange;
        return true;
    }
    forget_keys();
    llama_memory_seq_rm(mem_, seq_, -1, -1);
    return llama_kv_entries_put(ctx_, seq_, n, st_.positions.data(), st_.tokens.data(), kv.data()) == 0;
}

} // namespace h2o
