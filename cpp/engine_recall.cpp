// The engine's recall: host stores per sequence, their caps, and a prompt's readmission of what it asks for.
#include "engine.h"
#include "host_store.h"
#include "recall_text.h"

#include "llama-attn-scores.h"
#include "llama-ext.h"

#include <algorithm>
#include <limits>
#include <unordered_map>
#include <stdexcept>

namespace h2o {

void Engine::set_recall(int64_t cap) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    check_policy(cap >= 0, "recall's host store cap must be >= 0 entries, got " + std::to_string(cap));
    const int64_t before = settings_.recall();
    settings_.set_recall(cap);
    try {
        check_recall(settings_.policy(), cap);
        for (const auto & kv : settings_.own_policies()) {
            check_recall(*kv.second, settings_.recall_of(kv.first));
        }
    } catch (...) {
        settings_.set_recall(before);
        throw;
    }
    for (auto & kv : seqs_) {
        kv.second.set_spill(settings_.recall_of(kv.first), params_.host_q8_0);
    }
}

void Engine::recall_for(llama_seq_id seq, const std::vector<llama_token> & question) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    seq_cache(seq);
    for (const llama_token t : question) {
        model_->check_token(t);
    }
    if (question.empty()) {
        throw std::invalid_argument("recall needs a question: at least one token");
    }
    try {
        recall(seq, question, false);
    } catch (...) {
        evict(seq); // never more than the budget on the device
        throw;
    }
}

HostStore Engine::host(llama_seq_id seq, bool with_kv) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const auto it = seqs_.find(seq);
    if (it == seqs_.end()) {
        return HostStore();
    }
    const HostStore & h = it->second.host();
    return with_kv ? h.with_raw_kv(entry_size()) : h.without_kv();
}

void Engine::set_seq_recall(llama_seq_id seq, int64_t cap) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    configure_seq(seq, settings_.own_policy(seq), cap);
}

void Engine::check_recall(const Policy & policy, int64_t cap) const {
    if (cap <= 0 || !policy.bounded()) {
        return;
    }
    check_policy(policy.probe().source == ProbeSource::question,
                 "recall ranks what was evicted by the next prompt's question: policy '" + policy.name() + "' needs "
                 "the question probe (probe='question'; the default policy has it)");
    check_policy(!policy.per_head(), "recall keeps whole entries: per-head cells cannot be recalled");
    check_policy(llama_kv_entry_size(ctx_) > 0, "this model's KV cache cannot keep evicted entries apart (SWA "
                                                "layers, or no KV cache): recall is not available");
}

void Engine::recall(llama_seq_id seq, const std::vector<llama_token> & prompt, bool fed) {
    SeqCache & sc = seqs_.at(seq);
    const Policy & policy = policy_of(seq);
    if ((sc.host().size() == 0 && sc.host().text_tokens().empty()) || !policy.bounded() ||
        policy.probe().source != ProbeSource::question) {
        return;
    }
    const size_t n_question = std::min(prompt.size(), (size_t) policy.probe().question);
    const std::vector<llama_token> question(prompt.end() - n_question, prompt.end());
    const int32_t page = std::min<int32_t>((int32_t) n_batch(), room(seq) - probe_cells(policy));
    if (page < 1) {
        return; // no cells beside the kept entries (a unified cache shared by full sequences): nothing comes back
    }
    std::set<llama_pos> readmitted;
    // the dropped text the question finds, read again, plays first; what loses goes to the store, whose cap makes it
    // text again
    const HostStore::Entries reread_page = reread(seq, question);
    if (reread_page.size() > 0) {
        try {
            sc.readmit(reread_page);
        } catch (...) {
            sc.put_back_host(reread_page);
            sc.trim_host();
            throw;
        }
        readmitted.insert(reread_page.origins.begin(), reread_page.origins.end());
        probe(seq, question);
        evict(seq, fed ? (int32_t) prompt.size() : 0);
    }
    // the spilled entries a page at a time; what loses goes back to the store (after them)
    const std::vector<llama_pos> waiting = recall_order(seq, question, page);
    std::vector<size_t> page_end;
    const HostStore::Entries candidates = sc.take_host(page_indices(sc.host(), waiting, (size_t) page, page_end));
    size_t done = 0; // candidates readmitted (and then kept or spilled by the policy)
    try {
        for (const size_t end : page_end) {
            sc.readmit(candidates.slice(done, end));
            readmitted.insert(candidates.origins.begin() + done, candidates.origins.begin() + end);
            done = end;
            probe(seq, question);
            evict(seq, fed ? (int32_t) prompt.size() : 0);
        }
    } catch (...) {
        sc.put_back_host(candidates.slice(done, candidates.size()));
        throw;
    }
    int64_t kept = 0;
    for (const llama_pos o : sc.state().origins) {
        kept += readmitted.count(o);
    }
    sc.count_recalled(kept);
    sc.trim_host();
    compact(seq);
}

