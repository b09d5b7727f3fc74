#include "embedder.h"

#include <stdexcept>
#include <string>

namespace h2o {

int32_t model_pooling(const Model & model) {
    const std::string key = model.facts().arch + ".pooling_type";
    char value[32] = {0};
    if (llama_model_meta_val_str(model.get(), key.c_str(), value, sizeof(value)) < 0) {
        return LLAMA_POOLING_TYPE_UNSPECIFIED;
    }
    try {
        return std::stoi(value);
    } catch (const std::exception &) {
        return LLAMA_POOLING_TYPE_UNSPECIFIED;
    }
}

namespace {

int32_t resolve_pooling(const Model & model, int32_t asked) {
    if (asked < LLAMA_POOLING_TYPE_UNSPECIFIED || asked > LLAMA_POOLING_TYPE_RANK) {
        throw std::invalid_argument("pooling_type must be -1 (the model's), 0 (none), 1 (mean), 2 (cls) or 3 (last), "
                                    "not " + std::to_string(asked));
    }
    int32_t pooling = asked;
    if (pooling == LLAMA_POOLING_TYPE_UNSPECIFIED) {
        pooling = model_pooling(model);
        if (pooling == LLAMA_POOLING_TYPE_UNSPECIFIED || pooling == LLAMA_POOLING_TYPE_NONE) {
            pooling = LLAMA_POOLING_TYPE_MEAN;
        }
    }
    if (pooling == LLAMA_POOLING_TYPE_RANK) {
        throw std::invalid_argument("rank pooling (a reranker's scores) is not offered: use pooling_type 0-3");
    }
    return pooling;
}

} // namespace

Embedder::Embedder(const Model & model, const EmbedderParams & params) : model_(model) {
    if (params.n_ctx < 1) {
        throw std::invalid_argument("an embedding context needs n_ctx >= 1 token");
    }
    pooling_ = resolve_pooling(model, params.pooling);
    llama_context_params cp = llama_context_default_params();
    cp.embeddings   = true;
    cp.pooling_type = (enum llama_pooling_type) pooling_;
    cp.n_ctx        = (uint32_t) params.n_ctx;
    cp.n_batch      = (uint32_t) params.n_ctx;
    cp.n_ubatch     = (uint32_t) params.n_ctx; // a pooled sequence must lie in one ubatch
    cp.n_seq_max    = 1;
    cp.no_perf      = true;
    cp.flash_attn_type = params.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (params.n_threads > 0) {
        cp.n_threads       = params.n_threads;
        cp.n_threads_batch = params.n_threads;
    }
    clear_llama_error();
    ctx_ = llama_init_from_model(model.get(), cp);
    if (ctx_ == nullptr) {
        throw std::runtime_error("cannot create a llama.cpp context for embeddings" + llama_error_suffix());
    }
    n_ctx_  = (int32_t) llama_n_ctx(ctx_) < params.n_ctx ? (int32_t) llama_n_ctx(ctx_) : params.n_ctx;
    n_embd_ = llama_model_n_embd_out(model.get());
    batch_  = llama_batch_init(n_ctx_, 0, 1);
}

Embedder::~Embedder() {
    llama_batch_free(batch_);
    if (ctx_ && model_.rpc_servers_reachable()) { // as Engine::~Engine: freeing on a dead RPC server aborts
        llama_free(ctx_);
    }
}

std::vector<std::vector<float>> Embedder::embed(const std::vector<llama_token> & tokens) {
    if (tokens.empty()) {
        throw std::invalid_argument("cannot embed an empty input (no tokens)");
    }
    if ((int64_t) tokens.size() > n_ctx_) {
        throw std::invalid_argument("the input is " + std::to_string(tokens.size()) + " tokens, more than the " +
                                    std::to_string(n_ctx_) + " an embedding takes");
    }
    const int32_t n_vocab = model_.n_vocab();
    std::lock_guard<std::mutex> lock(mu_);
    batch_.n_tokens = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
        check_token_id(tokens[i], n_vocab);
        const int32_t j = batch_.n_tokens++;
        batch_.token[j]     = tokens[i];
        batch_.pos[j]       = (llama_pos) i;
        batch_.n_seq_id[j]  = 1;
        batch_.seq_id[j][0] = 0;
        batch_.logits[j]    = true;
    }
    llama_memory_clear(llama_get_memory(ctx_), true);
    clear_llama_error();
    const int32_t rc = llama_decode(ctx_, batch_);
    if (rc != 0) {
        throw std::runtime_error("llama_decode failed with status " + std::to_string(rc) + " while embedding" +
                                 llama_error_suffix());
    }
    std::vector<std::vector<float>> rows;
    if (pooling_ == LLAMA_POOLING_TYPE_NONE) {
        for (int32_t i = 0; i < batch_.n_tokens; ++i) {
            rows.push_back(row_of(llama_get_embeddings_ith(ctx_, i)));
        }
    } else {
        rows.push_back(row_of(llama_get_embeddings_seq(ctx_, 0)));
    }
    return rows;
}

std::vector<float> Embedder::row_of(const float * row) const {
    if (row == nullptr) {
        throw std::runtime_error("llama.cpp gave no embedding" + llama_error_suffix());
    }
    return std::vector<float>(row, row + n_embd_);
}

} // namespace h2o
