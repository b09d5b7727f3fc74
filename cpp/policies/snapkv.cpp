// snapkv: SnapKV (arXiv 2404.14469): a prompt is scored by the attention of its last `window` queries (the
// observation window, decoded on its own), smoothed over neighbouring entries by an average pool of kPool; then
// generation accumulates on top of those scores as H2O does. recent defaults to the window (min(window, half)).
#include "policy.h"

#include <algorithm>

namespace h2o {

namespace {

// 16 queries, about one question: with kvpress's 64 the window was mostly the text before the question, whose
// attention is local, and a passkey in 1-2k tokens was kept 2 times in 12 (16: 12 in 12; docs/quality.md)
constexpr int32_t kDefaultWindow = 16;
constexpr int32_t kPool   = 5;  // kvpress's kernel_size (avg_pool1d, padding kPool/2, zeros counted)

class SnapKVPolicy : public RankedPolicy {
public:
    SnapKVPolicy(std::string name, BudgetSplit split, int32_t window) : RankedPolicy(std::move(name), split), window_(window) {}

    int32_t query_window() const override { return window_; }
    void observe(SeqScores & scores, const ScoreUpdate & update) const override {
        if (update.in_query_window) {
            replace_scores(scores, update);
        } else {
            accumulate_scores(scores, update);
        }
    }

protected:
    std::vector<float> rank(const SeqScores & s) const override {
        const int64_t n = (int64_t) s.size();
        std::vector<float> out(n, 0.0f);
        for (int64_t i = 0; i < n; ++i) {
            for (int64_t j = std::max<int64_t>(0, i - kPool/2); j <= std::min(n - 1, i + kPool/2); ++j) {
                out[i] += s.total[j];
            }
            out[i] /= (float) kPool;
        }
        return out;
    }

private:
    int32_t window_;
};

std::unique_ptr<Policy> make_snapkv(const PolicyConfig & cfg) {
    const int32_t window = cfg.query_window < 0 ? kDefaultWindow : cfg.query_window;
    check_policy(window >= 1, "policy 'snapkv' needs query_window >= 1 (prompt queries that score the prompt), got " +
                 std::to_string(window));
    PolicyConfig c = cfg;
    const int32_t rest = cfg.budget - std::max(cfg.sinks, 0);
    if (c.heavy < 0 && c.recent < 0 && rest >= 1) {
        c.recent = std::min(window, half_recent(rest)); // the window's own tokens stay as the recent part
    }
    return std::make_unique<SnapKVPolicy>(cfg.name, ranked_split(c, half_recent), window);
}

const PolicyRegistration reg("snapkv", make_snapkv);

} // namespace

} // namespace h2o
