// One sequence's KV cache as the engine sees it: the positions it keeps, their scores and counters, and the three
// things done to it: evict what the policy does not keep, roll the kept positions back to 0..n-1, and snapshot.
#pragma once

#include "host_store.h"
#include "recall_ranking.h"
#include "policy.h"

#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

namespace h2o {

// A sequence's cells under a per-head policy (Policy::per_head): every scored layer and KV head (a "part") keeps its
// own entries, moved into the cells the others free. A part's entries are in position order (what a policy's
// select() reads), each with the cell that holds it: entry j of part k is position pos[k][j], held in cell
// cell[k][j] (an index into SeqState::positions, the position each cell was written at, which the mask reads).
struct HeadParts {
    std::vector<int32_t> layers;   // the scored layers, in order (part = layer index * n_head_kv + KV head)
    int32_t n_head_kv = 0;
    std::vector<std::vector<llama_pos>> pos;  // [part][entry], ascending
    std::vector<std::vector<int32_t>>   cell; // [part][entry]
    std::vector<SeqScores> scores;            // [part]: aligned with pos; n_head: the query heads of the group

    bool empty() const { return pos.empty(); }
    // [n_cells]: the position each cell holds in part k
    std::vector<llama_pos> positions_in_cells(size_t k) const {
        std::vector<llama_pos> out(pos[k].size());
        for (size_t j = 0; j < pos[k].size(); ++j) {
            out[cell[k][j]] = pos[k][j];
        }
        return out;
    }
};

struct SeqState {
    std::vector<llama_pos> positions;   // kept positions, ascending
    // each kept entry's place in the conversation: the position it was fed at, which a roll does not change (equal
    // to positions until the sequence rolls); the order recall merges entries back in
    std::vector<llama_pos> origins;
    std::vector<llama_token> tokens;    // the token of each kept entry (aligned with positions)
    SeqScores scores;                   // aligned with positions
    llama_pos next_pos   = 0;           // position of the next token fed
    int64_t   n_seen     = 0;           // tokens fed
    int64_t   n_evicted  = 0;
    int32_t   peak_cells = 0;           // most entries held at once (between a decode and its eviction)
    int32_t   n_keep     = 0;           // the oldest entries never evicted (a protected prefix, inside the budget)
    double    evict_seconds = 0.0;      // time spent choosing and removing what is evicted (moves included)
    double    probe_seconds = 0.0;      // time spent in probe decodes (the device's work and the wait for it included)
    int64_t   n_probes      = 0;        // probes run (a question probe: one per eviction of a prompt)
    double    decode_seconds  = 0.0;    // in the decodes that fed it, the device's work and the wait for it (probes apart)
    double    compact_seconds = 0.0;    // moving its kept cells to the bottom of the cache after a prompt
    int64_t   n_head_moves  = 0;        // per-head cells: K/V slices of one layer's KV head moved between cells
    HeadParts parts;                    // per-head cells (empty: every cell holds its own position everywhere)
};

// A sequence's cache and its bookkeeping, to branch several continuations from one prefix.
struct SeqSnapshot {
    std::string          origin; // the model and cache layout it was taken from (restored only into the same)
    std::vector<uint8_t> kv;     // llama_state_seq_get_data
    HostStore            host;   // what it spilled (recall)
    SeqState             state;
    std::vector<float>   logits; // after the last token
    std::vector<llama_token> pending; // shown to the user but not fed yet (fed first when the session goes on)
};


// Where a sequence stands in its conversation (the reply option): the last exchange, [reply_from, reply_to), the
// question that ended the previous prompt and the answer generated before the latest; and the first entry
// generated since the latest prompt (-1: none). Origins (SeqState::origins), which rolling does not change. Not
// saved with a snapshot (a loaded sequence has none).
struct Exchange {
    llama_pos generated_from = -1;
    llama_pos reply_from     = -1;
    llama_pos reply_to       = -1;
};

// When a sequence's kept positions are renumbered 0..n-1 (a K shift of every kept key): never (off), or once they
// drifted `interval` or more past the count of kept entries, and then only once its next position reaches `after`
// (0: at any position). Rolling only near the trained context keeps every position as it was fed below it.
struct RollRule {
    bool      on       = false;
    int32_t   interval = 1;
    llama_pos after    = 0;

