// keydiff: KeyDiff (arXiv 2504.15364; kvpress's KeyDiffPress): an entry ranks by how unlike the others its keys
// are, minus the cosine similarity between its key and the mean of the kept entries' normalised keys, per layer and
// KV head; summed over both here (one decision per token). It reads the cached keys before each eviction and needs
// no attention scores.
#include "policy.h"

#include <algorithm>
#include <cmath>

namespace h2o {

namespace {

class KeyDiffPolicy : public RankedPolicy {
public:
    using RankedPolicy::RankedPolicy;

    bool needs_scores() const override { return false; }
    bool needs_keys() const override { return true; }

    void observe_keys(SeqScores & s, const KeyView & k) const override {
        if (k.layer == 0) {
            std::fill(s.total.begin(), s.total.end(), 0.0f);
        }
        const int64_t n = k.n;
        const int64_t d = k.head_dim;
        const int64_t row = (int64_t) k.n_head_kv*d;
        std::vector<float> norm(n);
        std::vector<float> anchor(d);
        for (int64_t h = 0; h < k.n_head_kv; ++h) {
            std::fill(anchor.begin(), anchor.end(), 0.0f);
            for (int64_t i = 0; i < n; ++i) {
                const float * key = k.keys + i*row + h*d;
                float sq = 0.0f;
                for (int64_t j = 0; j < d; ++j) {
                    sq += key[j]*key[j];
                }
                norm[i] = std::max(std::sqrt(sq), 1e-12f); // F.normalize's eps
                const float w = 1.0f/(norm[i]*(float) n);  // the anchor is the mean of the unit keys
                for (int64_t j = 0; j < d; ++j) {
                    anchor[j] += key[j]*w;
                }
            }
            float anchor_sq = 0.0f;
            for (int64_t j = 0; j < d; ++j) {
                anchor_sq += anchor[j]*anchor[j];
            }
            const float anchor_norm = std::sqrt(anchor_sq);
            for (int64_t i = 0; i < n; ++i) {
                const float * key = k.keys + i*row + h*d;
                float dot = 0.0f;
                for (int64_t j = 0; j < d; ++j) {
                    dot += key[j]*anchor[j];
                }
                s.total[i] -= dot/std::max(norm[i]*anchor_norm, 1e-8f); // F.cosine_similarity's eps
            }
        }
    }
};

const PolicyRegistration reg("keydiff", make_ranked<KeyDiffPolicy, half_recent>);

} // namespace

} // namespace h2o
