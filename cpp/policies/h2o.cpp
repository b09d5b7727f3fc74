// h2o: the Heavy-Hitter Oracle (arXiv 2306.14048) as published: the `heavy` entries with the largest accumulated
// attention (summed over heads and queries, no decay), outside the first `sinks` and the `recent` newest.
#include "policy.h"

namespace h2o {

namespace {

const PolicyRegistration reg("h2o", make_ranked<RankedPolicy, half_recent>);

} // namespace

} // namespace h2o
