// Eviction policies: which cached entries of one sequence to keep once it holds more than its budget, and how the
// attention scores exported after each forward pass become the scores that decision uses.
//
// A policy never touches llama.cpp: the engine feeds it observations and applies its decisions. Each policy is one
// small class in cpp/policies/, registered by name (see docs/policies.md for how to add one).
#pragma once

#include "llama.h"
#include "policy_config.h"

#include <algorithm>
#include <functional>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace h2o {

// A probe: tokens decoded after what a sequence holds, whose attention to it ranks it, and which are then removed
// (cells, positions, scores, logits). It is run before an eviction that ends a piece of a prompt, at a prompt's end
// and on compress(), so what is evicted before the question arrives is chosen by something that looks like a reader.
enum class ProbeSource {
    none,
    question, // the prompt's own last `question` tokens (FINCH): knows the question, decoded once per piece
    repeat,   // KVzip: "Repeat the previous context exactly." + the entries' own tokens: query-agnostic, ~2x prefill
    catalyst, // InfiniPot: a short generic instruction decoded after the piece: query-agnostic and cheap
};

struct ProbeSpec {
    ProbeSource source   = ProbeSource::none;
    int32_t     question = 0; // tokens of the question probe
    int32_t     recall_pages = 0; // with recall: pages of host entries a question probes, ranked on the host (0: all)
    int32_t     reread = 0;       // with recall: tokens of the store's dropped text a question may read again
};

constexpr int32_t kDefaultQuestionTokens = 32;

// "question" -> ProbeSource::question ...; throws std::invalid_argument for an unknown name
ProbeSource probe_source_from_name(const std::string & name);
std::string probe_source_name(ProbeSource source);

// Entries kept per sequence: the first `sinks` positions, the `heavy` best-scored older ones, the `recent` newest.
struct BudgetSplit {
    int32_t sinks  = 0;
    int32_t heavy  = 0;
    int32_t recent = 0;

    int32_t total() const { return sinks + heavy + recent; }
    // the split of what follows a protected prefix of n_keep entries inside the same total: the prefix stands for
    // the sinks first, then takes its room from the heavy part, then from the recent window
    BudgetSplit after_prefix(int32_t n_keep) const;
};

// One sequence's scores, aligned with its kept positions (ascending). The engine appends an entry per fed token and
// moves entries along when it evicts; what the numbers mean is the policy's business (see Policy::observe).
// the rows of a [n][width] array at `indices`, in that order
template <typename T>
std::vector<T> gather_rows(const std::vector<T> & rows, size_t width, const std::vector<size_t> & indices) {
    std::vector<T> out;
    out.reserve(indices.size()*width);
    for (const size_t i : indices) {
        out.insert(out.end(), rows.begin() + i*width, rows.begin() + (i + 1)*width);
    }
    return out;
}

// keep only the rows of a [n][width] array at `indices` (ascending), in place
template <typename T>
void keep_rows(std::vector<T> & rows, size_t width, const std::vector<size_t> & indices) {
    // in runs of consecutive indices (an eviction step keeps long runs)
    for (size_t i = 0; i < indices.size(); ) {
        size_t e = i + 1;
        while (e < indices.size() && indices[e] == indices[e - 1] + 1) {
            ++e;
        }
        if (indices[i] != i) {
            std::copy(rows.begin() + indices[i]*width, rows.begin() + (indices[e - 1] + 1)*width, rows.begin() + i*width);
        }
        i = e;
    }
    rows.resize(indices.size()*width);
}

// remove the rows of a [n][width] array at `descending` (distinct indices, largest first), each hole filled by the
// last row: the others' order changes, but only the removed rows' bytes move
template <typename T>
void remove_rows_unordered(std::vector<T> & rows, size_t width, const std::vector<size_t> & descending) {
    size_t n = width == 0 ? 0 : rows.size()/width;
    for (const size_t i : descending) {
        --n;
        if (i != n) {
            std::copy(rows.begin() + n*width, rows.begin() + (n + 1)*width, rows.begin() + i*width);
        }
    }
    rows.resize(n*width);
}

