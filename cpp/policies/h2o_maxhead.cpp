// h2o_maxhead: H2O ranked by the largest per-head accumulated score instead of the sum over heads, so a token that
// one head relies on is kept even when the other heads ignore it.
#include "policy.h"

#include <algorithm>

namespace h2o {

namespace {

class H2OMaxHeadPolicy : public RankedPolicy {
public:
    using RankedPolicy::RankedPolicy;

protected:
    std::vector<float> rank(const SeqScores & s) const override {
        std::vector<float> out(s.size());
        for (size_t i = 0; i < out.size(); ++i) {
            const float * h = s.head.data() + i*s.n_head;
            out[i] = *std::max_element(h, h + s.n_head);
        }
        return out;
    }
};

const PolicyRegistration reg("h2o_maxhead", make_ranked<H2OMaxHeadPolicy, half_recent>);

} // namespace

} // namespace h2o
