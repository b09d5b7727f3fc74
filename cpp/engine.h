// The engine: one llama.cpp context, the sequences in it, and the scheduler that feeds them.
//
// Every public method holds the engine's mutex, so calls from several threads are serialized instead of racing
// inside llama.cpp; what they return is a copy.
//
// Every llama_decode is followed, for each sequence of the batch, by the policy's observation of the exported
// attention scores and, when the sequence holds more than its budget, an eviction (SeqCache). Prompts that do not
// fit beside the kept entries are fed in pieces, evicting when the next piece needs the cells (the bounded prefill).
//
// Defined by job: engine.cpp (the context, eval's phases, decode, compaction), engine_policy.cpp, engine_probe.cpp,
// engine_recall.cpp and engine_snapshot.cpp.
#pragma once

#include "engine_params.h"
#include "model.h"
#include "policy.h"
#include "prefill_plan.h"
#include "prober.h"
#include "sampler.h"
#include "seq_cache.h"
#include "seq_settings.h"

#include "llama.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace h2o {

class Engine {
public:
    Engine(const std::string & model_path, const EngineParams & params);
    ~Engine();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    // --- feeding: prompts and generated tokens, in one batch for all sequences
    // tokens of other sequences to decode with a long feed's next chunk (a server's running requests: their next
    // tokens ride with the prompt, as in llama-server's continuous batching)
    using Riders   = std::map<llama_seq_id, std::vector<llama_token>>;
    using TokenMap = std::map<llama_seq_id, std::vector<llama_token>>; // tokens to feed, per sequence
    // feed tokens to sequences (one batch for all), evicting as the policy says; with logits_all every fed
    // token's logits are kept (see logits_all), otherwise only each sequence's last. between_chunks, when set, is
    // called between the chunks of a long feed and returns riders: sequences with streams of their own, not fed
    // in this call, whose tokens are decoded (and evicted for) with the next chunk; it may also eval such
    // sequences itself, or throw to stop the feed, as check_interrupt may
    void eval(const TokenMap & tokens, bool logits_all, const std::function<Riders()> & between_chunks = {});
    // the next token of seq, drawn from its last logits where they are (no copy)
    llama_token sample(llama_seq_id seq, Sampler & sampler) const;

    void reset();                      // every sequence
    void reset_seq(llama_seq_id seq);
    // forget what seq was fed from its n-th token on (SeqCache::truncate); its last logits go with it
    void truncate(llama_seq_id seq, int64_t n);

    // evict now what the current policy would not keep (after set_policy, say)
    void compress(llama_seq_id seq);

    // --- per-sequence settings: policy, protected prefix
    // switch the policy of every sequence for what follows (those with a policy of their own too); the engine keeps
    // exporting scores if the new policy needs them
    void set_policy(PolicyPtr policy);
    // a policy for seq alone (kept when seq is reset), until set_policy or nullptr (the engine's again); checked as
    // set_policy checks: scores it needs must be exported, its budget and probe must fit a stream
    void set_seq_policy(llama_seq_id seq, PolicyPtr policy);
    // seq's policy (nullptr: the engine's) and recall (entries in host memory, 0 off, -1: the engine's) at once,
    // the combination checked once before either changes (a server slot between two requests)
    void configure_seq(llama_seq_id seq, PolicyPtr policy, int64_t recall_cap);
    bool has_seq_policy(llama_seq_id seq) const;
    // never evict the n_keep oldest entries of seq (a system prompt, say; llama.cpp's --keep): they count inside the
    // budget, and the policy decides over the rest; reset_seq / reset clear it
    void set_keep(llama_seq_id seq, int32_t n_keep);

