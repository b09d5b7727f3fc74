#include "host_store.h"

#include "ggml.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <stdexcept>

namespace h2o {

namespace {

int64_t padded_values(size_t raw_bytes) {
    const int64_t n  = (int64_t) (raw_bytes/sizeof(ggml_fp16_t));
    const int64_t bs = ggml_blck_size(GGML_TYPE_Q8_0);
    return (n + bs - 1)/bs*bs;
}

} // namespace

void HostStore::keep_only(const std::vector<size_t> & indices) {
    keep_rows(p_.positions, 1, indices);
    keep_rows(p_.origins, 1, indices);
    keep_rows(p_.tokens, 1, indices);
    p_.scores.keep_only(indices);
    keep_rows(p_.kv, p_.entry_bytes, indices);
}

HostStore HostStore::without_kv() const {
    HostStore out;
    out.p_.entry_bytes = p_.entry_bytes;
    out.p_.q8_0        = p_.q8_0;
    out.p_.positions   = p_.positions;
    out.p_.origins     = p_.origins;
    out.p_.tokens      = p_.tokens;
    out.p_.scores      = p_.scores;
    out.p_.n_spilled   = p_.n_spilled;
    out.p_.n_recalled  = p_.n_recalled;
    out.p_.n_dropped   = p_.n_dropped;
    out.p_.text_origins = p_.text_origins;
    out.p_.text_tokens  = p_.text_tokens;
    out.p_.text_scores  = p_.text_scores;
    return out;
}

HostStore HostStore::with_raw_kv(size_t raw_bytes) const {
    HostStore out = without_kv();
    std::vector<size_t> all(size());
    std::iota(all.begin(), all.end(), 0);
    out.p_.kv = raw_rows(all, raw_bytes);
    return out;
}

HostStore HostStore::empty_like() const {
    HostStore out;
    out.p_.entry_bytes   = p_.entry_bytes;
    out.p_.q8_0          = p_.q8_0;
    out.p_.scores.n_head = p_.scores.n_head;
    out.p_.text_scores.n_head = p_.scores.n_head;
    return out;
}

void HostStore::append_rows(const std::vector<uint8_t> & raw, size_t raw_bytes) {
    const std::vector<uint8_t> rows = p_.q8_0 ? f16_to_q8_0(raw, raw_bytes) : raw;
    p_.kv.insert(p_.kv.end(), rows.begin(), rows.end());
}

std::vector<uint8_t> HostStore::raw_rows(const std::vector<size_t> & indices, size_t raw_bytes) const {
    const std::vector<uint8_t> rows = gather_rows(p_.kv, p_.entry_bytes, indices);
    return p_.q8_0 ? q8_0_to_f16(rows, raw_bytes) : rows;
}

void HostStore::set_encoding(bool q8, size_t raw_bytes) {
    if (q8 != p_.q8_0) {
        p_.kv = q8 ? f16_to_q8_0(p_.kv, raw_bytes) : q8_0_to_f16(p_.kv, raw_bytes);
    }
    p_.q8_0 = q8;
    p_.entry_bytes = q8 ? q8_0_entry_bytes(raw_bytes) : raw_bytes;
}

void HostStore::spill(const std::vector<llama_pos> & pos, const std::vector<llama_pos> & orig,
                      const std::vector<llama_token> & toks, const SeqScores & entry_scores,
                      const std::vector<uint8_t> & raw, size_t raw_bytes, size_t cap) {
    put_back({pos, orig, toks, entry_scores, raw}, raw_bytes);
    p_.n_spilled += (int64_t) pos.size();
    drop_oldest(cap);
}

void HostStore::drop_oldest(size_t cap) {
    if (size() <= cap) {
        return;
    }
    std::vector<size_t> order(size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p_.origins[a] > p_.origins[b]; });
    // what goes, oldest first, appended to the text; merged into the conversation's order only where it is not
    // already after all of it (an entry read again or recalled, dropped again): a generated token's drop stays O(1)
    std::vector<size_t> gone(order.rbegin(), order.rend() - (std::ptrdiff_t) cap);
    const size_t n_text = p_.text_origins.size();
    const std::vector<llama_pos> gone_origins = gather_rows(p_.origins, 1, gone);
    p_.text_origins.insert(p_.text_origins.end(), gone_origins.begin(), gone_origins.end());
    const std::vector<llama_token> gone_tokens = gather_rows(p_.tokens, 1, gone);
    p_.text_tokens.insert(p_.text_tokens.end(), gone_tokens.begin(), gone_tokens.end());
    p_.text_scores.n_head = p_.scores.n_head;
    p_.text_scores.extend(p_.scores.gather(gone));
    if (n_text > 0 && p_.text_origins[n_text - 1] > p_.text_origins[n_text]) {
        std::vector<size_t> by_place(p_.text_origins.size());
        std::iota(by_place.begin(), by_place.end(), 0);
        std::inplace_merge(by_place.begin(), by_place.begin() + (std::ptrdiff_t) n_text, by_place.end(),
                           [&](size_t a, size_t b) { return p_.text_origins[a] < p_.text_origins[b]; });
        p_.text_origins = gather_rows(p_.text_origins, 1, by_place);
        p_.text_tokens  = gather_rows(p_.text_tokens, 1, by_place);
        p_.text_scores  = p_.text_scores.gather(by_place);
    }
    order.resize(cap);
    std::sort(order.begin(), order.end());
    p_.n_dropped += (int64_t) gone.size();
    keep_only(order);
}

