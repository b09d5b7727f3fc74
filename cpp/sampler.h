// llama.cpp's sampler chain: logit bias (banned tokens: -inf) -> repetition penalties -> top_k -> typical_p -> top_p ->
// min_p -> temperature -> seeded draw (or temperature -> Mirostat); greedy (after the bias and the penalties) when
// temperature <= 0. A grammar is checked
// on the drawn token and constrains the whole vocabulary only when it refuses it (llama.cpp's common sampler does
// the same). It samples straight from a row of logits (the context's own, see Engine::sample).
#pragma once

#include "llama.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace h2o {

struct SamplerParams {
    float    temperature = 0.8f;
    float    top_p = 0.95f;
    int32_t  top_k = 40;
    float    min_p = 0.05f;
    float    typical_p = 1.0f; // locally typical sampling (1: off)
    // Mirostat (0: off; 1, 2: its versions): after the temperature, a draw that steers the text's surprise to
    // mirostat_tau, learning at mirostat_eta; it replaces top_k, typical_p, top_p and min_p (as in llama.cpp's common)
    int32_t  mirostat = 0;
    float    mirostat_tau = 5.0f;
    float    mirostat_eta = 0.1f;
    uint32_t seed  = 0;
    std::vector<llama_token> banned; // never sampled (for example every end-of-generation token)
    std::vector<llama_logit_bias> logit_bias; // added to the logits before anything else
    // llama.cpp's penalties over the last penalty_last_n tokens (the history, then each sampled token)
    int32_t penalty_last_n    = 64;
    float   repeat_penalty    = 1.0f; // > 0, 1: off (a repeated token's logit divided by it when positive)
    float   frequency_penalty = 0.0f; // minus this times the token's count
    float   presence_penalty  = 0.0f; // minus this once if the token occurred
    std::vector<llama_token> history; // the prompt's last tokens, seen by the penalties before the first draw
    std::string grammar; // GBNF (llama.cpp's grammar sampler, rule "root"); empty: none
    // the most work one grammar call (its parse, a check of the candidates, a token accepted) may take: a
    // parse-stack element visited or a candidate's character matched is one step; 0: no limit
    uint64_t grammar_max_work = 0;

    bool penalizes() const {
        return penalty_last_n != 0 && (repeat_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f);
    }
};

// A grammar that cannot be followed: over its work limit, or allowing no token where generation must go on.
// The request that gave it fails; the model, the context and every other sampler are unaffected.
struct GrammarError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// what needed more work than GrammarLimits allow (a subclass: the server answers it with its setting's name)
struct GrammarWorkExceeded : GrammarError {
    using GrammarError::GrammarError;
};

class Sampler {
public:
    // vocab: needed (and kept by reference: it must outlive the sampler) when params.grammar is set
    Sampler(const SamplerParams & params, int32_t n_vocab, const llama_vocab * vocab = nullptr);
    // params' chain with a copy of `checked`'s grammar, in the state it is in (already parsed and checked at its
    // start): n samples of one request share one grammar check
    Sampler(const SamplerParams & params, int32_t n_vocab, const Sampler & checked);
    ~Sampler();
    Sampler(const Sampler &) = delete;
    Sampler & operator=(const Sampler &) = delete;

    llama_token sample(const float * logits);
    int32_t n_vocab() const { return n_vocab_; }
    bool has_grammar() const { return grammar_ != nullptr; }

private:
    void init_grammar(const SamplerParams & params, const llama_vocab * vocab);
    void init_chain(const SamplerParams & params, const std::vector<llama_logit_bias> & bias);
    llama_token_data_array candidates(const float * logits);
    bool grammar_allows(llama_token tok) const;
    bool grammar_complete() const;
    bool grammar_allows_any();
    void accept(llama_token tok);

    llama_sampler * chain_ = nullptr;
    llama_sampler * grammar_ = nullptr; // owned; not in chain_
    int32_t n_vocab_ = 0;
    // the end token a finished grammar gives when the bans and biases rule out every token; -1: none
    llama_token grammar_end_ = -1;
    llama_token grammar_default_end_ = -1; // the vocabulary's end token: grammar_end_ where nothing is banned
    // an end-of-generation token: the grammar allows it exactly when it is complete; -1: the vocabulary has none
    llama_token grammar_eog_ = -1;
    std::vector<llama_token_data> cand_;
};

} // namespace h2o