    // --- recall: evicted entries in host memory, brought back by a question
    // recall on (cap: evicted entries each sequence keeps in host memory) or off (0: the stores are emptied)
    void set_recall(int64_t cap);
    // recall (cap > 0) needs a question probe, no per-head cells, no rolling: throws std::invalid_argument otherwise
    void check_recall(const Policy & policy, int64_t cap) const;
    // recall for seq alone (kept when seq is reset): cap entries in host memory, 0 off; -1: the engine's again
    void set_seq_recall(llama_seq_id seq, int64_t cap);
    // bring back now what `question` ranks above seq's kept entries of what it spilled (the question is not fed)
    void recall_for(llama_seq_id seq, const std::vector<llama_token> & question);
    // what seq spilled to host memory (recall): positions, tokens, counters; with_kv: the entries' bytes as well
    HostStore host(llama_seq_id seq, bool with_kv) const;

    // --- snapshots
    std::shared_ptr<SeqSnapshot> snapshot(llama_seq_id seq);
    void restore(llama_seq_id seq, const SeqSnapshot & snap);

    // --- inspection: logits, state, cells, and the context as resolved
    std::vector<float> last_logits(llama_seq_id seq) const;
    std::vector<float> logits_all(llama_seq_id seq) const; // [n_fed][n_vocab] of the last eval
    std::vector<float> take_logits_all(llama_seq_id seq);  // the same, moved out (the engine keeps none)
    SeqState state(llama_seq_id seq) const;
    // the K and V bytes of seq's cells at positions (llama_kv_entries_get; entry_size() bytes each)
    std::vector<uint8_t> kv_entries(llama_seq_id seq, const std::vector<llama_pos> & positions);
    size_t entry_size() const; // bytes of one entry's K and V (0: this cache cannot keep entries apart)
    llama_pos next_pos(llama_seq_id seq) const; // position of the next token fed to seq
    // what the patch exported for seq in the last llama_decode: positions and [n][n_head] sums
    void last_scores(llama_seq_id seq, std::vector<llama_pos> & pos, std::vector<float> & sums) const;
    // the cached keys of seq's kept entries in layer il (F32, after RoPE); n_embd = 0 when the layer has none
    void keys(llama_seq_id seq, int32_t il, std::vector<llama_pos> & pos, std::vector<float> & keys, int32_t & n_embd) const;

