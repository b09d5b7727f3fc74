#include "prober.h"

#include <algorithm>
#include <stdexcept>

namespace h2o {

std::string probe_text(ProbeSource source) {
    switch (source) {
        case ProbeSource::catalyst: return "\n\nSummarize the previous context highlighting the most important parts.";
        case ProbeSource::repeat:   return "\n\nRepeat the previous context exactly.\n\n";
        default:                    return "";
    }
}

Prober::Prober(const Model & model, uint32_t repeat_batch)
    : catalyst_(model.tokenize(probe_text(ProbeSource::catalyst), false, false)),
      repeat_prefix_(model.tokenize(probe_text(ProbeSource::repeat), false, false)),
      repeat_batch_(repeat_batch) {}

int32_t Prober::cells(const Policy & policy) const {
    const ProbeSpec spec = policy.probe();
    switch (spec.source) {
        case ProbeSource::question: return spec.question;
        case ProbeSource::catalyst: return (int32_t) catalyst_.size();
        case ProbeSource::repeat:   return (int32_t) (repeat_prefix_.size() + repeat_batch_);
        case ProbeSource::none:     break;
    }
    return 0;
}

bool Prober::before_evicting(const Policy & policy, int64_t n, const std::vector<llama_token> * prompt) {
    const bool is_prompt = prompt == nullptr || prompt->size() > 1;
    return is_prompt && policy.bounded() && n > (int64_t) policy.split().total();
}

std::vector<llama_token> Prober::question_or_catalyst(const Policy & policy,
                                                      const std::vector<llama_token> * prompt) const {
    const ProbeSpec spec = policy.probe();
    if (spec.source == ProbeSource::question && prompt != nullptr) { // compress() knows no question
        const size_t n = std::min(prompt->size(), (size_t) spec.question);
        return std::vector<llama_token>(prompt->end() - n, prompt->end());
    }
    return spec.source == ProbeSource::catalyst ? catalyst_ : std::vector<llama_token>{};
}

std::vector<std::vector<llama_token>> Prober::repeat_pieces(const SeqState & state, int32_t room) const {
    std::vector<llama_token> unseen;
    for (size_t i = 0; i < state.tokens.size(); ++i) {
        if (state.scores.probe[i] == 0.0f) {
            unseen.push_back(state.tokens[i]);
        }
    }
    const int32_t piece = std::min<int32_t>((int32_t) repeat_batch_, room - (int32_t) repeat_prefix_.size());
    if (piece < 1) {
        throw std::invalid_argument("no room for the repeat probe beside the sequence's " +
                                    std::to_string(state.positions.size()) + " entries: use a larger n_ctx (or 0)");
    }
    std::vector<std::vector<llama_token>> out;
    for (size_t a = 0; a < unseen.size(); a += (size_t) piece) {
        std::vector<llama_token> toks = repeat_prefix_;
        toks.insert(toks.end(), unseen.begin() + a, unseen.begin() + std::min(unseen.size(), a + piece));
        out.push_back(std::move(toks));
    }
    return out;
}

void Prober::start(size_t n_entries, int32_t n_head) {
    n_head_ = n_head;
    sums_.assign(n_entries*(size_t) n_head, 0.0f);
}

void Prober::add(const std::vector<llama_pos> & probed, const llama_pos * pos, const float * sums, int32_t n) {
    const size_t n_old = n_head_ > 0 ? sums_.size()/(size_t) n_head_ : 0;
    if ((size_t) n < n_old || probed.size() < n_old || !std::equal(probed.begin(), probed.begin() + n_old, pos)) {
        throw std::logic_error("a probe's attention scores do not cover the entries it probes");
    }
    for (size_t i = 0; i < sums_.size(); ++i) {
        sums_[i] += sums[i];
    }
}

} // namespace h2o
