// Embeddings: one text's hidden states, pooled into one vector (mean, first or last token) or one row per token,
// computed in a llama.cpp context of their own so that a generation's KV cache is never touched.
//
// Contract:
//   - the context holds n_ctx tokens (one input at a time, its every token in one ubatch: llama.cpp pools a sequence
//     only within one); a longer input, an empty one or a token outside the vocabulary is std::invalid_argument
//   - pooling is llama.cpp's (LLAMA_POOLING_TYPE_*): MEAN, CLS or LAST give one row of n_embd() values, NONE one row
//     per token; UNSPECIFIED takes the model's own (its GGUF's <arch>.pooling_type), MEAN where it names none (a
//     generative model: Ollama's rule); RANK is refused (a reranker's classifier head)
//   - rows are llama.cpp's, not normalized; the context is cleared before each input, so an input's rows do not
//     depend on what was embedded before
#pragma once

#include "llama.h"
#include "model.h"

#include <cstdint>
#include <mutex>
#include <vector>

namespace h2o {

struct EmbedderParams {
    int32_t n_ctx     = 512; // the longest input, tokens
    int32_t n_threads = 0;   // 0: llama.cpp's default
    int32_t pooling   = LLAMA_POOLING_TYPE_UNSPECIFIED;
    bool    flash_attn = false; // as the generation's context runs (llama.cpp's own "auto" differs: on for the CPU)
};

class Embedder {
public:
    Embedder(const Model & model, const EmbedderParams & params);
    ~Embedder();
    Embedder(const Embedder &) = delete;
    Embedder & operator=(const Embedder &) = delete;

    int32_t n_ctx()   const { return n_ctx_; }
    int32_t n_embd()  const { return n_embd_; }
    int32_t pooling() const { return pooling_; } // what runs: MEAN, CLS, LAST or NONE

    // thread-safe: calls take turns in the one context
    std::vector<std::vector<float>> embed(const std::vector<llama_token> & tokens);

private:
    std::vector<float> row_of(const float * row) const; // throws where llama.cpp gave none

    const Model & model_;
    std::mutex mu_;
    llama_context * ctx_ = nullptr;
    llama_batch batch_ {};
    int32_t n_ctx_   = 0;
    int32_t n_embd_  = 0;
    int32_t pooling_ = LLAMA_POOLING_TYPE_NONE;
};

// the pooling a model names in its GGUF (<arch>.pooling_type), LLAMA_POOLING_TYPE_UNSPECIFIED where it names none
int32_t model_pooling(const Model & model);

} // namespace h2o
