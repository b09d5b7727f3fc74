// full: the unbounded cache, never evicts.
#include "policy.h"

#include <numeric>

namespace h2o {

namespace {

class FullPolicy : public Policy {
public:
    std::string name() const override { return "full"; }
    bool bounded() const override { return false; }
    BudgetSplit split() const override { return {}; }
    std::vector<size_t> select(const std::vector<llama_pos> & positions, const SeqScores &, const BudgetSplit &) const override {
        std::vector<size_t> all(positions.size());
        std::iota(all.begin(), all.end(), 0);
        return all;
    }
};

std::unique_ptr<Policy> make_full(const PolicyConfig & cfg) {
    check_policy(cfg.budget <= 0, "policy 'full' keeps everything: leave budget=None");
    check_policy(cfg.heavy <= 0 && cfg.recent <= 0 && cfg.sinks <= 0, "policy 'full' takes no heavy, recent or sinks");
    return std::make_unique<FullPolicy>();
}

const PolicyRegistration reg("full", make_full);

} // namespace

} // namespace h2o
