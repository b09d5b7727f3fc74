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
    return prober_.cells(policy);
}

bool Engine::probes_before_evicting(llama_seq_id seq, int64_t n, const std::vector<llama_token> * prompt) const {
    return Prober::before_evicting(policy_of(seq), n, prompt);
}

void Engine::probe_and_evict(llama_seq_id seq, const std::vector<llama_token> * prompt, bool probed) {
    if (!probed && probes_before_evicting(seq, seqs_.at(seq).size(), prompt)) {
        run_probe(seq, prompt);
    }
    evict(seq);
}

std::vector<llama_token> Engine::riding_probe(llama_seq_id seq, size_t n_chunk, const std::vector<llama_token> & prompt) const {
    if (!prober_.rides() || !probes_before_evicting(seq, seqs_.at(seq).size() + (int64_t) n_chunk, &prompt)) {
        return {};
    }
    return prober_.question_or_catalyst(policy_of(seq), &prompt);
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
    const Policy & policy = policy_of(seq);
    if (policy.probe().source == ProbeSource::repeat) {
        // the entries no probe has seen yet, repeated after the instruction in pieces of at most one batch
        for (const std::vector<llama_token> & toks : prober_.repeat_pieces(seqs_.at(seq).state(), room(seq))) {
            probe(seq, toks);
        }
        return;
    }
    probe(seq, prober_.question_or_catalyst(policy, prompt));
}

void Engine::probe(llama_seq_id seq, const std::vector<llama_token> & toks) {
    if (toks.empty()) {
        return;
    }
    SeqCache & sc = seqs_.at(seq);
    const auto t0 = std::chrono::steady_clock::now();
    const int32_t n_old = sc.size();
    prober_.start((size_t) n_old, n_head_);
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
    sc.observe_probe(policy, prober_.sums(), n_toks, policy.probe().source == ProbeSource::repeat);
    sc.note_probe(seconds);
}

} // namespace h2o