    const Model  & model()  const { return *model_; }
    const Policy & policy() const { return settings_.policy(); }
    const Policy & policy_of(llama_seq_id seq) const; // seq's own policy, or the engine's
    const EngineParams & params() const { return params_; }
    llama_context * ctx()   const { return ctx_; }
    uint32_t n_ctx()    const { return llama_n_ctx(ctx_); }
    uint32_t n_batch()  const { return n_batch_; }  // tokens a prompt is read in per chunk
    uint32_t n_ubatch() const { return n_ubatch_; } // and per ubatch (llama.cpp's are larger by a riding probe)
    int32_t n_threads() const { return llama_n_threads(ctx_); }
    int32_t n_threads_batch() const { return llama_n_threads_batch(ctx_); }
    uint32_t capacity() const { return capacity_; } // cells the engine fills: n_ctx as asked, before llama.cpp pads it
    uint32_t stream_capacity() const;               // cells of one stream: all of them, or a sequence's share
    int32_t  room(llama_seq_id seq) const;          // cells still free for seq (shared by all in a unified cache)
    bool     kv_unified() const { return params_.kv_unified; }
    int32_t  n_head()   const { return n_head_; }
    bool     scores_sum_rows() const { return scores_path_ == 1; }
    bool     flash_attn() const; // whether the context runs flash attention, as llama.cpp resolved it
    size_t   kv_bytes() const;    // bytes allocated for the KV cache
    // cells a policy's probe needs beside a sequence's entries (the repeat probe: its instruction + one batch)
    int32_t  probe_cells(const Policy & policy) const;
    // whether a prompt's question (or catalyst) probe is decoded in the same llama_decode as the chunk before the
    // eviction it ranks for, its queries' attention summed apart (llama_attn_scores_probe), rather than after it
    bool     probe_rides() const { return prober_.rides(); }
    int32_t  cells_used() const;  // KV entries held by all sequences
    int64_t  n_decode() const { return n_decode_; } // llama_decode calls made so far
    int32_t  n_graphs_reused() const { return llama_perf_context(ctx_).n_reused; } // decodes that reused the last graph

private:
    SeqCache & seq_cache(llama_seq_id seq); // checks the id, creates the sequence on first use
    const std::vector<float> & logits_of(llama_seq_id seq) const;
    int32_t size_of(llama_seq_id seq) const;
    std::string origin() const; // what a snapshot must match to be restored here
    std::string kv_types() const; // "F16", "q8_0/F16", ...
    // eval's phases: check the tokens (clearing logits_all's rows), plan the feed, bring back what each prompt asks
    // for (recall), feed the plan's steps with their riders, evicting after each as the plan says
    size_t check_tokens(const TokenMap & tokens, bool logits_all);
    bool plan_bounded(const TokenMap & tokens) const; // every fed sequence's policy is bounded
    PrefillPlan plan_for(const TokenMap & tokens, bool with_riders) const;
    bool feed_may_evict(llama_seq_id seq, size_t n, const Policy & policy) const;
    // each fed sequence as it was after its last eviction: an eviction that fails (a policy written in Python that
    // raises) drops what was fed since, so every sequence stays within its budget and usable, as after a failed decode
    struct CleanState {
        std::map<llama_seq_id, SeqState> states;
        std::map<llama_seq_id, std::optional<std::vector<float>>> logits;
    };
    void mark_clean(CleanState & clean, llama_seq_id seq) const;
    // probed: its probe rode with the chunk just decoded (riding_probes), so the eviction runs none
    void evict_or_roll_back(CleanState & clean, llama_seq_id seq, const std::vector<llama_token> * prompt,
                            bool probed = false);
    void recall_prompts(CleanState & clean, const TokenMap & tokens);
    void feed_steps(CleanState & clean, const PrefillPlan & plan, const TokenMap & tokens, bool logits_all,
                    const std::function<Riders()> & between_chunks);
    // riders: valid tokens of existing sequences, each with a stream of its own, none of them being fed
    void check_riders(const Riders & riders, const TokenMap & fed);
    // query_windows: the sequences whose tokens in chunk are their prompt's query window (Policy::query_window)
    // probes: the sequences whose tokens in chunk are a probe's (observed into SeqScores::probe; they give no logits)
    // rides: the probes decoded after their sequence's tokens in chunk (riding_probe), then removed
    void decode(const std::map<llama_seq_id, std::vector<llama_token>> & chunk, bool logits_all,
                const std::set<llama_seq_id> & query_windows = {}, const std::set<llama_seq_id> & probes = {},
                const TokenMap & rides = {});
    // decode()'s steps: the batch (the chunk, then the riding probes), llama_decode, the logits kept (a probe's give
    // none), the new entries and their scores (or a probe's) observed
    void fill_batch(const TokenMap & chunk, bool logits_all, const std::set<llama_seq_id> & probes, const TokenMap & rides);
    void decode_batch(const TokenMap & chunk, const std::set<llama_seq_id> & probes);
    void keep_logits(llama_seq_id seq, int32_t first, int32_t n_new, bool logits_all);
    void observe_decoded(llama_seq_id seq, const std::vector<llama_token> & toks, bool probing, bool window,
                         const std::vector<llama_token> * ride);
    // the probe seq's eviction after its next n_chunk tokens of prompt will run, where it can ride with them in one
    // decode (the question or catalyst probe, scores exported apart, a batch with room); else none
    std::vector<llama_token> riding_probe(llama_seq_id seq, size_t n_chunk, const std::vector<llama_token> & prompt) const;
    TokenMap riding_probes(const PrefillStep & step, const TokenMap & chunk, const TokenMap & tokens) const;
    // a probe's decode done (toks.size() queries, their sums in prober_): remove it, and rank by its attention
    void finish_probe(llama_seq_id seq, int32_t n_toks, double seconds);
    void evict(llama_seq_id seq, int32_t incoming = 0); // incoming: SeqCache::evict's
    // when seq's kept positions are renumbered (EngineParams::position_rolling, roll_interval)
    RollRule roll_rule(llama_seq_id seq) const;
    // rolling only near the trained context, where possible (roll_interval 0)
    bool rolls_when_needed() const { return params_.position_rolling && params_.roll_interval == 0; }
    // before an eviction that will remove entries, the policy's probe ranks them; `prompt` is the prompt being fed
    // (the question probe's source; null in compress())
    void probe_and_evict(llama_seq_id seq, const std::vector<llama_token> * prompt, bool probed = false);
    // whether an eviction of seq holding n entries, after prompt (null: compress()), is ranked by a probe first
    // (generation's single tokens stay unjudged)
    bool probes_before_evicting(llama_seq_id seq, int64_t n, const std::vector<llama_token> * prompt) const;
    void run_probe(llama_seq_id seq, const std::vector<llama_token> * prompt);
    // decode toks after what seq holds as a probe, then remove them (cells, positions, scores); its logits are never
    // computed, so the sequence's last logits stay those of its own last token
    void probe(llama_seq_id seq, const std::vector<llama_token> & toks);
    void compact(llama_seq_id seq);
    // before a new prompt of seq: its spilled entries, a page at a time beside the kept ones, are ranked with the kept
    // ones by the question probe (the prompt's last tokens) and the policy keeps the best within its budget; the rest
    // go (back) to the host store
    // prompt: what ranks (its last `question` tokens); fed: whether it is fed right after (a prompt, not recall_for)
    void recall(llama_seq_id seq, const std::vector<llama_token> & prompt, bool fed);
    // a recall step's first page: the windows of the store's dropped text that the question's tokens find
    // (recall_text.h), at most the policy's reread tokens and the cells beside the kept ones, decoded again after the
    // kept entries (as a probe: their attention ranks nothing), as entries of their own places; none when nothing
    // was dropped or found
    HostStore::Entries reread(llama_seq_id seq, const std::vector<llama_token> & question);
    // the origins of the host entries a recall step probes, in the order it probes them: all of them in the
    // conversation's order, or, past the policy's recall_pages (and past its budget), those the question's queries
    // rank first against the stored keys (the question is probed once for its queries: recall_ranking.h)
    std::vector<llama_pos> recall_order(llama_seq_id seq, const std::vector<llama_token> & question, int32_t page);
    // the store's indices of `waiting` (origins), page by page (each page's in the conversation's order); page_end gets
    // where each page ends
    static std::vector<size_t> page_indices(const HostStore & host, const std::vector<llama_pos> & waiting, size_t page,
                                            std::vector<size_t> & page_end);
    void check_host(const SeqSnapshot & snap) const; // a snapshot's host store fits this cache and its positions
    void check_evictable(const Policy & policy) const; // throws when policy is bounded and the model recurrent
    // throws when policy cannot evict here, needs scores the engine does not export, or its budget and probe leave
    // no room in a stream
    void check_fits(const Policy & policy) const;
    // throws when policy's budget and probe leave no room in a stream
    void check_room(const Policy & policy) const;
    // a sequence with per-head cells only goes on under a per-head policy
    void check_parts(llama_seq_id seq, const SeqState & state, const Policy & policy) const;
    void check_per_head(const Policy & policy) const;
    void use_per_head(const Policy & policy); // turns the per-layer score export on for a per-head policy

    EngineParams params_;
    std::unique_ptr<Model>  model_;
    llama_context * ctx_ = nullptr;
    int64_t         n_decode_ = 0;
    llama_batch     batch_ {};
    int32_t  n_head_ = 0;
    KeyLayout key_layout_; // where an entry's keys are, for recall's host ranking
    uint32_t capacity_ = 0;
    int32_t  scores_path_ = -1; // llama_attn_scores_enable: 0 out_prod, 1 sum_rows, -1 off
    uint32_t n_batch_  = 0;
    uint32_t n_ubatch_ = 0;
    std::string origin_;
    Prober prober_; // the probes' tokens and the running probe's sums

    std::map<llama_seq_id, SeqCache> seqs_;
    SeqSettings settings_; // the default policy and recall cap, and each sequence's own
    std::map<llama_seq_id, std::vector<float>> last_logits_;
    std::map<llama_seq_id, std::vector<float>> logits_all_;

    mutable std::recursive_mutex mu_;
};

} // namespace h2o