HostStore::Entries HostStore::take_text(const std::vector<size_t> & indices, std::vector<llama_pos> pos,
                                        std::vector<uint8_t> raw) {
    Entries out {std::move(pos), gather_rows(p_.text_origins, 1, indices), gather_rows(p_.text_tokens, 1, indices),
                 p_.text_scores.gather(indices), std::move(raw)};
    std::vector<uint8_t> gone(p_.text_origins.size(), 0);
    for (const size_t i : indices) {
        gone.at(i) = 1;
    }
    std::vector<size_t> left;
    for (size_t i = 0; i < gone.size(); ++i) {
        if (!gone[i]) {
            left.push_back(i);
        }
    }
    keep_text(left);
    return out;
}

void HostStore::keep_text(const std::vector<size_t> & indices) {
    keep_rows(p_.text_origins, 1, indices);
    keep_rows(p_.text_tokens, 1, indices);
    p_.text_scores.keep_only(indices);
}

void HostStore::keep_before(llama_pos n) {
    std::vector<size_t> stored, text;
    for (size_t i = 0; i < size(); ++i) {
        if (p_.origins[i] < n) {
            stored.push_back(i);
        }
    }
    for (size_t i = 0; i < p_.text_origins.size(); ++i) {
        if (p_.text_origins[i] < n) {
            text.push_back(i);
        }
    }
    keep_only(stored);
    keep_text(text);
}

HostStore::Entries HostStore::entries(const std::vector<size_t> & indices, size_t raw_bytes) const {
    return {gather_rows(p_.positions, 1, indices), gather_rows(p_.origins, 1, indices),
            gather_rows(p_.tokens, 1, indices), p_.scores.gather(indices), raw_rows(indices, raw_bytes)};
}

HostStore::Entries HostStore::Entries::slice(size_t a, size_t b) const {
    std::vector<size_t> idx(b - a);
    std::iota(idx.begin(), idx.end(), a);
    const size_t width = size() == 0 ? 0 : raw.size()/size();
    return {gather_rows(positions, 1, idx), gather_rows(origins, 1, idx), gather_rows(tokens, 1, idx),
            scores.gather(idx), gather_rows(raw, width, idx)};
}

HostStore::Entries HostStore::take(const std::vector<size_t> & indices, size_t raw_bytes) {
    Entries out = entries(indices, raw_bytes);
    // the holes filled from the end: a store's order is not the conversation's (origins are), and the step costs
    // what it takes, not what the store holds
    std::vector<size_t> descending = indices;
    std::sort(descending.begin(), descending.end(), std::greater<size_t>());
    remove_rows_unordered(p_.positions, 1, descending);
    remove_rows_unordered(p_.origins, 1, descending);
    remove_rows_unordered(p_.tokens, 1, descending);
    p_.scores.remove_unordered(descending);
    remove_rows_unordered(p_.kv, p_.entry_bytes, descending);
    return out;
}

void HostStore::put_back(const Entries & e, size_t raw_bytes) {
    append_rows(e.raw, raw_bytes);
    p_.positions.insert(p_.positions.end(), e.positions.begin(), e.positions.end());
    p_.origins.insert(p_.origins.end(), e.origins.begin(), e.origins.end());
    p_.tokens.insert(p_.tokens.end(), e.tokens.begin(), e.tokens.end());
    p_.scores.extend(e.scores);
}

