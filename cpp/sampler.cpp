#include "sampler.h"
#include "model.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace h2o {

namespace {

// llama.cpp's grammar throws std::runtime_error when a call is over its work limit (our patch 0010) or finds no
// parse left; either fails the generation that uses the grammar, as a GrammarError
template <typename F> void grammar_call(F f) {
    try {
        f();
    } catch (const GrammarError &) {
        throw;
    } catch (const std::runtime_error & e) {
        const std::string what = e.what();
        if (what.find("more work than its limit") != std::string::npos) {
            throw GrammarWorkExceeded("the grammar needs more work than its limit allows (too many parse stacks "
                                      "open at once): " + what);
        }
        throw GrammarError("the grammar cannot go on: " + what);
    }
}

llama_token end_of_generation(const llama_vocab * vocab) {
    const llama_token eos = llama_vocab_eos(vocab);
    return eos != LLAMA_TOKEN_NULL ? eos : llama_vocab_eot(vocab);
}

// params' numbers checked (ValueError in Python); the logit biases with the banned tokens' -inf added
std::vector<llama_logit_bias> checked_bias(const SamplerParams & params, int32_t n_vocab) {
    std::vector<llama_logit_bias> bias = params.logit_bias;
    for (const llama_logit_bias & b : bias) {
        check_token_id(b.token, n_vocab, "logit_bias");
        if (!std::isfinite(b.bias) && b.bias != -INFINITY) {
            throw std::invalid_argument("logit_bias of token " + std::to_string(b.token) + " is not a number");
        }
    }
    for (const llama_token t : params.banned) {
        check_token_id(t, n_vocab, "banned");
        bias.push_back({t, -INFINITY});
    }
    for (const llama_token t : params.history) {
        check_token_id(t, n_vocab, "history");
    }
    if (params.penalty_last_n < 0) {
        throw std::invalid_argument("penalty_last_n must be >= 0 (tokens), got " + std::to_string(params.penalty_last_n));
    }
    if (!(params.typical_p > 0.0f && params.typical_p <= 1.0f)) {
        throw std::invalid_argument("typical_p must be in (0, 1] (1: off), got " + std::to_string(params.typical_p));
    }
    if (params.mirostat < 0 || params.mirostat > 2) {
        throw std::invalid_argument("mirostat must be 0 (off), 1 or 2, got " + std::to_string(params.mirostat));
    }
    if (!(params.mirostat_tau > 0.0f && std::isfinite(params.mirostat_tau) && params.mirostat_eta > 0.0f &&
          std::isfinite(params.mirostat_eta))) {
        throw std::invalid_argument("mirostat_tau and mirostat_eta must be finite and > 0");
    }
    if (params.penalizes() && !(params.repeat_penalty > 0.0f && std::isfinite(params.repeat_penalty) &&
                                std::isfinite(params.frequency_penalty) && std::isfinite(params.presence_penalty))) {
        throw std::invalid_argument("repeat_penalty must be > 0 and the penalties finite");
    }
    return bias;
}

} // namespace

Sampler::Sampler(const SamplerParams & params, int32_t n_vocab, const llama_vocab * vocab) : n_vocab_(n_vocab) {
    const std::vector<llama_logit_bias> bias = checked_bias(params, n_vocab);
    if (!params.grammar.empty()) {
        if (vocab == nullptr) {
            throw std::invalid_argument("a grammar needs the model's vocabulary");
        }
        init_grammar(params, vocab);
    }
    init_chain(params, bias);
}

Sampler::Sampler(const SamplerParams & params, int32_t n_vocab, const Sampler & checked) : n_vocab_(n_vocab) {
    if (checked.grammar_ == nullptr) {
        throw std::invalid_argument("the sampler whose grammar is to be copied has none");
    }
    if (checked.n_vocab_ != n_vocab) {
        throw std::invalid_argument("the sampler whose grammar is to be copied is for another vocabulary");
    }
    const std::vector<llama_logit_bias> bias = checked_bias(params, n_vocab);
    grammar_ = llama_sampler_clone(checked.grammar_);
    grammar_eog_ = checked.grammar_eog_;
    grammar_end_ = params.banned.empty() ? checked.grammar_default_end_ : params.banned.front();
    grammar_default_end_ = checked.grammar_default_end_;
    init_chain(params, bias);
}

void Sampler::init_grammar(const SamplerParams & params, const llama_vocab * vocab) {
    llama_sampler * grammar = nullptr;
    grammar_call([&] {
        grammar = llama_sampler_init_grammar_bounded(vocab, params.grammar.c_str(), "root", params.grammar_max_work);
    });
    if (grammar == nullptr) {
        throw std::invalid_argument("the grammar does not parse as GBNF with a rule 'root' (llama.cpp's grammar "
                                    "parser; its log says where)");
    }
    grammar_ = grammar;
    grammar_eog_ = end_of_generation(vocab);
    bool any = false;
    try {
        any = grammar_allows_any();
    } catch (...) {
        llama_sampler_free(grammar);
        grammar_ = nullptr;
        throw;
    }
    if (!any) {
        llama_sampler_free(grammar);
        grammar_ = nullptr;
        throw GrammarError("the grammar allows no token at its start: no text this model's tokens spell can "
                           "begin to match it");
    }
    // kept beside the chain: sample() asks it about the chosen token first
    grammar_default_end_ = llama_vocab_eos(vocab);
    grammar_end_ = params.banned.empty() ? grammar_default_end_ : params.banned.front();
}

