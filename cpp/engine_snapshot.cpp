// The engine's snapshots: a sequence's cells, state and host store taken out and put back, into a cache that matches.
#include "engine.h"

#include "llama-attn-scores.h"
#include "llama-ext.h"

#include <algorithm>
#include <stdexcept>

namespace h2o {

std::string Engine::kv_types() const {
    const std::string base = params_.kv_f32 ? "F32" : "F16";
    const std::string k = params_.type_k.empty() ? base : params_.type_k;
    const std::string v = params_.type_v.empty() ? base : params_.type_v;
    return k == v ? k : k + "/" + v;
}

std::string Engine::origin() const {
    const ModelFacts f = model_->facts();
    char buf[256];
    // flash attention keeps V untransposed: its cells cannot be restored into a context without it
    snprintf(buf, sizeof(buf), "%s, %d layers, %d/%d heads, n_embd %d, vocabulary %d, %llu parameters, %s KV%s",
             f.arch.c_str(), f.n_layer, f.n_head, f.n_head_kv, f.n_embd, f.n_vocab, (unsigned long long) f.n_params,
             kv_types().c_str(), flash_attn() ? " (flash attention)" : "");
    return buf;
}

std::shared_ptr<SeqSnapshot> Engine::snapshot(llama_seq_id seq) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    SeqCache & sc = seq_cache(seq);
    auto snap = std::make_shared<SeqSnapshot>();
    snap->origin = origin_;
    snap->kv    = sc.save_kv();
    snap->state = sc.state();
    snap->host  = sc.host();
    const auto it = last_logits_.find(seq);
    if (it != last_logits_.end()) {
        snap->logits = it->second;
    }
    return snap;
}

void Engine::restore(llama_seq_id seq, const SeqSnapshot & snap) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    SeqCache & sc = seq_cache(seq);
    if (snap.origin != origin_) {
        throw std::invalid_argument("this snapshot was taken on another model or cache (" + snap.origin +
                                    "), not this one (" + origin_ + ")");
    }
    const int32_t n_free = room(seq) + sc.size();
    if ((int64_t) snap.state.positions.size() > n_free) {
        throw std::invalid_argument("the snapshot holds " + std::to_string(snap.state.positions.size()) +
                                    " KV entries; only " + std::to_string(n_free) + " cells are free for sequence " +
                                    std::to_string(seq));
    }
    if (policy_of(seq).bounded()) {
        policy_of(seq).split().after_prefix(snap.state.n_keep); // its protected prefix must fit this budget
    }
    check_parts(seq, snap.state, policy_of(seq));
    if (snap.state.scores.n_head != n_head_ || (!snap.logits.empty() && snap.logits.size() != (size_t) model_->n_vocab())) {
        throw std::invalid_argument("the snapshot's scores or logits do not match this model");
    }
    check_host(snap);
    // a refused snapshot changes nothing: the sequence's own cells are put back
    const std::vector<uint8_t> kv_before = sc.save_kv();
    const SeqState state_before = sc.state();
    const HostStore host_before = sc.host();
    const Exchange exchange_before = sc.exchange();
    auto put_back = [&] {
        if (!sc.restore(kv_before, state_before)) {
            reset_seq(seq);
            return;
        }
        sc.set_host(host_before);
        sc.set_exchange(exchange_before);
    };
    if (!sc.restore(snap.kv, snap.state)) {
        put_back();
        throw std::invalid_argument("cannot restore the snapshot: llama.cpp refused its KV cells (damaged, or not "
                                    "enough free cells)" + llama_error_suffix());
    }
    // what llama.cpp holds now must be what the snapshot's bookkeeping says (a file may have been tampered with);
    // a model with sliding-window layers reports the window's cells, which may have dropped the oldest entries
    llama_memory_t mem = llama_get_memory(ctx_);
    const auto & pos = snap.state.positions;
    const bool empty = llama_memory_seq_pos_max(mem, seq) < 0;
    const llama_pos pos_min = llama_memory_seq_pos_min(mem, seq);
    const bool window = llama_model_n_swa(llama_get_model(ctx_)) > 0;
    if (pos.empty() ? !empty : (empty || (window ? pos_min < pos.front() : pos_min != pos.front()) ||
                                llama_memory_seq_pos_max(mem, seq) != pos.back())) {
        put_back();
        throw std::invalid_argument("the snapshot's KV cells do not match its positions");
    }
    sc.set_host(snap.host);
    logits_all_.erase(seq);
    if (snap.logits.empty()) {
        last_logits_.erase(seq);
    } else {
        last_logits_[seq] = snap.logits;
    }
}

} // namespace h2o
