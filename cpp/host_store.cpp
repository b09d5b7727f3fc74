#include "host_store.h"

#include "ggml.h"

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
    keep_rows(positions, 1, indices);
    keep_rows(tokens, 1, indices);
    scores.keep_only(indices);
    keep_rows(kv, entry_bytes, indices);
}

HostStore HostStore::without_kv() const {
    HostStore out;
    out.entry_bytes = entry_bytes;
    out.q8_0        = q8_0;
    out.positions   = positions;
    out.tokens      = tokens;
    out.scores      = scores;
    out.n_spilled   = n_spilled;
    out.n_recalled  = n_recalled;
    out.n_dropped   = n_dropped;
    return out;
}

void HostStore::append_rows(const std::vector<uint8_t> & raw, size_t raw_bytes) {
    const std::vector<uint8_t> rows = q8_0 ? f16_to_q8_0(raw, raw_bytes) : raw;
    kv.insert(kv.end(), rows.begin(), rows.end());
}

std::vector<uint8_t> HostStore::raw_rows(const std::vector<size_t> & indices, size_t raw_bytes) const {
    const std::vector<uint8_t> rows = gather_rows(kv, entry_bytes, indices);
    return q8_0 ? q8_0_to_f16(rows, raw_bytes) : rows;
}

void HostStore::set_encoding(bool q8, size_t raw_bytes) {
    if (q8 != q8_0) {
        kv = q8 ? f16_to_q8_0(kv, raw_bytes) : q8_0_to_f16(kv, raw_bytes);
    }
    q8_0 = q8;
    entry_bytes = q8 ? q8_0_entry_bytes(raw_bytes) : raw_bytes;
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
