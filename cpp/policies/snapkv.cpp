// snapkv: SnapKV (arXiv 2404.14469): a prompt is scored by the attention of its last kWindow queries (the
// observation window, decoded on its own), smoothed over neighbouring entries by an average pool of kPool; then
// generation accumulates on top of those scores as H2O does. recent defaults to the window (min(kWindow, half)).
#include "policy.h"

#include <algorithm>

namespace h2o {

namespace {

// 16 queries, about one question: with kvpress's 64 the window was mostly the text before the question, whose
// attention is local, and a passkey in 1-2k tokens was kept 2 times in 12 (16: 12 in 12; docs/quality.md)
constexpr int32_t kWindow = 16;
constexpr int32_t kPool   = 5;  // kvpress's kernel_size (avg_pool1d, padding kPool/2, zeros counted)

class SnapKVPolicy : public RankedPolicy {
public:
    using RankedPolicy::RankedPolicy;

    int32_t query_window() const override { return kWindow; }
    void observe(SeqScores & scores, const ScoreUpdate & update) const override {
        if (update.window) {
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
};

int32_t window_recent(int32_t rest) { return std::min(kWindow, rest - rest/2); }

const PolicyRegistration reg("snapkv", make_ranked<SnapKVPolicy, window_recent>);

} // namespace

} // namespace h2o
