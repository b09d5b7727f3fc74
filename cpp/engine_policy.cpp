// The engine's policies: the default and each sequence's own, and what a policy needs of the context (scores, per-head
// cells, room beside its budget) checked before it is used.
#include "engine.h"

#include "llama-attn-scores.h"
#include "llama-ext.h"

#include <algorithm>
#include <stdexcept>

namespace h2o {

void Engine::set_policy(PolicyPtr policy) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (policy == nullptr) {
        throw std::invalid_argument("set_policy needs a policy");
    }
    check_fits(*policy);
    check_recall(*policy, settings_.recall());
    for (const auto & kv : settings_.own_recalls()) {
        check_recall(*policy, kv.second);
    }
    if (policy->bounded()) {
        // protected prefixes, of the sequences held and of those to come, must still fit
        policy->split().after_prefix(params_.n_keep);
        for (const auto & kv : seqs_) {
            policy->split().after_prefix(kv.second.state().n_keep);
        }
    }
    for (const auto & kv : seqs_) {
        check_parts(kv.first, kv.second.state(), *policy);
    }
    use_per_head(*policy);
    settings_.set_policy(std::move(policy));
}

void Engine::set_seq_policy(llama_seq_id seq, PolicyPtr policy) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    configure_seq(seq, std::move(policy), settings_.own_recall(seq));
}

void Engine::configure_seq(llama_seq_id seq, PolicyPtr policy, int64_t recall_cap) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    SeqCache & sc = seq_cache(seq);
    const Policy & next = policy == nullptr ? settings_.policy() : *policy;
    const int64_t cap = recall_cap < 0 ? settings_.recall() : recall_cap;
    check_parts(seq, sc.state(), next);
    if (policy != nullptr) {
        check_fits(*policy);
    }
    check_recall(next, cap);
    if (policy != nullptr && policy->bounded()) {
        policy->split().after_prefix(sc.state().n_keep); // its protected prefix must fit the new budget
    }
    if (policy != nullptr) {
        use_per_head(*policy);
    }
    settings_.set(seq, std::move(policy), recall_cap);
    sc.set_spill(cap, params_.host_q8_0);
}

void Engine::check_parts(llama_seq_id seq, const SeqState & state, const Policy & policy) const {
    if (!state.parts.empty() && !policy.per_head()) {
        throw std::invalid_argument("sequence " + std::to_string(seq) + " holds per-head cells (each layer and KV head "
                                    "keeps its own tokens): a policy that keeps whole tokens ('" + policy.name() +
                                    "') cannot take them over; reset the sequence first");
    }
}

void Engine::check_per_head(const Policy & policy) const {
    if (policy.per_head() && params_.position_rolling && !rolls_when_needed()) {
        throw std::invalid_argument("policy '" + policy.name() + "' with per_head keeps different tokens per layer and "
                                    "KV head in a cell: position_rolling cannot shift them (not built); use absolute positions");
    }
}

void Engine::use_per_head(const Policy & policy) {
    check_per_head(policy);
    if (policy.per_head()) {
        llama_attn_scores_per_layer(ctx_, true);
    }
}

// a recurrent state (Mamba, RWKV; the recurrent layers of a hybrid) holds every token it read: nothing can leave it
void Engine::check_evictable(const Policy & policy) const {
    const llama_model * model = model_->get();
    if (policy.bounded() && (llama_model_is_recurrent(model) || llama_model_is_hybrid(model))) {
        throw std::invalid_argument("policy '" + policy.name() + "' evicts tokens from a KV cache; this model keeps a "
                                    "recurrent state (Mamba, RWKV or a hybrid), from which no token can be removed: "
                                    "use the full cache (budget=None; --budget 0 on the command line)");
    }
}

void Engine::check_fits(const Policy & policy) const {
    check_evictable(policy);
    if (policy.needs_scores() && scores_path_ < 0) {
        throw std::invalid_argument("policy '" + policy.name() + "' needs attention scores: create the engine with a "
                                    "scoring policy or export_scores=True");
    }
    check_room(policy);
}

void Engine::check_room(const Policy & policy) const {
    const uint32_t n_seq_stream = params_.kv_unified ? params_.n_seq_max : 1;
    if (policy.bounded() && n_seq_stream*policy.split().total() + probe_cells(policy) >= stream_capacity()) {
        const int32_t n_probe = probe_cells(policy);
        throw std::invalid_argument("budget " + std::to_string(policy.split().total()) +
                                    (n_probe > 0 ? " and its probe's " + std::to_string(n_probe) + " cells" : std::string()) +
                                    " leave no room in the context's " + std::to_string(capacity_) + " cells");
    }
}

bool Engine::has_seq_policy(llama_seq_id seq) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return settings_.has_policy(seq);
}

const Policy & Engine::policy_of(llama_seq_id seq) const {
    return settings_.policy_of(seq);
}

} // namespace h2o