void Sampler::init_chain(const SamplerParams & params, const std::vector<llama_logit_bias> & bias) {
    const int32_t n_vocab = n_vocab_;
    chain_ = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (!bias.empty()) {
        llama_sampler_chain_add(chain_, llama_sampler_init_logit_bias(n_vocab, (int32_t) bias.size(), bias.data()));
    }
    if (params.penalizes()) {
        llama_sampler * penalties = llama_sampler_init_penalties(n_vocab, params.penalty_last_n, params.repeat_penalty,
                                                                 params.frequency_penalty, params.presence_penalty);
        for (const llama_token t : params.history) { // the prompt counts for the penalties only
            llama_sampler_accept(penalties, t);
        }
        llama_sampler_chain_add(chain_, penalties);
    }
    if (params.temperature <= 0.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_greedy());
        return;
    }
    if (params.mirostat != 0) {
        llama_sampler_chain_add(chain_, llama_sampler_init_temp(params.temperature));
        llama_sampler_chain_add(chain_, params.mirostat == 1
            ? llama_sampler_init_mirostat(n_vocab, params.seed, params.mirostat_tau, params.mirostat_eta, 100)
            : llama_sampler_init_mirostat_v2(params.seed, params.mirostat_tau, params.mirostat_eta));
        return;
    }
    if (params.top_k > 0) {
        llama_sampler_chain_add(chain_, llama_sampler_init_top_k(params.top_k));
    }
    if (params.typical_p < 1.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_typical(params.typical_p, 1));
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
    if (grammar_ != nullptr) {
        llama_sampler_free(grammar_);
    }
}

llama_token_data_array Sampler::candidates(const float * logits) {
    cand_.resize(n_vocab_);
    for (int32_t i = 0; i < n_vocab_; ++i) {
        cand_[i] = llama_token_data{i, logits[i], 0.0f};
    }
    return {cand_.data(), cand_.size(), -1, false};
}

bool Sampler::grammar_allows(llama_token tok) const {
    llama_token_data one = {tok, 1.0f, 0.0f};
    llama_token_data_array arr = {&one, 1, -1, false};
    grammar_call([&] { llama_sampler_apply(grammar_, &arr); });
    return arr.data[0].logit != -INFINITY;
}

bool Sampler::grammar_complete() const {
    return grammar_eog_ >= 0 && grammar_allows(grammar_eog_);
}

bool Sampler::grammar_allows_any() {
    std::vector<float> zeros(n_vocab_, 0.0f);
    llama_token_data_array arr = candidates(zeros.data());
    grammar_call([&] { llama_sampler_apply(grammar_, &arr); });
    for (size_t i = 0; i < arr.size; ++i) {
        if (arr.data[i].logit != -INFINITY) {
            return true;
        }
    }
    return false;
}

void Sampler::accept(llama_token tok) {
    if (grammar_ != nullptr) {
        grammar_call([&] { llama_sampler_accept(grammar_, tok); });
    }
    llama_sampler_accept(chain_, tok);
}

// As llama.cpp's common sampler: the chain draws from the whole vocabulary first and the grammar is asked about
// the chosen token alone; only when it refuses is the draw made again with the grammar over every candidate. A
// grammar with many open alternatives costs a check of one token on most steps instead of the vocabulary's.
llama_token Sampler::sample(const float * logits) {
    llama_token_data_array arr = candidates(logits);
    llama_sampler_apply(chain_, &arr);
    if (arr.selected < 0 || (size_t) arr.selected >= arr.size) {
        throw std::runtime_error("the sampler selected no token");
    }
    if (grammar_ != nullptr && !(arr.data[arr.selected].logit != -INFINITY && grammar_allows(arr.data[arr.selected].id))) {
        arr = candidates(logits);
        grammar_call([&] { llama_sampler_apply(grammar_, &arr); });
        llama_sampler_apply(chain_, &arr);
        if (arr.selected < 0 || (size_t) arr.selected >= arr.size) {
            throw std::runtime_error("the sampler selected no token");
        }
    }
    if (arr.data[arr.selected].logit == -INFINITY) {
        // every token is ruled out: a finished grammar allows only the end, which ignore_eos (or a logit_bias of
        // -inf) bans; the text is complete, so it ends there
        if (grammar_ != nullptr && grammar_end_ >= 0 && grammar_complete()) {
            accept(grammar_end_);
            return grammar_end_;
        }
        if (grammar_ != nullptr) {
            throw GrammarError("the grammar allows no token here: what it needs next is no text this model's "
                               "tokens spell, or logit_bias rules it out");
        }
        throw std::runtime_error("no token is allowed: logit_bias rules out every token");
    }
    const llama_token tok = arr.data[arr.selected].id;
    accept(tok);
    return tok;
}

} // namespace h2o
