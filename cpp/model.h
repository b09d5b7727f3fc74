// A GGUF model: its weights (or only its metadata), its facts, its vocabulary and its chat template.
#pragma once

#include "llama.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace h2o {

// What a model is, readable without a context (and without loading its weights: Model::metadata_only).
struct ModelFacts {
    std::string arch;
    int32_t  n_ctx_train = 0;
    int32_t  n_vocab     = 0;
    int32_t  n_layer     = 0;
    int32_t  n_head      = 0;
    int32_t  n_head_kv   = 0;
    int32_t  n_embd      = 0;
    uint64_t kv_bytes_per_cell = 0; // F16 K and V of every layer with a full-context cache, for one token
    uint64_t model_bytes = 0;
    uint64_t n_params    = 0;
    bool     add_bos     = false;
    llama_token token_bos = -1;
    llama_token token_eos = -1;
    llama_token token_nl  = -1;     // the newline token (-1: the vocabulary has none)
    std::vector<llama_token> fim;   // fill-in-the-middle: prefix, suffix, middle, repository, file separator (-1: none)
    std::string chat_template;      // the GGUF's own (tokenizer.chat_template); empty when it has none
    std::vector<std::string> layer_devices; // per layer, the ggml device that holds its weights ("CPU", "Vulkan0", ...)
};

class Model {
public:
    // metadata_only: hyperparameters, vocabulary and tensor table, no weights (for facts and tokenizing)
    // rpc_servers: "host:port" of ggml RPC servers; the offloaded layers (n_gpu_layers) go to their devices and this
    // machine's GPUs, and to no other RPC server (model_devices in model.cpp)
    Model(const std::string & path, int32_t n_gpu_layers, bool metadata_only, bool verbose,
          const std::vector<std::string> & rpc_servers = {});
    ~Model();
    Model(const Model &) = delete;
    Model & operator=(const Model &) = delete;

    llama_model       * get()   const { return model_; }
    // false when an RPC server this model's layers live on no longer answers: llama.cpp aborts the process on the
    // first command it cannot send there, freeing included, so a model (and its contexts) must then not be freed
    bool rpc_servers_reachable() const;
    const llama_vocab * vocab() const { return llama_model_get_vocab(model_); }
    ModelFacts facts() const;
    // the GGUF's key-value metadata, every value as text (llama.cpp's llama_model_meta_*: arrays are summarized)
    std::map<std::string, std::string> metadata() const;
    // the devices other than the CPU that hold a layer: their names in layer order ("Vulkan0", "CUDA1"), their total
    // memory in bytes (0 when one cannot say, as an RPC server), and how many layers they hold
    struct Offload { std::vector<std::string> devices; uint64_t memory_bytes = 0; int32_t n_layer = 0; };
    Offload offload() const;

    int32_t n_vocab() const { return llama_vocab_n_tokens(vocab()); }
    bool    is_eog(llama_token token) const { return llama_vocab_is_eog(vocab(), token); }
    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string token_to_piece(llama_token token, bool special) const;
    std::string detokenize(const std::vector<llama_token> & tokens, bool special) const;
    // llama.cpp's built-in rendering of a chat template (the GGUF's own when tmpl is empty)
    std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                    bool add_assistant, const std::string & tmpl) const;

    // throws std::invalid_argument for a token id outside the vocabulary
    void check_token(llama_token token) const;

private:
    llama_model * model_ = nullptr;
    std::vector<std::string> rpc_servers_;
};

// throws std::invalid_argument unless 0 <= t < n_vocab ("token id T out of range [0, N)", after `what` when given)
void check_token_id(llama_token t, int32_t n_vocab, const char * what = nullptr);

// llama.cpp's log goes through here once the backend is initialised: errors are kept for our exception messages
void init_backend(bool verbose);
void clear_llama_error();
std::string llama_error_suffix(); // " (llama.cpp: <first error since the clear>)" or ""

} // namespace h2o
