// SeqCache's recall: what it evicts goes to its HostStore (spill), and a later prompt brings entries back into
// the cache at their own positions (readmit).
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
    host_.set_heads(st_.scores.n_head);
}

void SeqCache::spill(const std::vector<size_t> & indices) {
    const size_t n = indices.size();
    if (n == 0) {
        return;
    }
    const std::vector<llama_pos> pos = gather_rows(st_.positions, 1, indices);
    const size_t raw_bytes = llama_kv_entry_size(ctx_);
    std::vector<uint8_t> rows(n*raw_bytes);
    llama_memory_update(ctx_); // the keys as their positions say (a roll's K shift may be pending)
    const int32_t rc = llama_kv_entries_get(ctx_, seq_, (int32_t) n, pos.data(), rows.data());
    if (rc != 0) {
        throw std::runtime_error("llama_kv_entries_get failed with status " + std::to_string(rc));
    }
    host_.spill(pos, gather_rows(st_.origins, 1, indices), gather_rows(st_.tokens, 1, indices),
                st_.scores.gather(indices), rows, raw_bytes, (size_t) spill_cap_);
}

void SeqCache::set_host(const HostStore & host) {
    const size_t raw_bytes = llama_kv_entry_size(ctx_);
    host_ = HostStore::adopted(host, raw_bytes, st_.scores.n_head);
    if (host_.size() > 0 || spill_cap_ > 0) {
        host_.set_encoding(spill_q8_, raw_bytes);
    }
}

HostStore::Entries SeqCache::take_reread(const std::vector<size_t> & indices) {
    const size_t n = indices.size();
    std::vector<llama_pos> pos(st_.positions.end() - (std::ptrdiff_t) n, st_.positions.end());
    const std::vector<llama_pos> orig = gather_rows(host_.text_origins(), 1, indices);
    // runs of consecutive places, [a, b) of the decoded entries each
    std::vector<std::pair<size_t, size_t>> runs;
    for (size_t a = 0, b = 1; a < n; a = b++) {
        while (b < n && orig[b] == orig[b - 1] + 1) {
            ++b;
        }
        runs.emplace_back(a, b);
    }
    const bool moved = !rolled();
    if (moved) {
        // never rolled: each entry's position is its place, so the decoded keys move there (free places: the store
        // dropped what held them), a run at a time
        for (const auto & [a, b] : runs) {
            llama_memory_seq_add(mem_, seq_, pos[a], pos[b - 1] + 1, orig[a] - pos[a]);
        }
        pos = orig;
    }
    llama_memory_update(ctx_);
    std::vector<uint8_t> rows(n*llama_kv_entry_size(ctx_));
    const int32_t rc = llama_kv_entries_get(ctx_, seq_, (int32_t) n, pos.data(), rows.data());
    for (size_t r = 0; moved && r < runs.size(); ++r) { // below the newest position: drop_newest would not find them
        llama_memory_seq_rm(mem_, seq_, orig[runs[r].first], orig[runs[r].second - 1] + 1);
    }
    drop_newest((int32_t) n);
    if (rc != 0) {
        throw std::runtime_error("llama_kv_entries_get failed with status " + std::to_string(rc));
    }
    return host_.take_text(indices, std::move(pos), std::move(rows));
}

std::vector<llama_pos> SeqCache::recall_candidates(const Queries & queries, size_t limit, int32_t n_threads) {
    if (!ranks_host() || !queries.fits(layout_)) {
        return {};
    }
    llama_memory_update(ctx_); // the kept keys as their positions say
    std::vector<std::vector<float>> kept;
    for (const int32_t il : ranking_layers(layout_.n_layer)) {
        const llama_pos * pos = nullptr;
        const float * keys = nullptr;
        int32_t n_embd = 0;
        const int32_t n = llama_attn_keys_get(ctx_, seq_, il, std::numeric_limits<llama_pos>::min(), &pos, &n_embd, &keys);
        if (n < 0 || (size_t) n_embd != layout_.n_key()) {
            return {};
        }
        kept.emplace_back(keys, keys + (size_t) n*n_embd);
    }
    return best_blocks(host_.origins(), host_lift(layout_, queries, kept, host_, n_threads), limit);
}

HostStore::Entries SeqCache::take_host(const std::vector<size_t> & indices) {
    return host_.take(indices, llama_kv_entry_size(ctx_));
}

void SeqCache::put_back_host(const HostStore::Entries & e) {
    host_.put_back(e, llama_kv_entry_size(ctx_));
}