HostStore HostStore::adopted(const HostStore & saved, size_t raw_bytes, int32_t n_head) {
    // a saved store says how it kept its entries by their size: the cache's own rows, or their q8_0 blocks
    HostStore h = saved.without_kv();
    // with room to grow: the next spills append without first copying the whole store (one entry per decode step)
    h.p_.kv.reserve(saved.p_.kv.size() + saved.p_.kv.size()/2);
    h.p_.kv.assign(saved.p_.kv.begin(), saved.p_.kv.end());
    if (h.size() > 0) {
        if (h.p_.entry_bytes != raw_bytes && h.p_.entry_bytes != q8_0_entry_bytes(raw_bytes)) {
            throw std::invalid_argument("the snapshot's host entries have another size than this cache's");
        }
        h.p_.q8_0 = h.p_.entry_bytes != raw_bytes;
    }
    h.p_.scores.n_head = n_head;
    h.p_.text_scores.n_head = n_head;
    return h;
}

bool HostStore::fits(size_t raw_bytes, int32_t n_head) const {
    return consistent() && p_.scores.n_head == n_head &&
           (size() == 0 || p_.entry_bytes == raw_bytes || p_.entry_bytes == q8_0_entry_bytes(raw_bytes));
}

bool HostStore::consistent() const {
    const size_t n = size();
    return p_.tokens.size() == n && p_.origins.size() == n && p_.scores.covers(n) && (n == 0 || (p_.entry_bytes > 0 && p_.kv.size() == n*p_.entry_bytes)) &&
           p_.n_spilled >= 0 && p_.n_recalled >= 0 && p_.n_dropped >= 0 &&
           p_.text_tokens.size() == p_.text_origins.size() && p_.text_scores.covers(p_.text_origins.size()) &&
           std::adjacent_find(p_.text_origins.begin(), p_.text_origins.end(),
                              [](llama_pos a, llama_pos b) { return a >= b; }) == p_.text_origins.end();
}

size_t q8_0_entry_bytes(size_t raw_bytes) {
    return ggml_row_size(GGML_TYPE_Q8_0, padded_values(raw_bytes));
}

std::vector<uint8_t> f16_to_q8_0(const std::vector<uint8_t> & f16, size_t raw_bytes) {
    if (raw_bytes == 0 || raw_bytes % sizeof(ggml_fp16_t) != 0 || f16.size() % raw_bytes != 0) {
        throw std::logic_error("F16 entries of " + std::to_string(raw_bytes) + " bytes cannot be read from " +
                               std::to_string(f16.size()) + " bytes");
    }
    const size_t  n  = f16.size()/raw_bytes;
    const int64_t nv = (int64_t) (raw_bytes/sizeof(ggml_fp16_t));
    const int64_t np = padded_values(raw_bytes);
    std::vector<float> f32((size_t) (n*np), 0.0f);
    for (size_t i = 0; i < n; ++i) {
        ggml_fp16_to_fp32_row((const ggml_fp16_t *) (f16.data() + i*raw_bytes), f32.data() + i*np, nv);
    }
    std::vector<uint8_t> out(n*q8_0_entry_bytes(raw_bytes));
    if (n > 0) {
        ggml_quantize_chunk(GGML_TYPE_Q8_0, f32.data(), out.data(), 0, (int64_t) n, np, nullptr);
    }
    return out;
}

std::vector<uint8_t> q8_0_to_f16(const std::vector<uint8_t> & q8, size_t raw_bytes) {
    const size_t q8_bytes = q8_0_entry_bytes(raw_bytes);
    if (raw_bytes == 0 || q8.size() % q8_bytes != 0) {
        throw std::logic_error("q8_0 entries of " + std::to_string(q8_bytes) + " bytes cannot be read from " +
                               std::to_string(q8.size()) + " bytes");
    }
    const size_t  n  = q8.size()/q8_bytes;
    const int64_t nv = (int64_t) (raw_bytes/sizeof(ggml_fp16_t));
    const auto * traits = ggml_get_type_traits(GGML_TYPE_Q8_0);
    std::vector<float> f32((size_t) padded_values(raw_bytes));
    std::vector<uint8_t> out(n*raw_bytes);
    for (size_t i = 0; i < n; ++i) {
        traits->to_float(q8.data() + i*q8_bytes, f32.data(), (int64_t) f32.size());
        ggml_fp32_to_fp16_row(f32.data(), (ggml_fp16_t *) (out.data() + i*raw_bytes), nv);
    }
    return out;
}

} // namespace h2o
