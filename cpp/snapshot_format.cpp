#include "snapshot_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace h2o {

namespace {

constexpr char kSnapshotMagic[8] = {'h', '2', 'o', 's', 'n', 'a', 'p', '6'};
// still read: format 3; format 4 is format 3 with the host store and a CRC-32 at the end; format 5 adds the origins
// of the kept and the stored entries (their places in the conversation, which rolling does not change); format 6
// the text the store dropped (its places, tokens and scores)
constexpr char kFormatWithoutChecksum = '3';
constexpr char kFormatWithoutOrigins = '4';
constexpr char kFormatWithoutText = '5';

// CRC-32 (IEEE 802.3, the one zlib and zip use): any damage of up to 32 consecutive bits is always detected
uint32_t crc32(const uint8_t * data, size_t n) {
    static const std::vector<uint32_t> table = [] {
        std::vector<uint32_t> t(256);
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) {
                c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            }
            t[i] = c;
        }
        return t;
    }();
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
        c = table[(c ^ data[i]) & 0xFF] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

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
    void scores(const SeqScores & s) {
        value(s.n_head);
        array(s.total);
        array(s.head);
        array(s.queries);
        std::vector<float> probe = s.probe; // the reply option's marks ride in the sign, as format 5 has them
        for (size_t i = 0; i < probe.size(); ++i) {
            if (s.marked(i)) {
                probe[i] = -std::max(probe[i], std::numeric_limits<float>::min());
            }
        }
        array(probe);
        array(s.seen);
    }
    void host(const HostStore::Parts & h) {
        value<uint64_t>(h.entry_bytes);
        array(h.positions);
        array(h.tokens);
        scores(h.scores);
        array(h.kv);
        value(h.n_spilled);
        value(h.n_recalled);
        value(h.n_dropped);
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
    SeqScores scores() {
        SeqScores s;
        s.n_head  = value<int32_t>();
        s.total   = array<float>();
        s.head    = array<float>();
        s.queries = array<int64_t>();
        s.probe   = array<float>();
        s.seen    = array<float>();
        if (std::any_of(s.probe.begin(), s.probe.end(), [](float v) { return v < 0.0f; })) {
            s.reply.resize(s.probe.size());
            for (size_t i = 0; i < s.probe.size(); ++i) {
                s.reply[i] = s.probe[i] < 0.0f;
                s.probe[i] = std::fabs(s.probe[i]);
            }
        }
        return s;
    }
    HostStore::Parts host() {
        HostStore::Parts h;
        h.entry_bytes = (size_t) value<uint64_t>();
        h.positions   = array<llama_pos>();
        h.tokens      = array<llama_token>();
        h.scores      = scores();
        h.kv          = array<uint8_t>();
        h.n_spilled   = value<int64_t>();
        h.n_recalled  = value<int64_t>();
        h.n_dropped   = value<int64_t>();
        return h;
    }
};

// reads the magic (and checks the checksum of a format that has one, leaving it out of r); returns its format
char read_magic(ByteReader & r, const uint8_t * data, size_t size) {
    char magic[sizeof(kSnapshotMagic)] = {};
    const char format = size >= sizeof(magic) && memcmp(data, kSnapshotMagic, sizeof(magic) - 1) == 0 ?
                        (char) data[sizeof(magic) - 1] : '\0';
    const bool known = format == kFormatWithoutChecksum || format == kFormatWithoutOrigins ||
                       format == kFormatWithoutText || format == kSnapshotMagic[sizeof(magic) - 1];
    if (known && format != kFormatWithoutChecksum) {
        uint32_t stored = 0;
        if (size < sizeof(magic) + sizeof(stored)) {
            throw std::invalid_argument("not a session snapshot: the data ends early");
        }
        r.left -= sizeof(stored);
        memcpy(&stored, data + r.left, sizeof(stored));
        if (crc32(data, r.left) != stored) {
            throw std::invalid_argument("the session snapshot is damaged: its checksum does not match its data");
        }
    }
    if (size < sizeof(magic) || (r.raw(magic, sizeof(magic)), !known)) {
        if (format >= '0' && format <= '9') {
            throw std::invalid_argument(std::string("a session snapshot of format ") + format +
                                        ", this build reads formats " + kFormatWithoutChecksum + " to " +
                                        kSnapshotMagic[sizeof(magic) - 1] + " (it was saved by another version of h2o_local)");
        }
        throw std::invalid_argument("not a session snapshot (wrong magic)");
    }
    return format;
}

// each per-head part holds every cell once, its positions ascending, its scores aligned
void check_parts(const SeqState & st) {
    const size_t n = st.positions.size();
    for (size_t k = 0; k < st.parts.pos.size(); ++k) {
        std::vector<int32_t> cells = st.parts.cell[k];
        std::sort(cells.begin(), cells.end());
        bool each_cell_once = cells.size() == n;
        for (size_t i = 0; each_cell_once && i < n; ++i) {
            each_cell_once = cells[i] == (int32_t) i;
        }
        if (st.parts.pos[k].size() != n || !each_cell_once || !st.parts.scores[k].covers(n) ||
            !std::is_sorted(st.parts.pos[k].begin(), st.parts.pos[k].end())) {
            throw std::invalid_argument("not a session snapshot: its per-head parts do not agree");
        }
    }
}

} // namespace

