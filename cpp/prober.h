// A probe: the tokens a policy decodes after a sequence's entries to rank them before an eviction (the prompt's last
// tokens, InfiniPot's catalyst, KVzip's repeat instruction and the entries' own tokens), and the attention its queries
// give those entries, summed over its decodes. The decodes themselves are the engine's (engine_probe.cpp).
#pragma once

#include "model.h"
#include "policy.h"
#include "seq_cache.h"

#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

namespace h2o {

// the fixed text a probe decodes (InfiniPot's catalyst prompt; KVzip's repeat instruction, before the entries' own
// tokens); empty for the question probe, whose tokens are the prompt's
std::string probe_text(ProbeSource source);

class Prober {
public:
    Prober() = default;
    // repeat_batch: the most entries' tokens one repeat decode carries (the engine's n_batch)
    Prober(const Model & model, uint32_t repeat_batch);

    // cells a policy's probe needs beside a sequence's entries (the repeat probe: its instruction + one batch)
    int32_t cells(const Policy & policy) const;
    // whether an eviction of a sequence holding n entries, after prompt (null: compress()), is ranked by a probe
    // first: prompts only (generation's single tokens stay unjudged), and only when something will go
    static bool before_evicting(const Policy & policy, int64_t n, const std::vector<llama_token> * prompt);
    // the probe's tokens for the question or catalyst probe: the prompt's last ones, or the catalyst's; empty for
    // the repeat probe (repeat_pieces) and where there is no question (compress())
    std::vector<llama_token> question_or_catalyst(const Policy & policy, const std::vector<llama_token> * prompt) const;
    // the repeat probe's decodes: the instruction, then the tokens of the entries no probe has seen yet, at most
    // `piece` of them each; throws std::invalid_argument when piece leaves no room
    std::vector<std::vector<llama_token>> repeat_pieces(const SeqState & state, int32_t room) const;

    // whether a prompt's probe may ride in the decode of the chunk before it (its queries' sums exported apart)
    bool rides() const { return rides_; }
    void set_rides(bool rides) { rides_ = rides; }

    // the running probe: start over n_entries entries of n_head heads, add each decode's exported sums (pos: the
    // positions the decode saw, the probed entries' first), read what they sum to ([entry][head])
    void start(size_t n_entries, int32_t n_head);
    void add(const std::vector<llama_pos> & probed, const llama_pos * pos, const float * sums, int32_t n);
    const std::vector<float> & sums() const { return sums_; }

private:
    std::vector<llama_token> catalyst_;      // the catalyst probe's tokens
    std::vector<llama_token> repeat_prefix_; // the repeat probe's instruction, before the entries' own tokens
    uint32_t repeat_batch_ = 0;
    bool rides_ = false;
    int32_t n_head_ = 0;
    std::vector<float> sums_; // [entries probed][n_head]: the running probe's attention so far
};

} // namespace h2o
