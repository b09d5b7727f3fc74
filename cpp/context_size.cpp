#include "context_size.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace h2o {

uint32_t bounded_cells(uint32_t n_seq, uint32_t budget, uint32_t n_batch, bool kv_unified) {
    return kv_unified ? n_seq*budget + n_batch : n_seq*(budget + n_batch);
}

uint32_t padded_cells(uint32_t n_cells, uint32_t n_seq, bool kv_unified) {
    constexpr uint32_t pad = 256; // llama_context's GGML_PAD(n_ctx, 256) and GGML_PAD(n_ctx_seq, 256)
    auto up = [](uint32_t n) { return (n + pad - 1)/pad*pad; };
    return kv_unified ? up(n_cells) : n_seq*up(up(n_cells)/n_seq);
}

ContextSize context_size(const EngineParams & params, const Policy & policy, int32_t n_ctx_train, int32_t n_probe,
                         int32_t n_ride) {
    // cells per stream: the budgets of all sequences + one batch (unified), or a budget + one batch per sequence
    const uint32_t n_stream        = params.kv_unified ? 1 : params.n_seq_max;
    const uint32_t kept_per_stream = policy.bounded() ? params.n_seq_max/n_stream*policy.split().total() : 0;
    ContextSize out;
    out.n_ctx = params.n_ctx;
    if (out.n_ctx == 0) {
        out.n_ctx = policy.bounded()
            ? bounded_cells(params.n_seq_max, policy.split().total(), params.n_batch, params.kv_unified) +
                  n_stream*(uint32_t) n_probe // a probe's cells beside a piece
            : n_stream*(uint32_t) std::max(n_ctx_train, 1);
    }
    if (policy.bounded() && out.n_ctx/n_stream <= kept_per_stream) {
        throw std::invalid_argument("n_ctx=" + std::to_string(out.n_ctx) + " leaves no room beside the budget (" +
                                    std::to_string(kept_per_stream) + " entries per stream): use n_ctx > budget * n_seq_max, or 0");
    }
    out.n_batch       = std::min(params.n_batch, out.n_ctx);
    out.n_ubatch      = params.n_ubatch == 0 ? out.n_batch : std::min(params.n_ubatch, out.n_batch);
    out.n_outputs_max = std::max(out.n_batch, params.n_seq_max); // a step of n_seq_max sequences has that many outputs
    out.n_probe_ride  = policy.bounded() ? std::min((uint32_t) std::max(n_ride, 0), out.n_ctx - out.n_batch) : 0;
    return out;
}

void check_host_memory(const ContextSize & size, uint64_t kv_bytes_per_cell, int32_t n_vocab, bool kv_on_host,
                       uint64_t have) {
    if (have == 0) {
        return;
    }
    const uint64_t logits = (uint64_t) size.n_outputs_max*(uint64_t) n_vocab*4;
    const uint64_t need   = (kv_on_host ? (uint64_t) size.n_ctx*kv_bytes_per_cell : 0) + logits;
    if (need > have) {
        throw std::invalid_argument("n_ctx=" + std::to_string(size.n_ctx) + " cells and n_batch=" +
                                    std::to_string(size.n_outputs_max) + " outputs need about " +
                                    std::to_string(need >> 30) + " GiB of KV cache and logits, more than this "
                                    "machine's " + std::to_string(have >> 30) + " GiB: use a smaller budget, n_batch or n_ctx");
    }
}

void check_device_memory(const ContextSize & size, uint64_t device_kv_bytes_per_cell, const std::string & devices,
                         uint64_t have) {
    const uint64_t need = (uint64_t) size.n_ctx*device_kv_bytes_per_cell;
    if (have != 0 && need > have) {
        throw std::invalid_argument("n_ctx=" + std::to_string(size.n_ctx) + " cells need about " +
                                    std::to_string(need >> 30) + " GiB of KV cache on " + devices + ", more than this "
                                    "machine's " + devices + " hold (" + std::to_string(have >> 30) + " GiB): use a "
                                    "smaller budget or n_ctx, or fewer n_gpu_layers");
    }
}

uint64_t physical_memory_bytes() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGE_SIZE)
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page  = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? (uint64_t) pages*(uint64_t) page : 0;
#else
    return 0;
#endif
}

} // namespace h2o