HostStore::Entries Engine::reread(llama_seq_id seq, const std::vector<llama_token> & question) {
    SeqCache & sc = seqs_.at(seq);
    const Policy & policy = policy_of(seq);
    const int32_t room_left = room(seq) - probe_cells(policy);
    if (policy.probe().reread <= 0 || room_left <= 0 || sc.host().text_tokens().empty()) {
        return {};
    }
    const std::vector<size_t> chosen = reread_choice(sc.host().text_tokens(), question, kRereadWindow,
                                                     (size_t) std::min(policy.probe().reread, room_left));
    if (chosen.empty()) {
        return {};
    }
    const std::vector<llama_token> toks = gather_rows(sc.host().text_tokens(), 1, chosen);
    prober_.start((size_t) sc.size(), n_head_);
    size_t done = 0;
    try {
        while (done < toks.size()) {
            const size_t b = std::min(toks.size(), done + n_batch());
            decode({{seq, std::vector<llama_token>(toks.begin() + (std::ptrdiff_t) done, toks.begin() + (std::ptrdiff_t) b)}},
                   false, {}, {seq});
            done = b;
        }
    } catch (...) {
        sc.drop_newest((int32_t) done);
        throw;
    }
    return sc.take_reread(chosen);
}

std::vector<size_t> Engine::page_indices(const HostStore & host, const std::vector<llama_pos> & waiting, size_t page,
                                         std::vector<size_t> & page_end) {
    // each page's entries in the conversation's order (the store's own order means nothing)
    std::unordered_map<llama_pos, size_t> index;
    for (size_t i = 0; i < host.size(); ++i) {
        index.emplace(host.origins()[i], i);
    }
    std::vector<size_t> out;
    for (size_t a = 0; a < waiting.size(); a += page) {
        std::vector<llama_pos> members(waiting.begin() + (std::ptrdiff_t) a,
                                       waiting.begin() + (std::ptrdiff_t) std::min(waiting.size(), a + page));
        std::sort(members.begin(), members.end());
        for (const llama_pos o : members) {
            const auto it = index.find(o);
            if (it != index.end()) {
                out.push_back(it->second);
            }
        }
        page_end.push_back(out.size());
    }
    return out;
}

std::vector<llama_pos> Engine::recall_order(llama_seq_id seq, const std::vector<llama_token> & question, int32_t page) {
    SeqCache & sc = seqs_.at(seq);
    // at least a budget's worth: with room for everything, everything is probed
    const Policy & policy = policy_of(seq);
    const int32_t pages = policy.probe().recall_pages;
    const size_t limit = std::max((size_t) std::max(pages, 0)*(size_t) page, (size_t) policy.split().total());
    if (pages > 0 && sc.host().size() > limit && sc.ranks_host()) {
        llama_attn_queries_next(ctx_);
        probe(seq, question); // ranks the kept entries as the first page's probe will again
        Queries q;
        for (const int32_t il : ranking_layers(key_layout_.n_layer)) {
            const float * rows = nullptr;
            const int32_t n = llama_attn_queries_get(ctx_, il, &q.n_head, &q.head_dim, &rows);
            if (n <= 0 || (q.n_tokens > 0 && n != q.n_tokens)) {
                q.layers.clear();
                break;
            }
            q.n_tokens = n;
            q.layers.emplace_back(rows, rows + (size_t) n*q.n_head*q.head_dim);
        }
        std::vector<llama_pos> chosen = sc.recall_candidates(q, limit, llama_n_threads(ctx_));
        if (!chosen.empty()) {
            return chosen;
        }
    }
    std::vector<llama_pos> all = sc.host().origins();
    std::sort(all.begin(), all.end());
    return all;
}

void Engine::check_host(const SeqSnapshot & snap) const {
    const HostStore & h = snap.host;
    if (h.size() == 0 && h.text_origins().empty()) {
        return;
    }
    // each entry (and each token of dropped text) a place in the conversation of its own, before what was fed last;
    // an entry's key rotated for a position
    const std::set<llama_pos> kept(snap.state.origins.begin(), snap.state.origins.end());
    std::set<llama_pos> seen;
    const auto placed = [&](llama_pos o) { return o >= 0 && o < snap.state.n_seen && kept.count(o) == 0 && seen.insert(o).second; };
    for (size_t i = 0; i < h.size(); ++i) {
        if (!placed(h.origins()[i]) || h.positions()[i] < 0) {
            throw std::invalid_argument("the snapshot's host entries do not match its positions");
        }
    }
    for (const llama_pos o : h.text_origins()) {
        if (!placed(o)) {
            throw std::invalid_argument("the snapshot's dropped text does not match its positions");
        }
    }
    if (!h.consistent() || (h.size() > 0 && !h.fits(llama_kv_entry_size(ctx_), n_head_))) {
        throw std::invalid_argument("the snapshot's host entries do not match this model's cache");
    }
    std::vector<llama_token> toks = h.tokens();
    toks.insert(toks.end(), h.text_tokens().begin(), h.text_tokens().end());
    for (const llama_token t : toks) {
        if (t < 0 || t >= model_->n_vocab()) {
            throw std::invalid_argument("the snapshot's host entries hold a token outside the vocabulary");
        }
    }
}

} // namespace h2o
