#include "sampler.h"

#include <cmath>
#include <stdexcept>

namespace h2o {

Sampler::Sampler(const SamplerParams & params, int32_t n_vocab) : n_vocab_(n_vocab) {
    chain_ = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (!params.banned.empty()) {
        std::vector<llama_logit_bias> bias;
        for (const llama_token t : params.banned) {
            if (t < 0 || t >= n_vocab) {
                llama_sampler_free(chain_);
                throw std::invalid_argument("banned token id " + std::to_string(t) + " out of range");
            }
            bias.push_back({t, -INFINITY});
        }
        llama_sampler_chain_add(chain_, llama_sampler_init_logit_bias(n_vocab, (int32_t) bias.size(), bias.data()));
    }
    if (params.temperature <= 0.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_greedy());
        return;
    }
    if (params.top_k > 0) {
        llama_sampler_chain_add(chain_, llama_sampler_init_top_k(params.top_k));
    }
    if (params.top_p < 1.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_top_p(params.top_p, 1));
    }
    if (params.min_p > 0.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_min_p(params.min_p, 1));
    }
    llama_sampler_chain_add(chain_, llama_sampler_init_temp(params.temperature));
    llama_sampler_chain_add(chain_, llama_sampler_init_dist(params.seed));
}

Sampler::~Sampler() {
    llama_sampler_free(chain_);
}

llama_token Sampler::sample(const float * logits) {
    cand_.resize(n_vocab_);
    for (int32_t i = 0; i < n_vocab_; ++i) {
        cand_[i] = llama_token_data{i, logits[i], 0.0f};
    }
    llama_token_data_array arr = {cand_.data(), cand_.size(), -1, false};
    llama_sampler_apply(chain_, &arr);
    if (arr.selected < 0 || (size_t) arr.selected >= arr.size) {
        throw std::runtime_error("the sampler selected no token");
    }
    const llama_token tok = arr.data[arr.selected].id;
    llama_sampler_accept(chain_, tok);
    return tok;
}

} // namespace h2o