    bool due(const SeqState & st) const {
        return on && st.next_pos - (llama_pos) st.positions.size() >= interval && st.next_pos >= after;
    }
};

class SeqCache {
public:
    SeqCache(llama_context * ctx, llama_seq_id seq, int32_t n_head);

    // the indices of positions to keep: a protected prefix of n_keep, then what the policy keeps of the rest
    static std::vector<size_t> select(const Policy & policy, const std::vector<llama_pos> & positions,
                                      const SeqScores & scores, size_t n_keep);
    // the same within `split` (the policy's own, or its split_before a prompt)
    static std::vector<size_t> select(const Policy & policy, const BudgetSplit & split,
                                      const std::vector<llama_pos> & positions, const SeqScores & scores, size_t n_keep);

    const SeqState & state() const { return st_; }
    int32_t size() const { return (int32_t) st_.positions.size(); }
    llama_pos next_pos() const { return st_.next_pos; }

    // tokens were decoded at next_pos.. : add their entries
    void append(const std::vector<llama_token> & tokens);
    // fold the scores the patch exported in the last decode (checked against the kept positions)
    void observe(const Policy & policy, const llama_pos * pos, const float * head_sums, int32_t n, int32_t n_new,
                 bool in_query_window, bool add_to_baseline = true);
    // fold each scored layer's scores of the last decode into its KV heads' part scores (a per-head policy)
    void observe_heads(const Policy & policy, int32_t n_new, bool in_query_window);
    // a probe's attention to the entries: head_sums [size()][n_head] summed over its n_queries queries; with the
    // policy's reply option the last answer's entries are marked to be kept first (SeqScores::probe < 0)
    void observe_probe(const Policy & policy, const std::vector<float> & head_sums, int32_t n_queries, bool keep_best);
    // n tokens are about to be fed: one is a generation step, more a prompt, which makes what was generated since
    // the previous prompt, with that prompt's last `question` tokens (what it asked), the last exchange
    void note_feed(size_t n, int32_t question);
    void note_probe(double seconds) { st_.probe_seconds += seconds; ++st_.n_probes; }
    void note_decode(double seconds) { st_.decode_seconds += seconds; }
    void note_compact(double seconds) { st_.compact_seconds += seconds; }
    const Exchange & exchange() const { return exchange_; }
    void set_exchange(const Exchange & exchange) { exchange_ = exchange; }
    // remove what the policy does not keep; renumber the kept positions when `roll` says so.
    // incoming: the tokens of a prompt fed right after (recall ranks before it): Policy::split_before
    void evict(const Policy & policy, const RollRule & roll, int32_t incoming = 0);
    // whether some kept or spilled entry sits at another position than it was fed at (the sequence rolled)
    bool rolled() const;
    // drop the entries at next_pos and above (a decode that failed half-way)
    void drop_unfinished();
    // back to `before`, a state of this sequence taken before its last chunk, whose cells are then dropped (an
    // eviction that failed before it removed anything)
    void roll_back(const SeqState & before);
    // remove the n newest entries (a probe's): their cells, positions and scores; the position goes back
    void drop_newest(int32_t n);
    // forget what was fed from the conversation's n-th token on (origins >= n): those entries leave the cache and the
    // host store, and the next token is the n-th again; what was evicted meanwhile stays evicted (in the store, with
    // recall). A conversation re-rendered differently near its end goes on from the common part. Throws
    // std::invalid_argument for n outside [0, n_seen] or under a per-head policy
    void truncate(int64_t n);
    void clear();

