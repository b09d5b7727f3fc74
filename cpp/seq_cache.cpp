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

void SeqCache::observe_probe(const Policy & policy, const std::vector<float> & head_sums, int32_t n_queries,
                             bool keep_best) {
    if (head_sums.size() != (size_t) size()*st_.scores.n_head) {
        throw std::logic_error("probe scores of sequence " + std::to_string(seq_) + " do not cover its entries");
    }
    std::vector<float> & probe = st_.scores.probe;
    for (float & v : probe) { // the lift itself for the probe's max
        v = std::fabs(v);
    }
    h2o::observe_probe(st_.scores, head_sums.data(), n_queries, keep_best);
    const auto * ranked = dynamic_cast<const RankedPolicy *>(&policy);
    if (ranked == nullptr || ranked->options().reply <= 0) {
        return;
    }
    for (size_t i = 0; i < probe.size(); ++i) {
        if (st_.positions[i] >= reply_from_ && st_.positions[i] < reply_to_) {
            probe[i] = -std::max(probe[i], std::numeric_limits<float>::min());
        }
    }
}

void SeqCache::note_feed(size_t n, int32_t question) {
    if (n == 1) {
        generated_from_ = generated_from_ < 0 ? st_.next_pos : generated_from_;
        return;
    }
    llama_pos from = generated_from_;
    if (from < 0 && reply_to_ < 0) {
        // not seen here (a sequence restored from a snapshot): the answer is the newest entries no probe judged
        // (generation's single tokens run none), when an older one was judged
        size_t i = st_.positions.size();
        while (i > 0 && st_.scores.probe[i - 1] == 0.0f) {
            --i;
        }
        from = i > 0 && i < st_.positions.size() ? st_.positions[i] : -1;
    }
    if (from >= 0) {
        reply_from_ = std::max<llama_pos>(0, from - std::max(question, 0));
        reply_to_ = st_.next_pos;
    }
    generated_from_ = -1;
}

void SeqCache::evict(const Policy & policy, bool rolling, int32_t roll_interval) {
    const size_t n = st_.positions.size();
    if (!policy.bounded() || n <= (size_t) policy.split().total()) {
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
    const std::vector<size_t> keep = select(policy, st_.positions, st_.scores, (size_t) st_.n_keep);
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
    if (rolling && st_.next_pos - (llama_pos) st_.positions.size() >= roll_interval) {
        roll_positions();
    }
}

void SeqCache::set_spill(int64_t cap, bool q8) {
    check_policy(cap >= 0, "the host store's cap must be >= 0 entries, got " + std::to_string(cap));
    spill_cap_ = cap;
    spill_q8_  = q8;
    if (cap == 0) {
        host_ = HostStore();
        return;
    }
    const size_t raw_bytes = llama_kv_entry_size(ctx_);
    check_policy(raw_bytes > 0, "this model's KV cache cannot keep evicted entries apart (SWA layers, or no KV "
                                "cache): recall is not available");
    host_.set_encoding(q8, raw_bytes);
    host_.scores.n_head = st_.scores.n_head;
}

void SeqCache::spill(const std::vector<size_t> & indices) {
    const size_t n = indices.size();
    if (n == 0) {
        return;
    }
    const std::vector<llama_pos> pos = gather_rows(st_.positions, 1, indices);
    const size_t raw_bytes = llama_kv_entry_size(ctx_);
    std::vector<uint8_t> rows(n*raw_bytes);
    const int32_t rc = llama_kv_entries_get(ctx_, seq_, (int32_t) n, pos.data(), rows.data());
    if (rc != 0) {
        throw std::runtime_error("llama_kv_entries_get failed with status " + std::to_string(rc));
    }
    host_.spill(pos, gather_rows(st_.tokens, 1, indices), st_.scores.gather(indices), rows, raw_bytes,
                (size_t) spill_cap_);
}

void SeqCache::set_host(const HostStore & host) {
    const size_t raw_bytes = llama_kv_entry_size(ctx_);
    host_ = HostStore::adopted(host, raw_bytes, st_.scores.n_head);
    if (host_.size() > 0 || spill_cap_ > 0) {
        host_.set_encoding(spill_q8_, raw_bytes);
    }
}

void SeqCache::readmit(const std::vector<size_t> & indices) {
    const size_t n = indices.size();
    if (n == 0) {
        return;
    }
    const HostStore::Entries taken = host_.entries(indices, llama_kv_entry_size(ctx_));
    const std::vector<llama_pos> & pos = taken.positions;
    const std::vector<llama_token> & toks = taken.tokens;
    const int32_t rc = llama_kv_entries_put(ctx_, seq_, (int32_t) n, pos.data(), toks.data(), taken.raw.data());
    if (rc != 0) {
        throw std::runtime_error("llama_kv_entries_put failed with status " + std::to_string(rc) +
                                 (rc == -3 ? " (no free cells for the recalled entries)" : ""));
    }
    forget_keys();
    // merged in position order with the kept entries
    std::vector<llama_pos> all = st_.positions;
    all.insert(all.end(), pos.begin(), pos.end());
    std::vector<size_t> order(all.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return all[a] < all[b]; });
    std::vector<llama_token> all_tokens = st_.tokens;
    all_tokens.insert(all_tokens.end(), toks.begin(), toks.end());
    st_.positions = gather_rows(all, 1, order);
    st_.tokens    = gather_rows(all_tokens, 1, order);
    st_.scores.extend(taken.scores);
    st_.scores    = st_.scores.gather(order);
    st_.peak_cells = std::max(st_.peak_cells, size());
    host_.remove(indices);
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
    st_.tokens    = gather_rows(st_.tokens, 1, keep);
    st_.scores    = st_.scores.gather(keep);
}

std::vector<size_t> SeqCache::select(const Policy & policy, const std::vector<llama_pos> & positions,
                                     const SeqScores & scores, size_t n_keep) {
    n_keep = std::min(n_keep, positions.size());
    if (n_keep == 0) {
        return policy.select(positions, scores, policy.split());
    }
    // the policy decides over the entries after the prefix, within what the prefix leaves of the budget
    std::vector<size_t> after(positions.size() - n_keep);
    std::iota(after.begin(), after.end(), n_keep);
    const std::vector<llama_pos> tail = gather_rows(positions, 1, after);

    std::vector<size_t> keep(n_keep);
    std::iota(keep.begin(), keep.end(), 0);
    for (const size_t k : policy.select(tail, scores.gather(after), policy.split().after_prefix((int32_t) n_keep))) {
        keep.push_back(n_keep + k);
    }
    return keep;
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

void SeqCache::drop_newest(int32_t n) {
    const size_t kept = st_.positions.size() - (size_t) n;
    llama_memory_seq_rm(mem_, seq_, st_.positions[kept], -1);
    std::vector<size_t> older(kept);
    std::iota(older.begin(), older.end(), 0);
    st_.positions.resize(kept);
    st_.tokens.resize(kept);
    st_.scores    = st_.scores.gather(older);
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
    forget_keys();
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
    const size_t entry_bytes = host_.entry_bytes;
    host_ = HostStore();
    host_.entry_bytes = entry_bytes;
    host_.scores.n_head = n_head;
    generated_from_ = reply_from_ = reply_to_ = -1;
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
    generated_from_ = reply_from_ = reply_to_ = -1;
    return true;
}

} // namespace h2o