struct SeqScores {
    int32_t n_head = 0;
    std::vector<float>   total;   // [n]: the score the policy ranks by
    std::vector<float>   head;    // [n][n_head]: per query head
    std::vector<int64_t> queries; // [n]: queries that have attended the entry so far (its own included)
    std::vector<float>   probe;   // [n]: the largest lift a probe gave the entry (observe_probe); 0: never probed
    std::vector<uint8_t> reply;   // [n] or empty (none marked): 1 for the last exchange's entries, kept before what a
                                  // probe ranks (the reply option; marked at each probe)
    std::vector<float>   seen;    // [n][n_head]: attention accumulated over the queries, per head, as if every query
                                  // gave the mean of those observed (the question probe's own tokens are not): the
                                  // probe's baseline (kept only for a policy with a probe; empty otherwise)

    size_t size() const { return total.size(); }
    bool marked(size_t i) const { return !reply.empty() && reply[i] != 0; }
    // every array covers n entries (what a snapshot's scores must do)
    bool covers(size_t n) const {
        return n_head >= 0 && total.size() == n && queries.size() == n && probe.size() == n &&
               head.size() == n*n_head && (seen.empty() || seen.size() == n*n_head) &&
               (reply.empty() || reply.size() == n);
    }

    // n_new entries fed after the others: each older one is attended by their n_new queries, new one i by the
    // n_new - i from itself on (causal)
    void append(int32_t n_new) {
        for (auto & q : queries) {
            q += n_new;
        }
        for (int32_t i = 0; i < n_new; ++i) {
            queries.push_back(n_new - i);
        }
        total.resize(queries.size(), 0.0f);
        probe.resize(queries.size(), 0.0f);
        head.resize(queries.size()*n_head, 0.0f);
        if (!reply.empty()) {
            reply.resize(queries.size(), 0);
        }
    }

    // fn(array, width) for every per-entry array held (seen and reply only when they are)
    template <typename F>
    void each_array(F && fn) {
        fn(total, 1);
        fn(head, (size_t) n_head);
        fn(queries, 1);
        fn(probe, 1);
        if (!seen.empty()) {
            fn(seen, (size_t) n_head);
        }
        if (!reply.empty()) {
            fn(reply, 1);
        }
    }

    // keep only the entries at `indices` (ascending), in place
    void keep_only(const std::vector<size_t> & indices) {
        each_array([&](auto & rows, size_t width) { keep_rows(rows, width, indices); });
    }

    // remove_rows_unordered over every array
    void remove_unordered(const std::vector<size_t> & descending) {
        each_array([&](auto & rows, size_t width) { remove_rows_unordered(rows, width, descending); });
    }

    // the entries at `indices`, in that order
    SeqScores gather(const std::vector<size_t> & indices) const {
        SeqScores out;
        out.n_head  = n_head;
        out.total   = gather_rows(total, 1, indices);
        out.head    = gather_rows(head, (size_t) n_head, indices);
        out.queries = gather_rows(queries, 1, indices);
        out.probe   = gather_rows(probe, 1, indices);
        if (!seen.empty()) {
            out.seen = gather_rows(seen, (size_t) n_head, indices);
        }
        if (!reply.empty()) {
            out.reply = gather_rows(reply, 1, indices);
        }
        return out;
    }

    // other's entries after these (the same heads); a side without a probe baseline gets zeros
    void extend(const SeqScores & other) {
        const size_t n0 = size();
        total.insert(total.end(), other.total.begin(), other.total.end());
        head.insert(head.end(), other.head.begin(), other.head.end());
        queries.insert(queries.end(), other.queries.begin(), other.queries.end());
        probe.insert(probe.end(), other.probe.begin(), other.probe.end());
        if (!seen.empty() || !other.seen.empty()) {
            seen.resize(n0*n_head, 0.0f);
            seen.insert(seen.end(), other.seen.begin(), other.seen.end());
            seen.resize(size()*n_head, 0.0f);
        }
        if (!reply.empty() || !other.reply.empty()) {
            reply.resize(n0, 0);
            reply.insert(reply.end(), other.reply.begin(), other.reply.end());
            reply.resize(size(), 0);
        }
    }
};

// The scores the patched llama.cpp exported for one sequence in one llama_decode: per kept entry and query head,
// the softmax probability summed over this decode's queries and over layers.
struct ScoreUpdate {
    const float * head_sums = nullptr; // [n][n_head], aligned with SeqScores (new entries already appended)
    int32_t n      = 0;
    int32_t n_head = 0;
    int32_t n_new  = 0;                // the last n_new entries are this decode's tokens, and its queries
    bool    in_query_window = false;   // these queries are the last Policy::query_window() tokens of a prompt
};

