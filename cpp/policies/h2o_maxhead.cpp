// h2o_maxhead: H2O ranked by the largest per-head accumulated score instead of the sum over heads, so a token that
// one head relies on is kept even when the other heads ignore it.
#include "policy.h"

#include <algorithm>

namespace h2o {

namespace {

std::vector<float> largest_head(const SeqScores & s) {
    std::vector<float> out(s.size());
    for (size_t i = 0; i < out.size(); ++i) {
        const float * h = s.head.data() + i*s.n_head;
        out[i] = *std::max_element(h, h + s.n_head);
    }
    return out;
}

const PolicyRegistration reg("h2o_maxhead", make_ranked<RankedBy<largest_head>, half_recent>);

} // namespace

} // namespace h2o
