#include "seq_cache.h"

#include "llama-attn-scores.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace h2o {

namespace {

constexpr char kSnapshotMagic[8] = {'h', '2', 'o', 's', 'n', 'a', 'p', '1'};

struct ByteWriter {
    std::vector<uint8_t> out;

    void raw(const void * p, size_t n) {
        const auto * b = (const uint8_t *) p;
        out.insert(out.end(), b, b + n);
    }
    template <typename T> void value(T v) { raw(&v, sizeof(v)); }
    template <typename T> void array(const std::vector<T> & v) {
        value<uint64_t>(v.size());
        raw(v.data(), v.size()*sizeof(T));
    }
};

struct ByteReader {
    const uint8_t * p;
    size_t left;

    void raw(void * dst, size_t n) {
        if (n > left) {
            throw std::invalid_argument("not a session snapshot: the data ends early");
        }
        memcpy(dst, p, n);
        p += n;
        left -= n;
    }
    template <typename T> T value() {
        T v;
        raw(&v, sizeof(v));
        return v;
    }
    template <typename T> std::vector<T> array() {
        const uint64_t n = value<uint64_t>();
        if (n > left/sizeof(T)) {
            throw std::invalid_argument("not a session snapshot: an array is longer than the data");
        }
        std::vector<T> v(n);
        raw(v.data(), n*sizeof(T));
        return v;
    }
};

} // namespace

std::vector<uint8_t> snapshot_to_bytes(const SeqSnapshot & snap) {
    ByteWriter w;
    w.raw(kSnapshotMagic, sizeof(kSnapshotMagic));
    w.array(std::vector<char>(snap.origin.begin(), snap.origin.end()));
    w.array(snap.kv);
    const SeqState & st = snap.state;
    w.array(st.positions);
    w.value(st.scores.n_head);
    w.array(st.scores.total);
    w.array(st.scores.head);
    w.array(st.scores.queries);
    w.value(st.next_pos);
    w.value(st.n_seen);
    w.value(st.n_evicted);
    w.value(st.peak_cells);
    w.value(st.n_keep);
    w.array(snap.logits);
    w.array(snap.pending);
    return w.out;
}

SeqSnapshot snapshot_from_bytes(const uint8_t * data, size_t size) {
    ByteReader r {data, size};
    char magic[sizeof(kSnapshotMagic)] = {};
    if (size < sizeof(magic) || (r.raw(magic, sizeof(magic)), memcmp(magic, kSnapshotMagic, sizeof(magic)) != 0)) {
        throw std::invalid_argument("not a session snapshot (wrong magic)");
    }
    SeqSnapshot snap;
    const std::vector<char> origin = r.array<char>();
    snap.origin.assign(origin.begin(), origin.end());
    snap.kv = r.array<uint8_t>();
    SeqState & st = snap.state;
    st.positions      = r.array<llama_pos>();
    st.scores.n_head  = r.value<int32_t>();
    st.scores.total   = r.array<float>();
    st.scores.head    = r.array<float>();
    st.scores.queries = r.array<int64_t>();
    st.next_pos   = r.value<llama_pos>();
    st.n_seen     = r.value<int64_t>();
    st.n_evicted  = r.value<int64_t>();
    st.peak_cells = r.value<int32_t>();
    st.n_keep     = r.value<int32_t>();
    snap.logits   = r.array<float>();
    snap.pending  = r.array<llama_token>();
    const size_t n = st.positions.size();
    const bool ascending = std::adjacent_find(st.positions.begin(), st.positions.end(),
                                              [](llama_pos a, llama_pos b) { return a >= b; }) == st.positions.end();
    if (r.left != 0 || st.scores.n_head < 0 || st.scores.total.size() != n || st.scores.queries.size() != n ||
        st.scores.head.size() != n*st.scores.n_head || !ascending || (n > 0 && (st.positions.front() < 0 ||
        st.positions.back() >= st.next_pos)) || st.n_keep < 0 || st.n_seen < (int64_t) n || st.n_evicted < 0) {
        throw std::invalid_argument("not a session snapshot: its parts do not agree");
    }
    return snap;
}

SeqCache::SeqCache(llama_context * ctx, llama_seq_id seq, int32_t n_head)
    : ctx_(ctx), mem_(llama_get_memory(ctx)), seq_(seq) {
    st_.scores.n_head = n_head;
}

