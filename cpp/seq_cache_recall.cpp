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

} // namespace h2o
