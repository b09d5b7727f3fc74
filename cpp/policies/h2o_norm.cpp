// h2o_norm: H2O ranked by the mean attention per query that could see the entry (accumulated sum / queries), the
// default of OpenVINO GenAI's cache eviction (NORM_SUM). Plain sums favour old tokens, which more queries have seen.
#include "policy.h"

namespace h2o {

namespace {

std::vector<float> mean_per_query(const SeqScores & s) {
    std::vector<float> out(s.size());
    for (size_t i = 0; i < out.size(); ++i) {
        out[i] = s.total[i] / (float) s.queries[i];
    }
    return out;
}

const PolicyRegistration reg("h2o_norm", make_ranked<RankedBy<mean_per_query>, half_recent>);

} // namespace

} // namespace h2o
