// The engine's probes: the decodes that rank a sequence's entries before an eviction removes some of them.
#include "engine.h"
#include "host_store.h"

#include "llama-attn-scores.h"
#include "llama-ext.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace h2o {

int32_t Engine::probe_cells(const Policy & policy) const {
    const ProbeSpec spec = policy.probe();
    switch (spec.source) {
        case ProbeSource::question: return spec.question;
        case ProbeSource::catalyst: return (int32_t) catalyst_.size();
        case ProbeSource::repeat:   return (int32_t) (repeat_prefix_.size() + params_.n_batch);
        case ProbeSource::none:     break;
    }
    return 0;
}

bool Engine::probes_before_evicting(llama_seq_id seq, int64_t n, const std::vector<llama_token> * prompt) const {
    const bool is_prompt = prompt == nullptr || prompt->size() > 1;
    const Policy & policy = policy_of(seq);
    return is_prompt && policy.bounded() && n > (int64_t) policy.split().total();
}

void Engine::probe_and_evict(llama_seq_id seq, const std::vector<llama_token> * prompt, bool probed) {
    if (!probed && probes_before_evicting(seq, seqs_.at(seq).size(), prompt)) {
        run_probe(seq, prompt);
    }
    evict(seq);
}

std::vector<llama_token> Engine::question_or_catalyst(llama_seq_id seq, const std::vector<llama_token> * prompt) const {
    const ProbeSpec spec = policy_of(seq).probe();
    if (spec.source == ProbeSource::question && prompt != nullptr) { // compress() knows no question
        const size_t n = std::min(prompt->size(), (size_t) spec.question);
        return std::vector<llama_token>(prompt->end() - n, prompt->end());
    }
    return spec.source == ProbeSource::catalyst ? catalyst_ : std::vector<llama_token>{};
}

std::vector<llama_token> Engine::riding_probe(llama_seq_id seq, size_t n_chunk, const std::vector<llama_token> & prompt) const {
    if (!probe_rides_ || !probes_before_evicting(seq, seqs_.at(seq).size() + (int64_t) n_chunk, &prompt)) {
        return {};
    }
    return question_or_catalyst(seq, &prompt);
}

Engine::TokenMap Engine::riding_probes(const PrefillStep & step, const TokenMap & chunk, const TokenMap & tokens) const {
    TokenMap rides;
    size_t n = 0;
    for (const auto & kv : chunk) {
        n += kv.second.size();
    }
    for (const llama_seq_id seq : step.evict_after) {
        const auto it = chunk.find(seq);
        // a unified cache keeps one probe's cells beside its chunk (plan_for)
        if (it == chunk.end() || (params_.kv_unified && !rides.empty())) {
            continue;
        }
        std::vector<llama_token> toks = riding_probe(seq, it->second.size(), tokens.at(seq));
        if (!toks.empty() && n + toks.size() <= llama_n_batch(ctx_)) {
            n += toks.size();
            rides[seq] = std::move(toks);
        }
    }
    return rides;
}

void Engine::run_probe(llama_seq_id seq, const std::vector<llama_token> * prompt) {
    const ProbeSpec spec = policy_of(seq).probe();
    switch (spec.source) {
        case ProbeSource::none:
            return;
        case ProbeSource::question:
        case ProbeSource::catalyst:
            probe(seq, question_or_catalyst(seq, prompt));
            return;
        case ProbeSource::repeat: {
            // the entries no probe has seen yet, repeated after the instruction in pieces of at most one batch
            const SeqState & st = seqs_.at(seq).state();
            std::vector<llama_token> unseen;
            for (size_t i = 0; i < st.tokens.size(); ++i) {
                if (st.scores.probe[i] == 0.0f) {
                    unseen.push_back(st.tokens[i]);
                }
            }
            const int32_t piece = std::min<int32_t>((int32_t) params_.n_batch, room(seq) - (int32_t) repeat_prefix_.size());
            if (piece < 1) {
                throw std::invalid_argument("no room for the repeat probe beside sequence " + std::to_string(seq) + "'s " +
                                            std::to_string(st.positions.size()) + " entries: use a larger n_ctx (or 0)");
            }
            for (size_t a = 0; a < unseen.size(); a += (size_t) piece) {
                std::vector<llama_token> toks = repeat_prefix_;
                toks.insert(toks.end(), unseen.begin() + a, unseen.begin() + std::min(unseen.size(), a + piece));
                probe(seq, toks);
            }
            return;
        }
    }
}

void Engine::probe(llama_seq_id seq, const std::vector<llama_token> & toks) {
    if (toks.empty()) {
        return;
    }
    SeqCache & sc = seqs_.at(seq);
    const auto t0 = std::chrono::steady_clock::now();
    const int32_t n_old = sc.size();
    probe_sums_.assign((size_t) n_old*n_head_, 0.0f);
    // a batch at a time; the sums of all its queries over the entries it probes, as one decode would give them
    for (size_t a = 0; a < toks.size(); a += n_batch()) {
        decode({{seq, std::vector<llama_token>(toks.begin() + a, toks.begin() + std::min(toks.size(), a + n_batch()))}},
               false, {}, {seq});
    }
    finish_probe(seq, (int32_t) toks.size(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

void Engine::finish_probe(llama_seq_id seq, int32_t n_toks, double seconds) {
    SeqCache & sc = seqs_.at(seq);
    sc.drop_newest(n_toks);
    const Policy & policy = policy_of(seq);
    sc.observe_probe(policy, probe_sums_, n_toks, policy.probe().source == ProbeSource::repeat);
    sc.note_probe(seconds);
}

void Engine::add_probe_sums(const SeqCache & sc, const llama_pos * pos, const float * sums, int32_t n) {
    const size_t n_old = probe_sums_.size()/n_head_;
    const auto & kept = sc.state().positions;
    if ((size_t) n < n_old || !std::equal(kept.begin(), kept.begin() + n_old, pos)) {
        throw std::logic_error("a probe's attention scores do not cover the entries it probes");
    }
    for (size_t i = 0; i < probe_sums_.size(); ++i) {
        probe_sums_[i] += sums[i];
    }
}

} // namespace h2o