// The cached keys of one layer for one sequence's kept entries (F32, after RoPE), aligned with SeqScores.
struct KeyView {
    const float * keys = nullptr; // [n][n_head_kv][head_dim]
    int32_t n         = 0;
    int32_t n_head_kv = 0;
    int32_t head_dim  = 0;
    int32_t layer     = 0;        // 0 for the first layer with keys of its own: a scorer starts over there
};

class Policy {
public:
    virtual ~Policy() = default;

    virtual std::string name() const = 0;
    virtual bool bounded() const { return true; }
    virtual bool needs_scores() const { return false; }
    virtual BudgetSplit split() const = 0;
    // the split while recall ranks before a prompt of `incoming` tokens is fed (those become the recent window)
    virtual BudgetSplit split_before(int32_t /*incoming*/) const { return split(); }

    // > 0: the last N tokens of every prompt (an eval of more than one token) are decoded on their own, so observe()
    // sees their attention alone (ScoreUpdate::in_query_window); single tokens (generation) never form a window
    virtual int32_t query_window() const { return 0; }

    // true: each scored layer and KV head chooses its own entries by its own scores (SeqCache::evict_heads)
    virtual bool per_head() const { return false; }

    // a probe (see ProbeSource) ranks the entries before a prompt's evictions; its scores go to SeqScores::probe
    // (observe_probe), never through observe()
    virtual ProbeSpec probe() const { return {}; }
    // the last exchange's entries are kept before what a probe ranks (the reply option)
    virtual bool keeps_reply() const { return false; }

    // fold one decode's exported scores into the sequence's scores; the default is H2O's accumulation (the raw
    // probabilities added up, summed over heads in head order, no decay)
    virtual void observe(SeqScores & scores, const ScoreUpdate & update) const;

    // true: before each eviction the engine reads the kept entries' keys and calls observe_keys() once per layer
    virtual bool needs_keys() const { return false; }
    virtual void observe_keys(SeqScores & /*scores*/, const KeyView & /*keys*/) const {}

    // indices into positions to keep, ascending, following `split` (split(), or what a protected prefix leaves of
    // it); only called with more entries than split.total()
    virtual std::vector<size_t> select(const std::vector<llama_pos> & positions, const SeqScores & scores,
                                     const BudgetSplit & split) const = 0;
};

// The shape of every scoring policy: the first `sinks`, the `heavy` best-ranked of the rest, the `recent` newest.
// A scorer is a subclass that says how entries rank (rank()) and, when its scores do not simply accumulate, how it
// observes a decode (observe()).
class RankedPolicy : public Policy {
public:
    RankedPolicy(std::string name, BudgetSplit split) : name_(std::move(name)), split_(split) { set_options(PolicyConfig()); }

    std::string name() const override { return name_; }
    ProbeSpec probe() const override { return probe_; }
    bool keeps_reply() const override { return options_.reply > 0; }
    // the options (policy_options()), each resolved: as given, or its unset value
    const PolicyConfig & options() const { return options_; }
    bool per_head() const override { return options_.per_head > 0; }
    // by make_policy, before the policy is shared
    void set_probe(ProbeSpec probe) { probe_ = probe; }
    void set_options(const PolicyConfig & options);
    bool needs_scores() const override { return true; }
    BudgetSplit split() const override { return split_; }
    // with the handoff option: the recent window keeps only what the prompt will not replace (at least the newest
    // entry) and the heavy part takes the rest
    BudgetSplit split_before(int32_t incoming) const override;
    // by rank() (by the probe's scores first when the policy has a probe, rank() breaking ties, entries no probe
    // has judged yet first of all), each entry taking the best of the `pool` entries centred on it and of the
    // `follow` entries before it, then the best entry of its `block` of positions; ties go to the older position.
    // With a `probe_share` below 100, that share of the heavy entries is chosen so and the rest by rank() alone
    // among the others
    std::vector<size_t> select(const std::vector<llama_pos> & positions, const SeqScores & scores,
                             const BudgetSplit & split) const override;

protected:
    // one number per entry, larger = more worth keeping; the default is the accumulated total
    virtual std::vector<float> rank(const SeqScores & scores) const { return scores.total; }

private:
    std::string name_;
    BudgetSplit split_;
    ProbeSpec   probe_;
    PolicyConfig options_;
};