std::vector<uint8_t> snapshot_to_bytes(const SeqSnapshot & snap) {
    ByteWriter w;
    w.raw(kSnapshotMagic, sizeof(kSnapshotMagic));
    w.array(std::vector<char>(snap.origin.begin(), snap.origin.end()));
    w.array(snap.kv);
    const SeqState & st = snap.state;
    w.array(st.positions);
    w.array(st.tokens);
    w.scores(st.scores);
    w.array(st.parts.layers);
    w.value(st.parts.n_head_kv);
    w.value<uint64_t>(st.parts.pos.size());
    for (size_t k = 0; k < st.parts.pos.size(); ++k) {
        w.array(st.parts.pos[k]);
        w.array(st.parts.cell[k]);
        w.scores(st.parts.scores[k]);
    }
    w.value(st.next_pos);
    w.value(st.n_seen);
    w.value(st.n_evicted);
    w.value(st.peak_cells);
    w.value(st.n_keep);
    w.array(snap.logits);
    w.array(snap.pending);
    w.host(snap.host.parts());
    w.array(st.origins);
    w.array(snap.host.origins());
    w.array(snap.host.text_origins());
    w.array(snap.host.text_tokens());
    w.scores(snap.host.text_scores());
    w.value<uint32_t>(crc32(w.out.data(), w.out.size()));
    return w.out;
}

SeqSnapshot snapshot_from_bytes(const uint8_t * data, size_t size) {
    ByteReader r {data, size};
    const char format = read_magic(r, data, size);
    SeqSnapshot snap;
    const std::vector<char> origin = r.array<char>();
    snap.origin.assign(origin.begin(), origin.end());
    snap.kv = r.array<uint8_t>();
    SeqState & st = snap.state;
    st.positions      = r.array<llama_pos>();
    st.tokens         = r.array<llama_token>();
    st.scores         = r.scores();
    st.parts.layers    = r.array<int32_t>();
    st.parts.n_head_kv = r.value<int32_t>();
    const uint64_t n_parts = r.value<uint64_t>();
    if (n_parts != st.parts.layers.size()*(uint64_t) std::max(st.parts.n_head_kv, 0)) {
        throw std::invalid_argument("not a session snapshot: its per-head parts do not agree");
    }
    for (uint64_t k = 0; k < n_parts; ++k) {
        st.parts.pos.push_back(r.array<llama_pos>());
        st.parts.cell.push_back(r.array<int32_t>());
        st.parts.scores.push_back(r.scores());
    }
    st.next_pos   = r.value<llama_pos>();
    st.n_seen     = r.value<int64_t>();
    st.n_evicted  = r.value<int64_t>();
    st.peak_cells = r.value<int32_t>();
    st.n_keep     = r.value<int32_t>();
    snap.logits   = r.array<float>();
    snap.pending  = r.array<llama_token>();
    HostStore::Parts host;
    if (format != kFormatWithoutChecksum) { // format 4 on: what the sequence spilled (recall)
        host = r.host();
    }
    if (format != kFormatWithoutChecksum && format != kFormatWithoutOrigins) {
        st.origins   = r.array<llama_pos>();
        host.origins = r.array<llama_pos>();
    } else { // saved before origins: no entry came back after a roll, so the kept ones' order is their positions'
        st.origins   = st.positions;
        host.origins = host.positions;
    }
    if (format != kFormatWithoutChecksum && format != kFormatWithoutOrigins && format != kFormatWithoutText) {
        host.text_origins = r.array<llama_pos>();
        host.text_tokens  = r.array<llama_token>();
        host.text_scores  = r.scores();
    } else {
        host.text_scores.n_head = host.scores.n_head;
    }
    snap.host = HostStore(std::move(host));
    if (!snap.host.consistent()) {
        throw std::invalid_argument("not a session snapshot: its host entries do not agree");
    }
    const size_t n = st.positions.size();
    check_parts(st);
    const bool ascending = std::adjacent_find(st.positions.begin(), st.positions.end(),
                                              [](llama_pos a, llama_pos b) { return a >= b; }) == st.positions.end();
    const bool origins_ascending = std::adjacent_find(st.origins.begin(), st.origins.end(),
                                                      [](llama_pos a, llama_pos b) { return a >= b; }) == st.origins.end();
    if (r.left != 0 || !st.scores.covers(n) || st.tokens.size() != n || !ascending || (n > 0 && (st.positions.front() < 0 ||
        st.positions.back() >= st.next_pos)) || st.n_keep < 0 || st.n_seen < (int64_t) n || st.n_evicted < 0 ||
        st.origins.size() != n || !origins_ascending || (n > 0 && (st.origins.front() < 0 || st.origins.back() >= st.n_seen))) {
        throw std::invalid_argument("not a session snapshot: its parts do not agree");
    }
    return snap;
}

} // namespace h2o