void SeqCache::readmit(const HostStore::Entries & taken) {
    const size_t n = taken.size();
    if (n == 0) {
        return;
    }
    forget_keys();
    if (rolled()) {
        readmit_renumbered(taken);
        return;
    }
    const std::vector<llama_pos> & pos = taken.positions;
    const std::vector<llama_token> & toks = taken.tokens;
    const int32_t rc = llama_kv_entries_put(ctx_, seq_, (int32_t) n, pos.data(), toks.data(), taken.raw.data());
    if (rc != 0) {
        throw std::runtime_error("llama_kv_entries_put failed with status " + std::to_string(rc) +
                                 (rc == -3 ? " (no free cells for the recalled entries)" : ""));
    }
    merge(taken);
}

std::vector<size_t> SeqCache::merge(const HostStore::Entries & taken) {
    // merged in the conversation's order with the kept entries (positions too, where the sequence never rolled)
    std::vector<llama_pos> all = st_.origins;
    all.insert(all.end(), taken.origins.begin(), taken.origins.end());
    std::vector<size_t> order(all.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return all[a] < all[b]; });
    std::vector<llama_pos> all_pos = st_.positions;
    all_pos.insert(all_pos.end(), taken.positions.begin(), taken.positions.end());
    std::vector<llama_token> all_tokens = st_.tokens;
    all_tokens.insert(all_tokens.end(), taken.tokens.begin(), taken.tokens.end());
    st_.positions = gather_rows(all_pos, 1, order);
    st_.origins   = gather_rows(all, 1, order);
    st_.tokens    = gather_rows(all_tokens, 1, order);
    st_.scores.extend(taken.scores);
    st_.scores    = st_.scores.gather(order);
    st_.peak_cells = std::max(st_.peak_cells, size());
    return order;
}

// Every entry goes to its rank in the conversation's order: the kept ones by llama.cpp's shift of position ranges,
// the returning ones put where their keys were rotated for and shifted each by its own delta. Positions collide on
// the way (a returning key may have been rotated for a position a kept entry holds now, and two returning ones for
// the same one), so everything passes through a range above every position in use; llama.cpp adds up each cell's
// shifts and rotates its key once, by the net delta, at the next update.
void SeqCache::readmit_renumbered(const HostStore::Entries & taken) {
    const size_t n_kept = st_.positions.size();
    const size_t n_back = taken.positions.size();
    std::vector<llama_pos> rank(n_kept + n_back);
    {
        std::vector<llama_pos> all = st_.origins;
        all.insert(all.end(), taken.origins.begin(), taken.origins.end());
        std::vector<size_t> order(all.size());
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return all[a] < all[b]; });
        for (size_t r = 0; r < order.size(); ++r) {
            rank[order[r]] = (llama_pos) r;
        }
    }
    llama_pos high = std::max<llama_pos>(st_.next_pos, (llama_pos) rank.size());
    for (const llama_pos p : taken.positions) {
        high = std::max(high, p + 1);
    }
    const std::vector<llama_pos> & p = st_.positions;
    struct Move { llama_pos p0, p1, delta; };
    std::vector<Move> moved;
    for (size_t a = 0; a < n_kept; ) { // runs of consecutive positions going to consecutive ranks
        size_t b = a;
        while (b + 1 < n_kept && p[b + 1] == p[b] + 1 && rank[b + 1] == rank[b] + 1) {
            ++b;
        }
        moved.push_back({p[a], p[b] + 1, high + rank[a] - p[a]});
        llama_memory_seq_add(mem_, seq_, moved.back().p0, moved.back().p1, moved.back().delta);
        a = b + 1;
    }
    std::vector<llama_pos> delta(n_back);
    for (size_t j = 0; j < n_back; ++j) {
        delta[j] = high + rank[n_kept + j] - taken.positions[j];
    }
    const int32_t rc = llama_kv_entries_put_shifted(ctx_, seq_, (int32_t) n_back, taken.positions.data(),
                                                    delta.data(), taken.tokens.data(), taken.raw.data());
    if (rc != 0) {
        for (const Move & m : moved) { // back where they were
            llama_memory_seq_add(mem_, seq_, m.p0 + m.delta, m.p1 + m.delta, -m.delta);
        }
        throw std::runtime_error("llama_kv_entries_put_shifted failed with status " + std::to_string(rc) +
                                 (rc == -3 ? " (no free cells for the recalled entries)" : ""));
    }
    llama_memory_seq_add(mem_, seq_, high, -1, -high);
    merge(taken);
    std::iota(st_.positions.begin(), st_.positions.end(), 0);
    st_.next_pos = (llama_pos) st_.positions.size();
}

} // namespace h2o
