// llama.cpp's sampler chain: banned tokens -> top_k -> top_p -> min_p -> temperature -> seeded draw; greedy when
// temperature <= 0. It samples straight from a row of logits (the context's own, see Engine::sample).
#pragma once

#include "llama.h"

#include <cstdint>
#include <vector>

namespace h2o {

struct SamplerParams {
    float    temperature = 0.8f;
    float    top_p = 0.95f;
    int32_t  top_k = 40;
    float    min_p = 0.05f;
    uint32_t seed  = 0;
    std::vector<llama_token> banned; // never sampled (for example every end-of-generation token)
};

class Sampler {
public:
    Sampler(const SamplerParams & params, int32_t n_vocab);
    ~Sampler();
    Sampler(const Sampler &) = delete;
    Sampler & operator=(const Sampler &) = delete;

    llama_token sample(const float * logits);
    int32_t n_vocab() const { return n_vocab_; }

private:
    llama_sampler * chain_ = nullptr;
    int32_t n_vocab_ = 0;
    std::vector<llama_token_data> cand_;
};

} // namespace h2o
