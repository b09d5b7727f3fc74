// What a sequence may set for itself over the engine's defaults: its policy and its recall cap (entries it keeps in
// host memory), as a server slot changes them between requests. Lookups only: what a setting needs of the context is
// checked by the engine (engine_policy.cpp, engine_recall.cpp) before it is set here.
#pragma once

#include "policy.h"

#include "llama.h"

#include <cstdint>
#include <map>

namespace h2o {

class SeqSettings {
public:
    SeqSettings() = default;
    SeqSettings(PolicyPtr policy, int64_t recall_cap) : policy_(std::move(policy)), recall_(recall_cap) {}

    // the defaults: what a sequence without a setting of its own runs under
    const Policy & policy() const { return *policy_; }
    int64_t recall() const { return recall_; }

    const Policy & policy_of(llama_seq_id seq) const;
    int64_t recall_of(llama_seq_id seq) const;
    bool has_policy(llama_seq_id seq) const { return policies_.count(seq) > 0; }
    PolicyPtr own_policy(llama_seq_id seq) const; // nullptr: none
    int64_t own_recall(llama_seq_id seq) const;   // -1: none
    // the sequences' own policies and recall caps (those with one)
    const std::map<llama_seq_id, PolicyPtr> & own_policies() const { return policies_; }
    const std::map<llama_seq_id, int64_t> & own_recalls() const { return recalls_; }

    // a new default policy, for every sequence: their own ones are dropped
    void set_policy(PolicyPtr policy);
    void set_recall(int64_t cap) { recall_ = cap; } // a new default cap (the sequences' own ones stay)
    // seq's own policy and recall cap (nullptr, -1: the defaults again)
    void set(llama_seq_id seq, PolicyPtr policy, int64_t recall_cap);

private:
    PolicyPtr policy_;
    int64_t   recall_ = 0;
    std::map<llama_seq_id, PolicyPtr> policies_;
    std::map<llama_seq_id, int64_t>   recalls_;
};

} // namespace h2o
