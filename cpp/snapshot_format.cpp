#include "snapshot_format.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace h2o {

namespace {

constexpr char kSnapshotMagic[8] = {'h', '2', 'o', 's', 'n', 'a', 'p', '2'};

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
        if (n == 0) {
            return; // an empty array's data() may be null, which memcpy must not get
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
    w.array(st.tokens);
    w.value(st.scores.n_head);
    w.array(st.scores.total);
    w.array(st.scores.head);
    w.array(st.scores.queries);
    w.array(st.scores.probe);
    w.array(st.scores.seen);
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
        if (size >= sizeof(magic) && memcmp(magic, kSnapshotMagic, sizeof(magic) - 1) == 0) {
            throw std::invalid_argument(std::string("a session snapshot of format ") + magic[sizeof(magic) - 1] +
                                        ", this build reads format " + kSnapshotMagic[sizeof(magic) - 1] +
                                        " (it was saved by another version of h2o_local)");
        }
        throw std::invalid_argument("not a session snapshot (wrong magic)");
    }
    SeqSnapshot snap;
    const std::vector<char> origin = r.array<char>();
    snap.origin.assign(origin.begin(), origin.end());
    snap.kv = r.array<uint8_t>();
    SeqState & st = snap.state;
    st.positions      = r.array<llama_pos>();
    st.tokens         = r.array<llama_token>();
    st.scores.n_head  = r.value<int32_t>();
    st.scores.total   = r.array<float>();
    st.scores.head    = r.array<float>();
    st.scores.queries = r.array<int64_t>();
    st.scores.probe   = r.array<float>();
    st.scores.seen    = r.array<float>();
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
        st.tokens.size() != n || st.scores.probe.size() != n ||
        (!st.scores.seen.empty() && st.scores.seen.size() != n*st.scores.n_head) ||
        st.scores.head.size() != n*st.scores.n_head || !ascending || (n > 0 && (st.positions.front() < 0 ||
        st.positions.back() >= st.next_pos)) || st.n_keep < 0 || st.n_seen < (int64_t) n || st.n_evicted < 0) {
        throw std::invalid_argument("not a session snapshot: its parts do not agree");
    }
    return snap;
}

} // namespace h2o