// A scorer that only ranks differently is one function: `make_ranked<RankedBy<mean_per_query>, half_recent>`
template <std::vector<float> (*rank_fn)(const SeqScores & scores)>
class RankedBy : public RankedPolicy {
public:
    using RankedPolicy::RankedPolicy;

protected:
    std::vector<float> rank(const SeqScores & scores) const override { return rank_fn(scores); }
};

// A bounded policy's budget: >= 1, or std::invalid_argument that says none was given.
void check_has_budget(const PolicyConfig & cfg);
// The budget split of a scoring policy from cfg (sinks default 0); when neither heavy nor recent is given, recent is
// default_recent(budget - sinks) and heavy the rest. Throws std::invalid_argument with the user-facing reason.
BudgetSplit ranked_split(const PolicyConfig & cfg, int32_t (*default_recent)(int32_t rest));
// H2O's published split: heavy half of what the sinks leave, recent the rest
int32_t half_recent(int32_t rest);

// the factory of a RankedPolicy subclass P whose constructor is RankedPolicy's: `make_ranked<P, half_recent>`
template <class P, int32_t (*default_recent)(int32_t rest)>
std::unique_ptr<Policy> make_ranked(const PolicyConfig & cfg) {
    return std::make_unique<P>(cfg.name, ranked_split(cfg, default_recent));
}

// observe() helpers: add this decode's sums to the scores (H2O), or replace the scores with them
void accumulate_scores(SeqScores & scores, const ScoreUpdate & update);
void replace_scores(SeqScores & scores, const ScoreUpdate & update);
// a probe's attention (head_sums [n][n_head], summed over its n_queries queries): per head, the entry's attention
// per probe query over the attention per query it gets from everything else (scores.seen / scores.queries), its
// lift; the largest lift over heads goes to scores.probe, replacing what was there (a probe that sees every entry:
// the question, the catalyst) or keeping the largest (keep_best: the repeat probe, whose pieces each see their own
// entries best, KVzip's max over them). The
// lift, not the raw attention: tokens that every query looks at (" the", "\n\n") draw the most raw attention
// from a probe too, and a needle's digits only stand out against what they usually get.
void observe_probe(SeqScores & scores, const float * head_sums, int32_t n_queries, bool keep_best);
// the baseline a probe's lift divides by, [n][n_head]: each entry's attention per query (scores.seen /
// scores.queries), shrunk towards the head's mean over the entries by 128 pseudo-queries, 5% of that mean as a
// floor; all ones where the scores keep no baseline
std::vector<float> probe_baseline(const SeqScores & scores);
// out[i] = the largest of v over [i - width/2, i + width/2]
// out[i] = the largest of v[i - max(width/2, follow) .. i + width/2]
std::vector<float> max_pool(const std::vector<float> & v, int32_t width, int32_t follow = 0);
// out[i] = the largest v[j] with positions[j] / block == positions[i] / block (positions ascending)
std::vector<float> block_max(const std::vector<float> & v, const std::vector<llama_pos> & positions, int32_t block);
// the order a probe gives: its lift, pooled, followed and blocked as asked; then the entries no probe judged yet
// (infinity: the answer being generated) and the last exchange's marked ones (the reply option) before every other
std::vector<float> probe_order(const std::vector<llama_pos> & positions, const SeqScores & scores, int32_t pool,
                               int32_t follow, int32_t block);

using PolicyFactory = std::unique_ptr<Policy> (*)(const PolicyConfig & cfg);

// A policy file registers its factory once: `static const PolicyRegistration reg("name", make_name);`
struct PolicyRegistration {
    PolicyRegistration(const char * name, PolicyFactory factory);
};

// a resolved policy, shared by the engine and the Python value that made it (policies hold no state of their own)
using PolicyPtr = std::shared_ptr<const Policy>;

// throws std::invalid_argument for an unknown name or an impossible split
std::unique_ptr<Policy> make_policy(const PolicyConfig & cfg);
std::vector<std::string> policy_names(); // sorted
// the short name of a resolved policy ("full", "local-256", "tova-256+s4+q32+p9+f12+r32+reply"): its budget, then what
// differs from the policy's own defaults (sinks, query window, probe, options, recent window); parse_policy_label
// reads it back
std::string policy_label(const Policy & policy);

// helpers for policy files
void check_policy(bool ok, const std::string & msg);
// the first `sinks` and last `recent` indices of n entries, plus `middle` (indices in [sinks, n - recent)), sorted
std::vector<size_t> sinks_middle_recent(size_t n, size_t sinks, size_t recent, std::vector<size_t> middle);

} // namespace h2o
