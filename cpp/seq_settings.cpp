#include "seq_settings.h"

namespace h2o {

const Policy & SeqSettings::policy_of(llama_seq_id seq) const {
    const auto it = policies_.find(seq);
    return it == policies_.end() ? *policy_ : *it->second;
}

int64_t SeqSettings::recall_of(llama_seq_id seq) const {
    const auto it = recalls_.find(seq);
    return it == recalls_.end() ? recall_ : it->second;
}

PolicyPtr SeqSettings::own_policy(llama_seq_id seq) const {
    const auto it = policies_.find(seq);
    return it == policies_.end() ? nullptr : it->second;
}

int64_t SeqSettings::own_recall(llama_seq_id seq) const {
    const auto it = recalls_.find(seq);
    return it == recalls_.end() ? -1 : it->second;
}

void SeqSettings::set_policy(PolicyPtr policy) {
    policy_ = std::move(policy);
    policies_.clear();
}

void SeqSettings::set(llama_seq_id seq, PolicyPtr policy, int64_t recall_cap) {
    if (policy != nullptr) {
        policies_[seq] = std::move(policy);
    } else {
        policies_.erase(seq);
    }
    if (recall_cap < 0) {
        recalls_.erase(seq);
    } else {
        recalls_[seq] = recall_cap;
    }
}

} // namespace h2o
