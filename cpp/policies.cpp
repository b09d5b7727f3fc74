#include "policies.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace h2o {

namespace {

// first `sinks` and last `recent` indices of n entries, plus `middle` (indices in [sinks, n - recent)), sorted
std::vector<size_t> sinks_middle_recent(size_t n, size_t sinks, size_t recent, std::vector<size_t> middle) {
    std::vector<size_t> keep;
    keep.reserve(sinks + middle.size() + recent);
    for (size_t i = 0; i < sinks; ++i) {
        keep.push_back(i);
    }
    std::sort(middle.begin(), middle.end());
    keep.insert(keep.end(), middle.begin(), middle.end());
    for (size_t i = n - recent; i < n; ++i) {
        keep.push_back(i);
    }
    return keep;
}

class FullPolicy : public Policy {
public:
    std::string name() const override { return "full"; }
    bool bounded() const override { return false; }
    BudgetSplit split() const override { return {}; }
    std::vector<size_t> keep(const CacheView & cache) const override {
        std::vector<size_t> all(cache.positions.size());
        std::iota(all.begin(), all.end(), 0);
        return all;
    }
};

// the StreamingLLM baseline: attention sinks + a recent window; `local` is the same with no sinks
class WindowPolicy : public Policy {
public:
    WindowPolicy(std::string name, int32_t sinks, int32_t recent) : name_(std::move(name)), sinks_(sinks), recent_(recent) {}

    std::string name() const override { return name_; }
    BudgetSplit split() const override { return {sinks_, 0, recent_}; }
    std::vector<size_t> keep(const CacheView & cache) const override {
        return sinks_middle_recent(cache.positions.size(), sinks_, recent_, {});
    }

private:
    std::string name_;
    int32_t sinks_;
    int32_t recent_;
};

// H2O: the `heavy` entries with the largest accumulated attention outside the sinks and the recent window.
// Ties go to the older position.
class H2OPolicy : public Policy {
public:
    explicit H2OPolicy(BudgetSplit split) : split_(split) {}

    std::string name() const override { return "h2o"; }
    bool needs_scores() const override { return true; }
    BudgetSplit split() const override { return split_; }
    std::vector<size_t> keep(const CacheView & cache) const override {
        const size_t n = cache.positions.size();
        std::vector<size_t> cand;
        for (size_t i = split_.sinks; i < n - split_.recent; ++i) {
            cand.push_back(i);
        }
        const size_t n_heavy = std::min<size_t>(split_.heavy, cand.size());
        std::partial_sort(cand.begin(), cand.begin() + n_heavy, cand.end(), [&](size_t a, size_t b) {
            return cache.scores[a] > cache.scores[b] || (cache.scores[a] == cache.scores[b] && a < b);
        });
        cand.resize(n_heavy);
        return sinks_middle_recent(n, split_.sinks, split_.recent, std::move(cand));
    }

private:
    BudgetSplit split_;
};

void check(bool ok, const std::string & msg) {
    if (!ok) {
        throw std::invalid_argument(msg);
    }
}

} // namespace

std::unique_ptr<Policy> make_policy(const std::string & name, int32_t budget, int32_t heavy, int32_t recent, int32_t sinks) {
    if (name == "full") {
        check(budget < 0 || budget == 0, "policy 'full' keeps everything: leave budget=None");
        return std::make_unique<FullPolicy>();
    }
    check(name == "h2o" || name == "local" || name == "sink",
          "unknown policy '" + name + "' (expected one of: full, local, sink, h2o)");
    check(budget >= 1, "policy '" + name + "' needs a budget >= 1 (KV entries kept per sequence), got " + std::to_string(budget));
    check(heavy  < 0 || heavy  <= budget, "heavy=" + std::to_string(heavy) + " is larger than budget=" + std::to_string(budget));
    check(recent < 0 || recent <= budget, "recent=" + std::to_string(recent) + " is larger than budget=" + std::to_string(budget));

    if (name == "local") {
        check(heavy <= 0 && sinks <= 0, "policy 'local' keeps only a recent window: heavy and sinks must be 0");
        check(recent < 0 || recent == budget, "policy 'local': recent must equal budget");
        return std::make_unique<WindowPolicy>("local", 0, budget);
    }
    if (name == "sink") {
        check(heavy <= 0, "policy 'sink' keeps no heavy hitters: heavy must be 0");
        const int32_t s = sinks < 0 ? std::min(4, budget - 1) : sinks;
        const int32_t r = recent < 0 ? budget - s : recent;
        check(s + r == budget, "policy 'sink': sinks + recent must equal budget (" + std::to_string(s) + " + " +
                               std::to_string(r) + " != " + std::to_string(budget) + ")");
        check(r >= 1, "policy 'sink': the recent window must keep at least the newest token (sinks < budget)");
        return std::make_unique<WindowPolicy>("sink", s, r);
    }

    // h2o: heavy defaults to half of what the sinks leave, recent to the rest (the published split)
    BudgetSplit sp;
    sp.sinks = sinks < 0 ? 0 : sinks;
    check(sp.sinks + std::max(recent, 0) <= budget, "sinks + recent (" + std::to_string(sp.sinks) + " + " +
                                                    std::to_string(std::max(recent, 0)) + ") exceed budget=" + std::to_string(budget));
    const int32_t rest = budget - sp.sinks;
    if (heavy < 0 && recent < 0) {
        sp.heavy  = rest / 2;
        sp.recent = rest - sp.heavy;
    } else if (heavy < 0) {
        sp.recent = recent;
        sp.heavy  = rest - recent;
    } else if (recent < 0) {
        sp.heavy  = heavy;
        sp.recent = rest - heavy;
    } else {
        sp.heavy  = heavy;
        sp.recent = recent;
    }
    check(sp.heavy >= 0 && sp.total() == budget, "sinks + heavy + recent must equal budget (" + std::to_string(sp.sinks) + " + " +
          std::to_string(sp.heavy) + " + " + std::to_string(sp.recent) + " != " + std::to_string(budget) + ")");
    check(sp.recent >= 1, "the recent window must keep at least the newest token (recent >= 1)");
    return std::make_unique<H2OPolicy>(sp);
}

} // namespace h2o
