// Entries evicted from a sequence and kept in host memory, to be recalled by a later prompt (recall), and the two
// ways they are kept: the cache's own rows, bit for bit, or a q8_0 copy of F16 rows (about half the bytes, lossy).
#pragma once

#include "policy.h"

#include "llama.h"

#include <cstdint>
#include <vector>

namespace h2o {

// Each entry's K and V of every layer as llama_kv_entries_get wrote them (raw_bytes each), or, with q8_0, those F16
// values as ggml's q8_0 blocks (32 values and one F16 scale a block, the last block padded with zeros); its
// position (the one its keys were rotated for when it left), its origin (its place in the conversation), token and
// scores. Its parts change only through its operations, so that they always agree (consistent()).
class HostStore {
public:
    // every part as it is: what a snapshot writes, and reads back (HostStore(parts), then consistent())
    struct Parts {
        size_t entry_bytes = 0;             // bytes of one stored entry
        bool   q8_0 = false;                // stored as q8_0 blocks of F16 rows
        std::vector<llama_pos>   positions; // (in no order of meaning) where each key was rotated for
        std::vector<llama_pos>   origins;   // each entry's place in the conversation (SeqState::origins)
        std::vector<llama_token> tokens;
        SeqScores                scores;
        std::vector<uint8_t>     kv;        // [n][entry_bytes]
        int64_t n_spilled  = 0;             // entries ever spilled (a recalled entry spilled again counts again)
        int64_t n_recalled = 0;             // entries brought back that the policy kept
        int64_t n_dropped  = 0;             // entries dropped for the store's cap (their K and V gone)
        // the text of the dropped entries: their places in the conversation (ascending), tokens and scores as they
        // left, which a later question may read again (the policy option reread)
        std::vector<llama_pos>   text_origins;
        std::vector<llama_token> text_tokens;
        SeqScores                text_scores;
    };

    HostStore() = default;
    explicit HostStore(Parts parts) : p_(std::move(parts)) {}
    const Parts & parts() const { return p_; }

    size_t size() const { return p_.positions.size(); }
    size_t nbytes() const {
        const size_t scores_bytes = 2*sizeof(float) + sizeof(int64_t) + 2*p_.scores.n_head*sizeof(float);
        return p_.kv.size() + (p_.positions.size() + p_.text_origins.size())*(sizeof(llama_pos) + sizeof(llama_token) +
                                                                                scores_bytes);
    }
    size_t entry_bytes() const { return p_.entry_bytes; }
    bool q8_0() const { return p_.q8_0; }
    const std::vector<llama_pos> & positions() const { return p_.positions; }
    const std::vector<llama_pos> & origins() const { return p_.origins; }
    const std::vector<llama_token> & tokens() const { return p_.tokens; }
    const SeqScores & scores() const { return p_.scores; }
    const std::vector<uint8_t> & kv() const { return p_.kv; }
    int64_t n_spilled() const { return p_.n_spilled; }
    int64_t n_recalled() const { return p_.n_recalled; }
    int64_t n_dropped() const { return p_.n_dropped; }
    const std::vector<llama_pos> & text_origins() const { return p_.text_origins; }
    const std::vector<llama_token> & text_tokens() const { return p_.text_tokens; }
    const SeqScores & text_scores() const { return p_.text_scores; }

    // the same store without its K and V bytes (positions, tokens, scores and counters)
    HostStore without_kv() const;
    // the same store with its K and V bytes as the cache's rows (raw_bytes each: a q8_0 copy decoded), as a recall
    // puts them back
    HostStore with_raw_kv(size_t raw_bytes) const;
    // an empty store that keeps entries as this one does (their size and encoding, the heads of their scores)
    HostStore empty_like() const;
    void set_heads(int32_t n_head) { p_.scores.n_head = n_head; p_.text_scores.n_head = n_head; }
    void count_recalled(int64_t n) { p_.n_recalled += n; }
    // keep only the entries at `indices` (ascending)
    void keep_only(const std::vector<size_t> & indices);
    // the entries at `indices` as the cache's rows (raw_bytes each)
    std::vector<uint8_t> raw_rows(const std::vector<size_t> & indices, size_t raw_bytes) const;
    // keep the entries as q8_0 blocks or as the cache's rows from now on, converting those held
    void set_encoding(bool q8, size_t raw_bytes);

    // evicted entries in: their positions, origins, tokens, scores and rows (raw_bytes each, as the cache has them); counted
    // as spilled. Then, above `cap` entries, the oldest text goes first (drop_oldest).
    void spill(const std::vector<llama_pos> & pos, const std::vector<llama_pos> & orig,
               const std::vector<llama_token> & toks, const SeqScores & entry_scores, const std::vector<uint8_t> & raw,
               size_t raw_bytes, size_t cap);
    // above `cap` entries, the oldest text loses its K and V (counted as dropped); its tokens and scores stay
    void drop_oldest(size_t cap);
    // only the entries and text before place n in the conversation (a sequence truncated to n tokens)
    void keep_before(llama_pos n);
    // the entries at `indices`: their positions, origins, tokens, scores and rows as the cache's (raw_bytes each)
    struct Entries {
        std::vector<llama_pos>   positions;
        std::vector<llama_pos>   origins;
        std::vector<llama_token> tokens;
        SeqScores                scores;
        std::vector<uint8_t>     raw;

        size_t size() const { return positions.size(); }
        // entries [a, b)
        Entries slice(size_t a, size_t b) const;
    };
    Entries entries(const std::vector<size_t> & indices, size_t raw_bytes) const;
    // the entries at `indices` (distinct) leave the store, in that order; the last entries fill their places (what
    // this moves is what it takes, however large the store)
    Entries take(const std::vector<size_t> & indices, size_t raw_bytes);
    // taken entries that did not stay in the cache come back, after the others (not counted as spilled again)
    void put_back(const Entries & e, size_t raw_bytes);
    // the text at `indices` of text_origins (ascending), read again: it leaves the text, as the entries of its places,
    // tokens and scores with the rows the cache computed for it again (raw, at positions `pos`)
    Entries take_text(const std::vector<size_t> & indices, std::vector<llama_pos> pos, std::vector<uint8_t> raw);
    // a saved store adopted by a cache whose entries are raw_bytes (with room for the next spills; how it keeps
    // them read from their size); throws std::invalid_argument when they are neither that size nor its q8_0 blocks
    static HostStore adopted(const HostStore & saved, size_t raw_bytes, int32_t n_head);
    // its parts agree (sizes, bytes, counters): what a snapshot's store must be
    bool consistent() const;
    // consistent, and its entries are what a cache of raw_bytes entries and n_head heads keeps (its rows or their
    // q8_0 blocks)
    bool fits(size_t raw_bytes, int32_t n_head) const;

private:
    // append n entries of raw_bytes each (the cache's rows), encoded as this store keeps them
    void append_rows(const std::vector<uint8_t> & raw, size_t raw_bytes);
    // keep only the text at `indices` (ascending)
    void keep_text(const std::vector<size_t> & indices);

    Parts p_;
};

// bytes of one entry of raw_bytes F16 bytes as q8_0 blocks
size_t q8_0_entry_bytes(size_t raw_bytes);
// n entries of F16 values (raw_bytes each) as q8_0 blocks, and back (ggml's own quantizer and dequantizer)
std::vector<uint8_t> f16_to_q8_0(const std::vector<uint8_t> & f16, size_t raw_bytes);
std::vector<uint8_t> q8_0_to_f16(const std::vector<uint8_t> & q8, size_t raw_bytes);

} // namespace h2o
