// local: the last `budget` tokens. sink: the first `sinks` tokens (attention sinks) + the last `budget - sinks`,
// the StreamingLLM baseline. Neither needs scores.
#include "policy.h"

#include <algorithm>

namespace h2o {

namespace {

class WindowPolicy : public Policy {
public:
    WindowPolicy(std::string name, int32_t sinks, int32_t recent) : name_(std::move(name)), sinks_(sinks), recent_(recent) {}

    std::string name() const override { return name_; }
    BudgetSplit split() const override { return {sinks_, 0, recent_}; }
    std::vector<size_t> select(const std::vector<llama_pos> & positions, const SeqScores &,
                             const BudgetSplit & split) const override {
        return sinks_middle_recent(positions.size(), split.sinks, split.recent, {});
    }

private:
    std::string name_;
    int32_t sinks_;
    int32_t recent_;
};

void check_budget(const PolicyConfig & cfg) {
    check_has_budget(cfg);
    check_policy(cfg.heavy <= 0, "policy '" + cfg.name + "' keeps no heavy hitters: heavy must be 0");
    check_policy(cfg.recent < 0 || cfg.recent <= cfg.budget,
                 "recent=" + std::to_string(cfg.recent) + " is larger than budget=" + std::to_string(cfg.budget));
}

std::unique_ptr<Policy> make_local(const PolicyConfig & cfg) {
    check_budget(cfg);
    check_policy(cfg.sinks <= 0, "policy 'local' keeps only a recent window: sinks must be 0");
    check_policy(cfg.recent < 0 || cfg.recent == cfg.budget, "policy 'local': recent must equal budget");
    return std::make_unique<WindowPolicy>("local", 0, cfg.budget);
}

std::unique_ptr<Policy> make_sink(const PolicyConfig & cfg) {
    check_budget(cfg);
    const int32_t sinks  = cfg.sinks < 0 ? std::min(4, cfg.budget - 1) : cfg.sinks;
    const int32_t recent = cfg.recent < 0 ? cfg.budget - sinks : cfg.recent;
    check_policy(sinks + recent == cfg.budget, "policy 'sink': sinks + recent must equal budget (" + std::to_string(sinks) +
                                               " + " + std::to_string(recent) + " != " + std::to_string(cfg.budget) + ")");
    check_policy(recent >= 1, "policy 'sink': the recent window must keep at least the newest token (sinks < budget)");
    return std::make_unique<WindowPolicy>("sink", sinks, recent);
}

const PolicyRegistration reg_local("local", make_local);
const PolicyRegistration reg_sink("sink", make_sink);

} // namespace

} // namespace h2o
