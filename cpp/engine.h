// The eviction engine: one llama.cpp context, per-sequence KV bookkeeping and the policy that bounds it.
//
// Every llama_decode is followed, for each sequence of the batch, by a fold of the exported attention scores into
// the sequence's accumulated scores and, when the sequence holds more than its budget, an eviction: the policy
// picks the entries to keep, the others are removed with llama_memory_seq_rm, and with position rolling the kept
// positions are renumbered 0..n-1 with llama_memory_seq_add (the K shift runs inside the next decode).
#pragma once

#include "policies.h"

#include "llama.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace h2o {

struct EngineParams {
    std::string policy = "h2o";
    int32_t  budget = -1;            // KV entries kept per sequence; < 0: none (policy "full")
    int32_t  heavy  = -1;            // < 0: default split
    int32_t  recent = -1;
    int32_t  sinks  = -1;
    bool     position_rolling = false;
    int32_t  roll_interval = 1;      // with rolling: renumber once the kept positions span this many gaps or more
    uint32_t n_ctx     = 0;          // KV cells; 0: budget + n_batch per sequence (bounded) or the trained context (full)
    uint32_t n_batch   = 512;        // tokens per llama_decode
    uint32_t n_seq_max = 1;
    bool     kv_unified = true;      // one cell space for all sequences; false: a stream of n_ctx / n_seq_max cells each
    int32_t  n_threads = 0;          // 0: llama.cpp's default
    int32_t  n_gpu_layers = 0;
    bool     scores_sum_rows = false; // force the transpose + sum_rows reduction (the Metal path) on any backend
    bool     capture_softmax = false; // test oracle: also sum kq_soft_max columns through the eval callback
    bool     export_scores = false;   // export scores even when the policy does not use them (overhead benchmarks)
    bool     kv_f32 = false;          // F32 instead of F16 K/V cells (exact K shifts, twice the bytes)
    bool     verbose = false;
};

// What the engine knows of one sequence's cache.
struct SeqState {
    std::vector<llama_pos> positions;   // kept positions, ascending
    std::vector<float>     scores;      // accumulated score per kept position (sum over heads)
    std::vector<float>     head_scores; // [n_kept][n_head]
    llama_pos next_pos   = 0;           // position of the next token fed
    int64_t   n_seen     = 0;           // tokens fed
    int64_t   n_evicted  = 0;
    int32_t   peak_cells = 0;           // most entries held at once (between a decode and its eviction)
};

// A sequence's cache and the engine's bookkeeping of it, to branch several continuations from one prefix.
struct SeqSnapshot {
    std::vector<uint8_t> kv;     // llama_state_seq_get_data
    SeqState             state;
    std::vector<float>   logits; // after the last token
};

class Model {
public:
    Model(const std::string & path, int32_t n_gpu_layers, bool verbose);
    ~Model();
    Model(const Model &) = delete;
    Model & operator=(const Model &) = delete;

    llama_model       * get()   const { return model_; }
    const llama_vocab * vocab() const { return llama_model_get_vocab(model_); }

private:
    llama_model * model_ = nullptr;
};

class Engine {
public:
    explicit Engine(const std::string & model_path, const EngineParams & params);
    ~Engine();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    // feed tokens to sequences (one batch for all), evicting as the policy says; with all_logits every fed
    // token's logits are kept (see logits_all), otherwise only each sequence's last
    void eval(const std::map<llama_seq_id, std::vector<llama_token>> & tokens, bool all_logits);

    void reset();                      // every sequence
    void reset_seq(llama_seq_id seq);

    // switch the policy for what follows (the engine keeps exporting scores if the new policy needs them)
    void set_policy(const std::string & name, int32_t budget, int32_t heavy, int32_t recent, int32_t sinks);
    // evict now what the current policy would not keep (after set_policy, say)
    void compress(llama_seq_id seq);

    std::shared_ptr<SeqSnapshot> snapshot(llama_seq_id seq) const;
    void restore(llama_seq_id seq, const SeqSnapshot & snap);

    const std::vector<float> & last_logits(llama_seq_id seq) const;
    const std::vector<float> & logits_all(llama_seq_id seq) const; // [n_fed][n_vocab] of the last eval
    const SeqState & state(llama_seq_id seq) const;

    // test oracle (capture_softmax): per-cell, per-head column sums of kq_soft_max over the last eval's decodes
    const std::vector<float> & oracle_cell_scores() const { return oracle_acc_; }
    void clear_oracle() { oracle_acc_.clear(); }

    // tokenizer
    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string token_to_piece(llama_token token, bool special) const;
    std::string detokenize(const std::vector<llama_token> & tokens, bool special) const;
    std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages, bool add_assistant) const;

    const Policy & policy()  const { return *policy_; }
    llama_model  * model()   const { return model_->get(); }
    llama_context * ctx()    const { return ctx_; }
    uint32_t n_ctx()   const { return llama_n_ctx(ctx_); }
    uint32_t capacity() const { return capacity_; } // cells the engine fills: n_ctx as asked, before llama.cpp pads it
    uint32_t stream_capacity() const;               // cells of one stream: all of them, or a sequence's share
    int32_t  room(llama_seq_id seq) const;          // cells still free for seq (shared by all in a unified cache)
    int32_t  n_vocab() const { return llama_vocab_n_tokens(model_->vocab()); }
    int32_t  n_head()  const { return n_head_; }
    int32_t  n_ctx_train() const { return llama_model_n_ctx_train(model_->get()); }
    bool     scores_sum_rows() const { return scores_path_ == 1; }
    size_t   kv_bytes() const;    // bytes allocated for the KV cache
    int32_t  cells_used() const;  // KV entries held by all sequences

private:
    SeqState & seq_state(llama_seq_id seq);
    void decode(const std::map<llama_seq_id, std::vector<llama_token>> & chunk, bool all_logits);
    void fold_scores(llama_seq_id seq);
    void evict(llama_seq_id seq);
    void roll_positions(llama_seq_id seq);

    static bool on_eval(struct ggml_tensor * t, bool ask, void * user_data);

    EngineParams params_;
    std::unique_ptr<Model>  model_;
    std::unique_ptr<Policy> policy_;
    llama_context * ctx_ = nullptr;
    llama_memory_t  mem_ = nullptr;
    llama_batch     batch_ {};
    int32_t n_head_ = 0;
    uint32_t capacity_ = 0;
    int32_t scores_path_ = -1; // llama_attn_scores_enable: 0 out_prod, 1 sum_rows, -1 off

    std::map<llama_seq_id, SeqState> seqs_;
    std::map<llama_seq_id, std::vector<float>> last_logits_;
    std::map<llama_seq_id, std::vector<float>> logits_all_;

    std::vector<float> oracle_acc_; // [kv_size][n_head]
    std::vector<float> oracle_buf_;
};

// llama.cpp's sampler chain: top_k -> top_p -> min_p -> temperature -> seeded draw; greedy when temperature <= 0.
class Sampler {
public:
    Sampler(float temperature, float top_p, int32_t top_k, float min_p, uint32_t seed);
    ~Sampler();
    Sampler(const Sampler &) = delete;
    Sampler & operator=(const Sampler &) = delete;

    llama_token sample(const float * logits, int32_t n_vocab);

private:
    llama_sampler * chain_ = nullptr;
    std::vector<llama_token_data> cand_;
};

} // namespace h2o