void SeqCache::append(int32_t n_new) {
    for (int32_t i = 0; i < n_new; ++i) {
        st_.positions.push_back(st_.next_pos + i);
    }
    SeqScores & s = st_.scores;
    // every old entry is attended by the n_new queries, new token i by the n_new - i from itself on (causal)
    for (auto & q : s.queries) {
        q += n_new;
    }
    for (int32_t i = 0; i < n_new; ++i) {
        s.queries.push_back(n_new - i);
    }
    s.total.resize(st_.positions.size(), 0.0f);
    s.head.resize(st_.positions.size()*s.n_head, 0.0f);
    st_.next_pos  += n_new;
    st_.n_seen    += n_new;
    st_.peak_cells = std::max(st_.peak_cells, size());
}

void SeqCache::observe(const Policy & policy, const llama_pos * pos, const float * head_sums, int32_t n, int32_t n_new,
                       bool window) {
    if (n != size() || !std::equal(st_.positions.begin(), st_.positions.end(), pos)) {
        throw std::logic_error("attention scores of sequence " + std::to_string(seq_) + " cover " + std::to_string(n) +
                               " positions, the engine tracks " + std::to_string(size()));
    }
    policy.observe(st_.scores, {head_sums, n, st_.scores.n_head, n_new, window});
}

void SeqCache::evict(const Policy & policy, bool rolling, int32_t roll_interval) {
    const size_t n = st_.positions.size();
    if (!policy.bounded() || n <= (size_t) policy.split().total()) {
        return;
    }

    if (policy.needs_keys()) {
        observe_keys(policy);
    }
    const std::vector<size_t> keep = kept_indices(policy);
    std::vector<bool> kept(n, false);
    for (const size_t k : keep) {
        kept[k] = true;
    }
    if (!kept[n - 1]) {
        throw std::logic_error("policy '" + policy.name() + "' evicted the newest token");
    }

    // remove the evicted positions in runs: positions between two kept ones are exactly the run's
    for (size_t i = 0; i < n; ) {
        if (kept[i]) {
            ++i;
            continue;
        }
        size_t e = i;
        while (e + 1 < n && !kept[e + 1]) {
            ++e;
        }
        llama_memory_seq_rm(mem_, seq_, st_.positions[i], st_.positions[e] + 1);
        i = e + 1;
    }

    const SeqScores & s = st_.scores;
    const size_t n_head = s.n_head;
    std::vector<llama_pos> positions;
    SeqScores kept_scores;
    kept_scores.n_head = s.n_head;
    positions.reserve(keep.size());
    kept_scores.total.reserve(keep.size());
    kept_scores.head.reserve(keep.size()*n_head);
    kept_scores.queries.reserve(keep.size());
    for (const size_t k : keep) {
        positions.push_back(st_.positions[k]);
        kept_scores.total.push_back(s.total[k]);
        kept_scores.head.insert(kept_scores.head.end(), s.head.begin() + k*n_head, s.head.begin() + (k + 1)*n_head);
        kept_scores.queries.push_back(s.queries[k]);
    }
    st_.positions.swap(positions);
    st_.scores = std::move(kept_scores);
    if (key_rows_ == n && !keys_.empty()) {
        for (auto & rows : keys_) {
            const size_t n_embd = rows.size()/n;
            std::vector<float> kept_rows;
            kept_rows.reserve(keep.size()*n_embd);
            for (const size_t k : keep) {
                kept_rows.insert(kept_rows.end(), rows.begin() + k*n_embd, rows.begin() + (k + 1)*n_embd);
            }
            rows.swap(kept_rows);
        }
        key_rows_ = keep.size();
    } else {
        forget_keys();
    }
    st_.n_evicted += (int64_t) (n - keep.size());

    // a K shift rotates every cached key in every layer: deferring it keeps positions below budget + interval
    if (rolling && st_.next_pos - (llama_pos) st_.positions.size() >= roll_interval) {
        roll_positions();
    }
}

