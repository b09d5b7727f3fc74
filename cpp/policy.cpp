#include "policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>

namespace h2o {

namespace {

std::map<std::string, PolicyFactory> & registry() {
    static std::map<std::string, PolicyFactory> factories;
    return factories;
}

std::string joined_names() {
    std::string out;
    for (const auto & name : policy_names()) {
        out += (out.empty() ? "" : ", ") + name;
    }
    return out;
}

// each option given: a policy that ranks takes it, in its range
void check_options(const PolicyConfig & cfg, const RankedPolicy * ranked) {
    for (const PolicyOption & o : policy_options()) {
        const int32_t v = cfg.*o.field;
        if (v < 0 || (o.flag && v == 0)) {
            continue; // not given, or a flag given as off
        }
        const std::string name = o.name;
        check_policy(ranked != nullptr, "policy '" + cfg.name + "' ranks nothing: it takes no " + name);
        if (o.flag) {
            check_policy(v == 1, name + " is a flag (0 or 1), got " + std::to_string(v));
        } else if (o.maximum == std::numeric_limits<int32_t>::max()) {
            check_policy(v >= o.minimum, name + " must be >= " + std::to_string(o.minimum) + " (" + o.unit + "), got " +
                         std::to_string(v));
        } else {
            check_policy(v >= o.minimum && v <= o.maximum, name + " is in [" + std::to_string(o.minimum) + ", " +
                         std::to_string(o.maximum) + "] (" + o.unit + "), got " + std::to_string(v));
        }
    }
}

std::string label_number_suffix(const char * suffix, int32_t value) {
    return std::string("+") + suffix + std::to_string(value);
}

} // namespace

void RankedPolicy::set_options(const PolicyConfig & options) {
    options_ = options;
    for (const PolicyOption & o : policy_options()) {
        options_.*o.field = option_value(options, o);
    }
}

std::string policy_label(const Policy & p) {
    if (!p.bounded()) {
        return p.name();
    }
    const BudgetSplit split = p.split();
    const auto * ranked = dynamic_cast<const RankedPolicy *>(&p);
    std::string out = p.name() + "-" + std::to_string(split.total());
    if (ranked != nullptr && split.sinks > 0) {
        out += label_number_suffix("s", split.sinks);
    }
    if (registry().count(p.name()) == 0) {
        return out; // a scorer written in Python: its name, budget and sinks
    }
    PolicyConfig own; // the policy's own defaults at this budget
    own.name = p.name();
    own.budget = split.total();
    if (p.query_window() != make_policy(own)->query_window()) {
        out += label_number_suffix("w", p.query_window());
    }
    const ProbeSpec probe = p.probe();
    if (probe.source == ProbeSource::question) {
        out += label_number_suffix("q", probe.question);
    } else if (probe.source != ProbeSource::none) {
        out += "+" + probe_source_name(probe.source);
    }
    if (ranked == nullptr) {
        return out;
    }
    for (const PolicyOption & o : policy_options()) {
        const int32_t v = ranked->options().*o.field;
        if (!o.flag && v != o.unset) {
            out += label_number_suffix(o.suffix, v);
        }
    }
    own.sinks = split.sinks > 0 ? split.sinks : -1;
    own.query_window = p.query_window();
    if (make_policy(own)->split().recent != split.recent) {
        out += label_number_suffix("r", split.recent);
    }
    for (const PolicyOption & o : policy_options()) {
        if (o.flag && ranked->options().*o.field > 0) {
            out += std::string("+") + o.suffix;
        }
    }
    return out;
}

PolicyRegistration::PolicyRegistration(const char * name, PolicyFactory factory) {
    registry()[name] = factory;
}

std::unique_ptr<Policy> make_policy(const PolicyConfig & cfg) {
    const auto it = registry().find(cfg.name);
    check_policy(it != registry().end(), "unknown policy '" + cfg.name + "' (expected one of: " + joined_names() + ")");
    auto policy = it->second(cfg);
    check_policy(cfg.query_window < 0 || policy->query_window() == cfg.query_window,
                 "policy '" + cfg.name + "' takes no query window (query_window=" + std::to_string(cfg.query_window) + ")");
    const ProbeSource source = probe_source_from_name(cfg.probe);
    check_policy(source == ProbeSource::question || cfg.question < 0,
                 "question=" + std::to_string(cfg.question) + " is the question probe's length: it needs probe='question'");
    auto * ranked = dynamic_cast<RankedPolicy *>(policy.get());
    if (source != ProbeSource::none) {
        check_policy(ranked != nullptr && policy->needs_scores(),
                     "policy '" + cfg.name + "' ranks by no attention scores: it takes no probe");
        const int32_t question = cfg.question < 0 ? kDefaultQuestionTokens : cfg.question;
        check_policy(source != ProbeSource::question || question >= 1,
                     "the question probe needs question >= 1 (tokens), got " + std::to_string(question));
        const bool asks = source == ProbeSource::question;
        ranked->set_probe({source, asks ? question : 0,
                           asks ? option_value(cfg, *find_policy_option("recall_pages")) : 0,
                           asks ? option_value(cfg, *find_policy_option("reread")) : 0});
    }
    check_options(cfg, ranked);
    if (cfg.block >= 0) {
        check_policy(cfg.per_head <= 0, "per_head chooses entries per layer and head: it takes no block");
    }
    if (cfg.probe_share >= 0) {
        check_policy(source != ProbeSource::none, "probe_share is the share of the heavy entries a probe ranks: it "
                     "needs a probe");
    }
    if (cfg.reply > 0) {
        check_policy(source != ProbeSource::none, "reply keeps the last answer against a probe's ranking: it needs a "
                     "probe");
    }
    if (cfg.recall_pages >= 0) {
        check_policy(source == ProbeSource::question, "recall_pages chooses what a question probes among the entries "
                     "recall kept aside: it needs the question probe");
    }
    if (cfg.reread >= 0) {
        check_policy(source == ProbeSource::question, "reread reads dropped text again for a question: it needs the "
                     "question probe");
    }
    if (cfg.handoff > 0) {
        check_policy(source == ProbeSource::question, "handoff gives the recent window to what a question recalls: "
                     "it needs the question probe");
    }
    if (cfg.per_head > 0) {
        check_policy(!policy->needs_keys(), "policy '" + cfg.name + "' ranks by keys: per_head is built for the "
                     "attention scorers (h2o, tova, snapkv and their variants)");
        check_policy(ranked != nullptr && policy->needs_scores(),
                     "policy '" + cfg.name + "' ranks by no attention scores: it has no per-head choice");
        check_policy(source == ProbeSource::none, "per_head with a probe is not built yet: give one or the other");
    }
    if (ranked != nullptr) {
        ranked->set_options(cfg);
    }
    return policy;
}

ProbeSource probe_source_from_name(const std::string & name) {
    if (name.empty() || name == "none") {
        return ProbeSource::none;
    }
    for (const ProbeSource s : {ProbeSource::question, ProbeSource::repeat, ProbeSource::catalyst}) {
        if (name == probe_source_name(s)) {
            return s;
        }
    }
    throw std::invalid_argument("unknown probe '" + name + "' (expected one of: question, repeat, catalyst)");
}

std::string probe_source_name(ProbeSource source) {
    switch (source) {
        case ProbeSource::question: return "question";
        case ProbeSource::repeat:   return "repeat";
        case ProbeSource::catalyst: return "catalyst";
        case ProbeSource::none:     break;
    }
    return "";
}

std::vector<std::string> policy_names() {
    std::vector<std::string> names;
    for (const auto & kv : registry()) {
        names.push_back(kv.first);
    }
    return names;
}

void check_policy(bool ok, const std::string & msg) {
    if (!ok) {
        throw std::invalid_argument(msg);
    }
}

std::vector<size_t> sinks_middle_recent(size_t n, size_t sinks, size_t recent, std::vector<size_t> middle) {
    std::vector<size_t> keep;
    keep.reserve(sinks + middle.size() + recent);
    for (size_t i = 0; i < sinks; ++i) {
        keep.push_back(i);
    }
    // in index order: a mark per entry, not a sort (the middle is most of a budget, and per-head policies select
    // once per layer and KV head)
    std::vector<char> in_middle(n, 0);
    for (const size_t i : middle) {
        in_middle[i] = 1;
    }
    for (size_t i = sinks; i < n - recent; ++i) {
        if (in_middle[i]) {
            keep.push_back(i);
        }
    }
    for (size_t i = n - recent; i < n; ++i) {
        keep.push_back(i);
    }
    return keep;
}

void Policy::observe(SeqScores & scores, const ScoreUpdate & update) const {
    accumulate_scores(scores, update);
}

void accumulate_scores(SeqScores & scores, const ScoreUpdate & update) {
    for (int32_t i = 0; i < update.n; ++i) {
        float sum = 0.0f;
        for (int32_t h = 0; h < update.n_head; ++h) {
            const float v = update.head_sums[(size_t) i*update.n_head + h];
            scores.head[(size_t) i*update.n_head + h] += v;
            sum += v;
        }
        scores.total[i] += sum;
    }
}

void replace_scores(SeqScores & scores, const ScoreUpdate & update) {
    std::fill(scores.total.begin(), scores.total.end(), 0.0f);
    std::fill(scores.head.begin(), scores.head.end(), 0.0f);
    accumulate_scores(scores, update);
}

std::vector<float> probe_baseline(const SeqScores & scores) {
    const size_t n = scores.size();
    const int32_t n_head = scores.n_head;
    std::vector<float> base(n*n_head, 1.0f);
    if (scores.seen.size() != n*n_head || n == 0) {
        return base;
    }
    // each head's mean attention per query over the entries: an entry's own baseline is shrunk towards it by
    // kPriorQueries pseudo-queries, so that a fresh entry, seen mostly by its neighbours (whose attention is
    // local), is not judged by them alone; 5% of it floors every baseline
    constexpr float kPriorQueries = 128.0f;
    std::vector<float> mean(n_head, 0.0f);
    for (size_t i = 0; i < n; ++i) {
        for (int32_t h = 0; h < n_head; ++h) {
            mean[h] += scores.seen[i*n_head + h]/(float) scores.queries[i]/(float) n;
        }
    }
    for (size_t i = 0; i < n; ++i) {
        for (int32_t h = 0; h < n_head; ++h) {
            base[i*n_head + h] = (scores.seen[i*n_head + h] + kPriorQueries*mean[h])/
                                 ((float) scores.queries[i] + kPriorQueries) + 0.05f*mean[h] + 1e-12f;
        }
    }
    return base;
}

void observe_probe(SeqScores & scores, const float * head_sums, int32_t n_queries, bool keep_best) {
    const size_t n = scores.size();
    const int32_t n_head = scores.n_head;
    const std::vector<float> base = probe_baseline(scores);
    const float per_query = 1.0f/(float) std::max(n_queries, 1);
    for (size_t i = 0; i < n; ++i) {
        float best = 0.0f;
        for (int32_t h = 0; h < n_head; ++h) {
            best = std::max(best, head_sums[i*n_head + h]*per_query/base[i*n_head + h]);
        }
        scores.probe[i] = keep_best ? std::max(scores.probe[i], best) : best;
    }
}

std::vector<float> max_pool(const std::vector<float> & v, int32_t width, int32_t follow) {
    const int64_t n = (int64_t) v.size();
    const int64_t half = std::max(width, 1)/2;
    const int64_t back = std::max<int64_t>(half, follow);
    std::vector<float> out(v.size());
    for (int64_t i = 0; i < n; ++i) {
        const int64_t lo = std::max<int64_t>(0, i - back);
        const int64_t hi = std::min(n - 1, i + half);
        out[i] = *std::max_element(v.begin() + lo, v.begin() + hi + 1);
    }
    return out;
}

std::vector<float> block_max(const std::vector<float> & v, const std::vector<llama_pos> & positions, int32_t block) {
    std::vector<float> out(v.size());
    for (size_t a = 0, b = 0; a < v.size(); a = b) {
        b = a;
        float best = v[a];
        while (b < v.size() && positions[b]/block == positions[a]/block) {
            best = std::max(best, v[b++]);
        }
        std::fill(out.begin() + a, out.begin() + b, best);
    }
    return out;
}

BudgetSplit BudgetSplit::after_prefix(int32_t n_keep) const {
    check_policy(n_keep >= 0 && n_keep < total(), "a protected prefix of " + std::to_string(n_keep) +
                 " tokens does not fit in a budget of " + std::to_string(total()) + " (it must leave room for the newest token)");
    BudgetSplit sp = *this;
    int32_t rest = n_keep;
    const int32_t from_sinks = std::min(sp.sinks, rest);
    sp.sinks -= from_sinks;
    rest -= from_sinks;
    const int32_t from_heavy = std::min(sp.heavy, rest);
    sp.heavy -= from_heavy;
    rest -= from_heavy;
    sp.recent -= rest;
    return sp;
}

BudgetSplit RankedPolicy::split_before(int32_t incoming) const {
    BudgetSplit split = split_;
    const int32_t given = std::min(split.recent - 1, incoming);
    if (options_.handoff > 0 && given > 0) {
        split.recent -= given;
        split.heavy  += given;
    }
    return split;
}

std::vector<float> probe_order(const std::vector<llama_pos> & positions, const SeqScores & scores, int32_t pool,
                               int32_t follow, int32_t block) {
    std::vector<float> first = pool > 1 || follow > 0 ? max_pool(scores.probe, pool, follow) : scores.probe;
    if (block > 1) {
        first = block_max(first, positions, block);
    }
    for (size_t i = 0; i < first.size(); ++i) {
        if (scores.marked(i)) { // the last exchange (the reply option)
            first[i] = std::numeric_limits<float>::max();
        } else if (scores.probe[i] == 0.0f) { // not judged by a probe yet (generated tokens): before all of them
            first[i] = std::numeric_limits<float>::infinity();
        }
    }
    return first;
}

std::vector<size_t> RankedPolicy::select(const std::vector<llama_pos> & positions, const SeqScores & scores,
                                       const BudgetSplit & split) const {
    const size_t n = positions.size();
    std::vector<size_t> cand;
    for (size_t i = split.sinks; i < n - split.recent; ++i) {
        cand.push_back(i);
    }
    const size_t n_heavy = std::min<size_t>(split.heavy, cand.size());
    std::vector<float> s = rank(scores);
    std::vector<float> first; // the probe's scores come before rank() when there is a probe
    const int32_t pool = options_.pool, follow = options_.follow, block = options_.block;
    if (probe_.source != ProbeSource::none) {
        first = probe_order(positions, scores, pool, follow, block);
    } else if (pool > 1 || follow > 0 || block > 1) {
        s = max_pool(s, pool, follow);
        s = block > 1 ? block_max(s, positions, block) : s;
    }
    const auto by_rank = [&](size_t a, size_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
    if (first.empty() && cand.size() == n_heavy + 1) {
        // one entry leaves (a generation step): the lowest-ranked, found in one pass
        const size_t worst = *std::min_element(cand.begin(), cand.end(), [&](size_t a, size_t b) { return by_rank(b, a); });
        std::vector<size_t> keep;
        keep.reserve(n - 1);
        for (size_t i = 0; i < n; ++i) {
            if (i != worst) {
                keep.push_back(i);
            }
        }
        return keep;
    }
    // the probe's share of the heavy entries (all of them by default), then rank() alone for the rest
    const size_t n_first = first.empty() ? 0 : (n_heavy*(size_t) options_.probe_share + 50)/100;
    // the best n of a strict order form one set, in any order (sinks_middle_recent puts it in order): nth_element suffices
    if (n_first > 0 && n_first < cand.size()) {
        std::nth_element(cand.begin(), cand.begin() + n_first, cand.end(), [&](size_t a, size_t b) {
            return first[a] != first[b] ? first[a] > first[b] : by_rank(a, b);
        });
    }
    if (n_heavy > n_first && n_heavy < cand.size()) {
        std::nth_element(cand.begin() + n_first, cand.begin() + n_heavy, cand.end(), by_rank);
    }
    cand.resize(n_heavy);
    return sinks_middle_recent(n, split.sinks, split.recent, std::move(cand));
}

int32_t half_recent(int32_t rest) {
    return rest - rest/2;
}

void check_has_budget(const PolicyConfig & cfg) {
    check_policy(cfg.budget >= 1, "policy '" + cfg.name + "' needs a budget >= 1 (KV entries kept per sequence), " +
                 (cfg.budget < 0 ? std::string("none given (the full cache is policy 'full', or no policy)")
                                 : "got " + std::to_string(cfg.budget)));
}

BudgetSplit ranked_split(const PolicyConfig & cfg, int32_t (*default_recent)(int32_t rest)) {
    const int32_t budget = cfg.budget;
    check_has_budget(cfg);
    check_policy(cfg.heavy  < 0 || cfg.heavy  <= budget, "heavy=" + std::to_string(cfg.heavy) + " is larger than budget=" + std::to_string(budget));
    check_policy(cfg.recent < 0 || cfg.recent <= budget, "recent=" + std::to_string(cfg.recent) + " is larger than budget=" + std::to_string(budget));

    BudgetSplit sp;
    sp.sinks = std::max(cfg.sinks, 0);
    check_policy(sp.sinks + std::max(cfg.recent, 0) <= budget, "sinks + recent (" + std::to_string(sp.sinks) + " + " +
                 std::to_string(std::max(cfg.recent, 0)) + ") exceed budget=" + std::to_string(budget));
    const int32_t rest = budget - sp.sinks;
    if (cfg.heavy < 0 && cfg.recent < 0) {
        sp.recent = std::min(std::max(default_recent(rest), 1), rest);
        sp.heavy  = rest - sp.recent;
    } else if (cfg.heavy < 0) {
        sp.recent = cfg.recent;
        sp.heavy  = rest - cfg.recent;
    } else if (cfg.recent < 0) {
        sp.heavy  = cfg.heavy;
        sp.recent = rest - cfg.heavy;
    } else {
        sp.heavy  = cfg.heavy;
        sp.recent = cfg.recent;
    }
    check_policy(sp.heavy >= 0 && sp.total() == budget, "sinks + heavy + recent must equal budget (" + std::to_string(sp.sinks) +
                 " + " + std::to_string(sp.heavy) + " + " + std::to_string(sp.recent) + " != " + std::to_string(budget) + ")");
    check_policy(sp.recent >= 1, "the recent window must keep at least the newest token (recent >= 1)");
    return sp;
}

} // namespace h2o
