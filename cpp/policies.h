// Eviction policies: which cached entries of one sequence to keep once it holds more than the budget.
//
// A policy sees the sequence's cached positions in ascending order and their accumulated attention scores, and
// returns the indices of the entries to keep. It never touches llama.cpp: the engine applies its decision.
#pragma once

#include "llama.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace h2o {

struct CacheView {
    const std::vector<llama_pos> & positions; // ascending
    const std::vector<float>     & scores;    // aggregated over heads, aligned with positions (empty if unused)
};

// Entries kept per sequence: the first `sinks` positions, the `heavy` best-scored older ones, the `recent` newest.
struct BudgetSplit {
    int32_t sinks  = 0;
    int32_t heavy  = 0;
    int32_t recent = 0;

    int32_t total() const { return sinks + heavy + recent; }
};

class Policy {
public:
    virtual ~Policy() = default;

    virtual std::string name() const = 0;
    virtual bool bounded() const { return true; }
    virtual bool needs_scores() const { return false; }
    virtual BudgetSplit split() const = 0;

    // indices into cache.positions to keep, ascending; only called with more entries than split().total()
    virtual std::vector<size_t> keep(const CacheView & cache) const = 0;
};

// budget < 0 means none (only valid for "full"); heavy / recent / sinks < 0 mean "the default"
std::unique_ptr<Policy> make_policy(const std::string & name, int32_t budget, int32_t heavy, int32_t recent, int32_t sinks);

} // namespace h2o