std::vector<size_t> SeqCache::kept_indices(const Policy & policy) const {
    const size_t n_keep = std::min<size_t>(st_.n_keep, st_.positions.size());
    if (n_keep == 0) {
        return policy.keep(st_.positions, st_.scores, policy.split());
    }
    // the policy decides over the entries after the prefix, within what the prefix leaves of the budget
    const SeqScores & s = st_.scores;
    const size_t n_head = s.n_head;
    std::vector<llama_pos> tail(st_.positions.begin() + n_keep, st_.positions.end());
    SeqScores tail_scores;
    tail_scores.n_head  = s.n_head;
    tail_scores.total   .assign(s.total.begin() + n_keep, s.total.end());
    tail_scores.head    .assign(s.head.begin() + n_keep*n_head, s.head.end());
    tail_scores.queries .assign(s.queries.begin() + n_keep, s.queries.end());

    std::vector<size_t> keep(n_keep);
    for (size_t i = 0; i < n_keep; ++i) {
        keep[i] = i;
    }
    for (const size_t k : policy.keep(tail, tail_scores, policy.split().after_prefix((int32_t) n_keep))) {
        keep.push_back(n_keep + k);
    }
    return keep;
}

void SeqCache::observe_keys(const Policy & policy) {
    const llama_model * model = llama_get_model(ctx_);
    const size_t n = st_.positions.size();
    if (key_rows_ > n) {
        forget_keys();
    }
    const llama_pos p_min = key_rows_ == 0 ? std::numeric_limits<llama_pos>::min() : st_.positions[key_rows_ - 1] + 1;
    const bool fresh = keys_.empty();
    KeyView view;
    view.n_head_kv = llama_model_n_head_kv(model);
    for (int32_t il = 0; il < llama_model_n_layer(model); ++il) {
        const llama_pos * pos = nullptr;
        const float * keys = nullptr;
        int32_t n_embd = 0;
        const int32_t n_new = llama_attn_keys_get(ctx_, seq_, il, p_min, &pos, &n_embd, &keys);
        if (n_new < 0) {
            continue; // a layer that reads another layer's cache
        }
        if (fresh) {
            keys_.emplace_back();
        }
        if ((size_t) view.layer >= keys_.size() || key_rows_ + (size_t) n_new != n ||
            !std::equal(pos, pos + n_new, st_.positions.begin() + key_rows_)) {
            forget_keys();
            throw std::logic_error("the cached keys of sequence " + std::to_string(seq_) + " do not match its positions");
        }
        auto & rows = keys_[view.layer];
        rows.insert(rows.end(), keys, keys + (size_t) n_new*n_embd);
        view.keys = rows.data();
        view.n = (int32_t) n;
        view.head_dim = n_embd / view.n_head_kv;
        policy.observe_keys(st_.scores, view);
        ++view.layer;
    }
    key_rows_ = n;
}

void SeqCache::roll_positions() {
    forget_keys(); // the K shift at the next decode rotates every key
    auto & p = st_.positions;
    const size_t n = p.size();

    // runs of consecutive positions move by the same delta; ascending order never collides
    for (size_t a = 0; a < n; ) {
        size_t b = a;
        while (b + 1 < n && p[b + 1] == p[b] + 1) {
            ++b;
        }
        const llama_pos delta = (llama_pos) a - p[a];
        if (delta != 0) {
            llama_memory_seq_add(mem_, seq_, p[a], p[b] + 1, delta);
        }
        a = b + 1;
    }
    for (size_t i = 0; i < n; ++i) {
        p[i] = (llama_pos) i;
    }
    st_.next_pos = (llama_pos) n;
}

void SeqCache::set_keep(const Policy & policy, int32_t n) {
    check_policy(n >= 0, "keep must be >= 0 tokens, got " + std::to_string(n));
    if (policy.bounded()) {
        policy.split().after_prefix(n); // checks that it fits
    }
    st_.n_keep = n;
}

void SeqCache::drop_unfinished() {
    forget_keys();
    llama_memory_seq_rm(mem_, seq_, st_.next_pos, -1);
}

void SeqCache::clear() {
    forget_keys();
    llama_memory_seq_rm(mem_, seq_, -1, -1);
    const int32_t n_head = st_.scores.n_head;
    st_ = SeqState();
    st_.scores.n_head = n_head;
}

std::vector<uint8_t> SeqCache::save_kv() const {
    llama_memory_update(ctx_); // a K-shift left by rolling goes into the keys first (the state holds shifted positions)
    std::vector<uint8_t> kv(llama_state_seq_get_size(ctx_, seq_));
    kv.resize(llama_state_seq_get_data(ctx_, kv.data(), kv.size(), seq_));
    return kv;
}

bool SeqCache::restore(const std::vector<uint8_t> & kv, const SeqState & state) {
    clear();
    if (!kv.empty() && llama_state_seq_set_data(ctx_, kv.data(), kv.size(), seq_) == 0) {
        return false;
    }
    st_ = state;
    return true;
}

} // namespace h2o
