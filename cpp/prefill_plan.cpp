#include "prefill_plan.h"

#include <algorithm>
#include <stdexcept>

namespace h2o {

namespace {

// the cells as the plan goes: what the decodes add and the evictions take away
struct CellCount {
    const PrefillInput & in;
    std::map<llama_seq_id, int64_t> cells;

    int64_t used() const {
        int64_t n = 0;
        for (const auto & kv : cells) {
            n += kv.second;
        }
        return n;
    }
    int64_t room(llama_seq_id seq) const {
        const auto it = cells.find(seq);
        return in.capacity - (in.kv_unified ? used() : (it == cells.end() ? 0 : it->second));
    }
};

// the cells before the feed; `fits`: the whole feed fits beside them without evicting
CellCount count_cells(const PrefillInput & in, bool & fits) {
    CellCount cc {in, {}};
    for (const auto & [seq, n] : in.cells) {
        cc.cells[seq] = n;
    }
    size_t n_total = 0;
    for (const auto & kv : in.sizes) {
        n_total += kv.second;
        cc.cells.emplace(kv.first, 0);
    }
    fits = in.kv_unified ? (int64_t) n_total <= cc.room(0) : true;
    for (const auto & [seq, size] : in.sizes) {
        fits = fits && (int64_t) size <= cc.room(seq);
    }
    return cc;
}

// how far each sequence is fed, and where its pieces end: at multiples of n_batch, and before its query window,
// which goes whole
struct Pieces {
    const PrefillInput & in;
    size_t window;
    std::map<llama_seq_id, size_t> fed;

    explicit Pieces(const PrefillInput & in) : in(in), window(std::min(in.query_window, in.n_batch)) {}

    size_t window_start(size_t size) const { return window > 0 && size > 1 ? size - std::min(window, size) : size; }
    // the tokens of seq's next piece (0 when it is all fed)
    size_t next(llama_seq_id seq) {
        const size_t size = in.sizes.at(seq);
        const size_t off  = fed[seq];
        const size_t ws   = window_start(size);
        return off < ws ? std::min(in.n_batch - off % in.n_batch, ws - off) : size - off;
    }
};

// after a step that did not fit: the sequences that evict (every one fed, or with deferral only those whose next
// piece finds no room), their cells down to the budget
void plan_evictions(PrefillStep & step, CellCount & cc, Pieces & pieces) {
    for (const auto & kv : step.chunk) {
        const size_t piece = pieces.next(kv.first);
        if (!cc.in.defer_eviction || piece == 0 || (int64_t) piece > cc.room(kv.first)) {
            step.evict_after.push_back(kv.first);
            cc.cells[kv.first] = std::min<int64_t>(cc.cells[kv.first], cc.in.budget);
        }
    }
}

} // namespace

PrefillPlan plan_prefill(const PrefillInput & in) {
    PrefillPlan plan;
    CellCount cc = count_cells(in, plan.fits);
    if (!plan.fits && !in.bounded) {
        return plan; // nothing to plan: the caller refuses the feed
    }
    Pieces pieces(in);
    size_t n_total = 0;
    for (const auto & kv : in.sizes) {
        n_total += kv.second;
    }

    size_t n_left = n_total;
    while (n_left > 0) {
        PrefillStep step;
        size_t take = std::min(in.n_batch, n_left);
        if (!plan.fits && in.kv_unified) {
            take = std::min<size_t>(take, (size_t) std::max<int64_t>(cc.room(0), 0));
        }
        for (const auto & [seq, size] : in.sizes) {
            size_t & off = pieces.fed[seq];
            size_t n = std::min(take, size - off);
            if (!plan.fits && !in.kv_unified) {
                n = std::min<size_t>(n, (size_t) std::max<int64_t>(cc.room(seq), 0));
            }
            const size_t ws = pieces.window_start(size);
            if (off < ws) {
                n = std::min(n, ws - off);
            } else if (n < size - off && !step.chunk.empty()) {
                break; // the window goes into the next chunk, whole
            }
            if (!plan.fits) {
                const size_t piece = pieces.next(seq);
                if (n < piece) {
                    if (!step.chunk.empty()) {
                        break; // the next piece goes into the next chunk, whole
                    }
                } else {
                    n = piece;
                }
            }
            if (n == 0) {
                continue;
            }
            if (off >= ws) {
                step.query_windows.insert(seq);
            }
            step.chunk[seq] = {off, n};
            off    += n;
            take   -= n;
            n_left -= n;
        }
        if (step.chunk.empty()) {
            throw std::logic_error("no KV cell is free for the next chunk");
        }
        for (const auto & [seq, part] : step.chunk) {
            cc.cells[seq] += (int64_t) part.second;
        }
        if (!plan.fits) {
            plan_evictions(step, cc, pieces);
        }
        plan.steps.push_back(std::move(step));
    }
    return plan;
}

} // namespace h2o
