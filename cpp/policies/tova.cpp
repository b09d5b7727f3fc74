// tova: Token Omission Via Attention (arXiv 2401.06104): rank by the newest query's attention alone, summed over
// heads; nothing accumulates. The last token of a prompt is decoded on its own, so after a prompt the ranking is that
// token's attention, as in the paper. recent defaults to 1 (the newest token, which attention alone may not keep).
#include "policy.h"

namespace h2o {

namespace {

class TovaPolicy : public RankedPolicy {
public:
    using RankedPolicy::RankedPolicy;

    int32_t query_window() const override { return 1; }
    void observe(SeqScores & scores, const ScoreUpdate & update) const override { replace_scores(scores, update); }
};

int32_t newest_only(int32_t) { return 1; }

const PolicyRegistration reg("tova", make_ranked<TovaPolicy, newest_only>);

} // namespace

} // namespace h2o
