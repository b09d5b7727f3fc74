// h2o: the Heavy-Hitter Oracle (arXiv 2306.14048) as published: the `heavy` entries with the largest accumulated
// attention (summed over heads and queries, no decay), outside the first `sinks` and the `recent` newest.
#include "policy.h"

namespace h2o {

namespace {

std::unique_ptr<Policy> make_h2o(const PolicyConfig & cfg) {
    return std::make_unique<RankedPolicy>("h2o", ranked_split(cfg, half_recent));
}

const PolicyRegistration reg("h2o", make_h2o);

} // namespace

} // namespace h2o
