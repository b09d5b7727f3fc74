#include "plain_run.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>

namespace h2o {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

void decode(llama_context * ctx, llama_token * tokens, int32_t n) {
    if (llama_decode(ctx, llama_batch_get_one(tokens, n)) != 0) {
        throw std::runtime_error("llama_decode failed");
    }
}

void read_prompt(llama_context * ctx, const std::vector<llama_token> & prompt, size_t n, uint32_t n_batch) {
    std::vector<llama_token> tokens(prompt.begin(), prompt.begin() + n);
    for (size_t i = 0; i < n; i += n_batch) {
        decode(ctx, tokens.data() + i, (int32_t) std::min<size_t>(n_batch, n - i));
    }
    llama_synchronize(ctx);
}

} // namespace

PlainRunTimes plain_run(const PlainRunParams & params, const std::vector<llama_token> & prompt, int32_t n_decode) {
    if (prompt.empty() || n_decode < 1 || params.n_batch < 1 || params.warmup_tokens < 0) {
        throw std::invalid_argument("plain_run needs a prompt, n_decode >= 1, n_batch >= 1 and warmup_tokens >= 0");
    }
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = params.n_gpu_layers;
    std::unique_ptr<llama_model, decltype(&llama_model_free)> model(
        llama_model_load_from_file(params.model.c_str(), mp), llama_model_free);
    if (!model) {
        throw std::runtime_error("cannot load " + params.model);
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = (uint32_t) prompt.size() + (uint32_t) n_decode + 16;
    cp.n_batch         = params.n_batch;
    cp.n_ubatch        = params.n_batch;
    cp.no_perf         = true;
    cp.flash_attn_type = params.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (params.n_threads > 0) {
        cp.n_threads       = params.n_threads;
        cp.n_threads_batch = params.n_threads;
    }
    std::unique_ptr<llama_context, decltype(&llama_free)> ctx(llama_init_from_model(model.get(), cp), llama_free);
    if (!ctx) {
        throw std::runtime_error("cannot make a context for " + params.model);
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model.get()));

    PlainRunTimes times;
    times.model_bytes = llama_model_size(model.get());
    times.n_ctx       = llama_n_ctx(ctx.get());
    if (params.warmup_tokens > 0) {
        const size_t n = std::min<size_t>((size_t) params.warmup_tokens, prompt.size());
        read_prompt(ctx.get(), prompt, n, params.n_batch);
        llama_token next = prompt[0];
        decode(ctx.get(), &next, 1);
        llama_synchronize(ctx.get());
        llama_memory_clear(llama_get_memory(ctx.get()), true);
    }
    auto t0 = Clock::now();
    read_prompt(ctx.get(), prompt, prompt.size(), params.n_batch);
    times.prefill_s = seconds_since(t0);
    for (int32_t step = 0; step < n_decode; ++step) {
        const float * logits = llama_get_logits_ith(ctx.get(), -1);
        llama_token next = (llama_token) (std::max_element(logits, logits + n_vocab) - logits);
        times.tokens.push_back(next);
        t0 = Clock::now();
        decode(ctx.get(), &next, 1);
        llama_get_logits_ith(ctx.get(), -1); // waits for the step and its logits on the host
        times.step_s.push_back(seconds_since(t0));
    }
    return times;
}

} // namespace h2o
