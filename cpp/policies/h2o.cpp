// h2o: the Heavy-Hitter Oracle (arXiv 2306.14048) as published: the `heavy` entries with the largest accumulated
// attention (Policy::observe's default), outside the first `sinks` and the `recent` newest. Ties go to the older
// position.
#include "policy.h"

#include <algorithm>

namespace h2o {

namespace {

class H2OPolicy : public Policy {
public:
    explicit H2OPolicy(BudgetSplit split) : split_(split) {}

    std::string name() const override { return "h2o"; }
    bool needs_scores() const override { return true; }
    BudgetSplit split() const override { return split_; }
    std::vector<size_t> keep(const std::vector<llama_pos> & positions, const SeqScores & scores) const override {
        const size_t n = positions.size();
        std::vector<size_t> cand;
        for (size_t i = split_.sinks; i < n - split_.recent; ++i) {
            cand.push_back(i);
        }
        const size_t n_heavy = std::min<size_t>(split_.heavy, cand.size());
        const auto & s = scores.total;
        std::partial_sort(cand.begin(), cand.begin() + n_heavy, cand.end(), [&](size_t a, size_t b) {
            return s[a] > s[b] || (s[a] == s[b] && a < b);
        });
        cand.resize(n_heavy);
        return sinks_middle_recent(n, split_.sinks, split_.recent, std::move(cand));
    }

private:
    BudgetSplit split_;
};

// heavy defaults to half of what the sinks leave, recent to the rest (the published split)
std::unique_ptr<Policy> make_h2o(const PolicyConfig & cfg) {
    const int32_t budget = cfg.budget;
    check_policy(budget >= 1, "policy 'h2o' needs a budget >= 1 (KV entries kept per sequence), got " + std::to_string(budget));
    check_policy(cfg.heavy  < 0 || cfg.heavy  <= budget, "heavy=" + std::to_string(cfg.heavy) + " is larger than budget=" + std::to_string(budget));
    check_policy(cfg.recent < 0 || cfg.recent <= budget, "recent=" + std::to_string(cfg.recent) + " is larger than budget=" + std::to_string(budget));

    BudgetSplit sp;
    sp.sinks = std::max(cfg.sinks, 0);
    check_policy(sp.sinks + std::max(cfg.recent, 0) <= budget, "sinks + recent (" + std::to_string(sp.sinks) + " + " +
                 std::to_string(std::max(cfg.recent, 0)) + ") exceed budget=" + std::to_string(budget));
    const int32_t rest = budget - sp.sinks;
    if (cfg.heavy < 0 && cfg.recent < 0) {
        sp.heavy  = rest / 2;
        sp.recent = rest - sp.heavy;
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
    return std::make_unique<H2OPolicy>(sp);
}

const PolicyRegistration reg("h2o", make_h2o);

} // namespace

} // namespace h2o
