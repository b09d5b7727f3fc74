// h2o_headnorm: H2O with each head's accumulated scores divided by that head's largest before summing over heads,
// so heads with flat attention weigh as much as heads with a few sharp peaks. (Dividing by each head's total would
// change nothing: every head's softmax rows sum to one, so all heads carry the same mass.)
#include "policy.h"

#include <algorithm>

namespace h2o {

namespace {

std::vector<float> heads_over_their_peak(const SeqScores & s) {
    const size_t n = s.size();
    std::vector<float> peak(s.n_head, 0.0f);
    for (size_t i = 0; i < n; ++i) {
        for (int32_t h = 0; h < s.n_head; ++h) {
            peak[h] = std::max(peak[h], s.head[i*s.n_head + h]);
        }
    }
    std::vector<float> out(n, 0.0f);
    for (size_t i = 0; i < n; ++i) {
        for (int32_t h = 0; h < s.n_head; ++h) {
            out[i] += peak[h] > 0.0f ? s.head[i*s.n_head + h] / peak[h] : 0.0f;
        }
    }
    return out;
}

const PolicyRegistration reg("h2o_headnorm", make_ranked<RankedBy<heads_over_their_peak>, half_recent>);

} // namespace

} // namespace h2o
