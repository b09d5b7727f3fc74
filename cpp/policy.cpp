#include "policy.h"

#include <algorithm>
#include <map>
#include <stdexcept>

namespace h2o {

namespace {

std::map<std::string, PolicyFactory> & registry() {
    static std::map<std::string, PolicyFactory> factories;
    return factories;
}

std::string joined_names() {
    std::string out;
    for (const auto & name : policy_names()) {
        out += (out.empty() ? "" : ", ") + name;
    }
    return out;
}

} // namespace

PolicyRegistration::PolicyRegistration(const char * name, PolicyFactory factory) {
    registry()[name] = factory;
}

std::unique_ptr<Policy> make_policy(const PolicyConfig & cfg) {
    const auto it = registry().find(cfg.name);
    check_policy(it != registry().end(), "unknown policy '" + cfg.name + "' (expected one of: " + joined_names() + ")");
    return it->second(cfg);
}

std::vector<std::string> policy_names() {
    std::vector<std::string> names;
    for (const auto & kv : registry()) {
        names.push_back(kv.first);
    }
    return names;
}

void check_policy(bool ok, const std::string & msg) {
    if (!ok) {
        throw std::invalid_argument(msg);
    }
}

std::vector<size_t> sinks_middle_recent(size_t n, size_t sinks, size_t recent, std::vector<size_t> middle) {
    std::vector<size_t> keep;
    keep.reserve(sinks + middle.size() + recent);
    for (size_t i = 0; i < sinks; ++i) {
        keep.push_back(i);
    }
    std::sort(middle.begin(), middle.end());
    keep.insert(keep.end(), middle.begin(), middle.end());
    for (size_t i = n - recent; i < n; ++i) {
        keep.push_back(i);
    }
    return keep;
}

void Policy::observe(SeqScores & scores, const ScoreUpdate & update) const {
    for (int32_t i = 0; i < update.n; ++i) {
        float sum = 0.0f;
        for (int32_t h = 0; h < update.n_head; ++h) {
            const float v = update.head_sums[(size_t) i*update.n_head + h];
            scores.head[(size_t) i*update.n_head + h] += v;
            sum += v;
        }
        scores.total[i] += sum;
    }
}

} // namespace h2o