    // recall: evicted entries go to a host store of at most cap entries (the lowest positions are dropped beyond
    // it) instead of being destroyed; 0 turns it off (and empties the store)
    // q8: the store keeps q8_0 blocks of the cache's F16 rows (about half the bytes; the caller checked the types)
    void set_spill(int64_t cap, bool q8 = false);
    int64_t spill_cap() const { return spill_cap_; }
    const HostStore & host() const { return host_; }
    // put back a store taken with this sequence's state (a snapshot); throws if its entries do not fit this cache
    void set_host(const HostStore & host);
    // the store's entries at `indices` leave it, in that order (a recall step's candidates, taken at once)
    HostStore::Entries take_host(const std::vector<size_t> & indices);
    // taken entries that were not readmitted go back to the store
    void put_back_host(const HostStore::Entries & e);
    // bring taken entries back into the cache, merged with the kept ones in the conversation's order (origins), their
    // scores as they left: at their own positions, or, in a sequence that rolled, with every entry renumbered 0..n-1
    // in that order (each key shifted from where it was to its new place); throws std::runtime_error when llama.cpp
    // has no room for them
    void readmit(const HostStore::Entries & taken);
    void count_recalled(int64_t n) { host_.count_recalled(n); }
    // the store's dropped text at `indices` (of HostStore::text_origins), just decoded again as this sequence's n
    // newest entries: those entries leave the cache and the text, as entries of their own places (their keys rotated,
    // where the sequence never rolled, for their own positions) and their scores as they left, to readmit
    HostStore::Entries take_reread(const std::vector<size_t> & indices);
    void trim_host() { host_.drop_oldest((size_t) spill_cap_); }
    // where an entry's keys are (an invalid layout: the host entries are not ranked on the host)
    void set_key_layout(const KeyLayout & layout) { layout_ = layout; }
    bool ranks_host() const { return layout_.valid() && !host_.q8_0(); }
    // the origins of the host entries a question with these queries should probe, at most `limit`: the blocks whose
    // best member the queries lift most (recall_ranking.h), best first; empty when they cannot be ranked so
    std::vector<llama_pos> recall_candidates(const Queries & queries, size_t limit, int32_t n_threads);

    std::vector<uint8_t> save_kv() const;
    // put back a saved sequence (a snapshot's cells and state; its last exchange is unknown); returns false (and
    // leaves the sequence empty) when llama.cpp cannot place the cells
    bool restore(const std::vector<uint8_t> & kv, const SeqState & state);
    // move the kept cells together at the bottom of the stream (save and restore them): the same entries, and the
    // same place in the conversation; false as restore()
    bool compact_cells();

    // protect the n oldest entries from eviction (0: none); throws std::invalid_argument when they leave the
    // policy no room for the newest token
    void set_keep(const Policy & policy, int32_t n);

private:
    // evict() of a per-head policy: each (layer, KV head) keeps what the policy chooses from its own parts; the
    // cells most parts keep stay, and the parts kept in the other cells move into the stayers' evicted parts
    void evict_heads(const Policy & policy);
    void init_parts();
    // keep the entries at `keep` (ascending): the others' cells are removed, positions, tokens and scores gathered
    void keep_entries(const std::vector<size_t> & keep);
    void observe_keys(const Policy & policy); // the policy reads the kept entries' keys of every layer
    void roll_positions();
    // readmit() in a sequence that rolled: kept and returning entries renumbered 0..n-1 in origin order
    void readmit_renumbered(const HostStore::Entries & taken);
    // the returning entries' bookkeeping merged with the kept entries' in origin order (positions as they are)
    std::vector<size_t> merge(const HostStore::Entries & taken);

    void forget_keys() { keys_.clear(); key_rows_ = 0; }
    // keep the `kept` oldest entries (the others' cells removed); their indices
    std::vector<size_t> keep_oldest(size_t kept);
    // copy the entries at `indices` (ascending) to the host store, before their cells are removed
    void spill(const std::vector<size_t> & indices);

    llama_context * ctx_;
    llama_memory_t  mem_;
    llama_seq_id    seq_;
    SeqState        st_;

    // a key scorer's copy of the kept entries' keys, per layer with keys of its own ([row][n_embd]), for the first
    // key_rows_ positions: only new tokens are read at the next eviction (keys change only when positions roll)
    std::vector<std::vector<float>> keys_;
    size_t key_rows_ = 0;

    int64_t   spill_cap_ = 0;
    bool      spill_q8_  = false;
    HostStore host_;
    KeyLayout layout_;

    Exchange exchange_;
};

} // namespace h2o
