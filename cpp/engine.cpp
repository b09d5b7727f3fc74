#include "engine.h"

#include "llama-attn-scores.h"
#include "llama-ext.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace h2o {

namespace {

bool        g_verbose = false;
std::string g_last_error;

void log_callback(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        g_last_error = text;
        while (!g_last_error.empty() && (g_last_error.back() == '\n' || g_last_error.back() == ' ')) {
            g_last_error.pop_back();
        }
    }
    if (g_verbose) {
        fputs(text, stderr);
    }
}

void init_backend(bool verbose) {
    static std::once_flag once;
    std::call_once(once, [] {
        llama_log_set(log_callback, nullptr);
        llama_backend_init();
    });
    g_verbose = g_verbose || verbose;
}

std::string last_error_suffix() {
    return g_last_error.empty() ? "" : " (llama.cpp: " + g_last_error + ")";
}

} // namespace

//
// Model
//

Model::Model(const std::string & path, int32_t n_gpu_layers, bool verbose) {
    init_backend(verbose);
    g_last_error.clear();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = n_gpu_layers;
    model_ = llama_model_load_from_file(path.c_str(), mp);
    if (model_ == nullptr) {
        throw std::invalid_argument("cannot load '" + path + "': not a loadable GGUF model" + last_error_suffix());
    }
}

Model::~Model() {
    llama_model_free(model_);
}

//
// Engine
//

Engine::Engine(const std::string & model_path, const EngineParams & params) : params_(params) {
    policy_ = make_policy(params.policy, params.budget, params.heavy, params.recent, params.sinks);
    if (params.n_seq_max < 1 || params.n_seq_max > 256) {
        throw std::invalid_argument("n_seq_max must be in [1, 256]");
    }
    if (params.n_batch < 1) {
        throw std::invalid_argument("n_batch must be >= 1");
    }

    model_ = std::make_unique<Model>(model_path, params.n_gpu_layers, params.verbose);

    // cells per stream: the budgets of all sequences + one batch (unified), or a budget + one batch per sequence
    const uint32_t n_stream   = params.kv_unified ? 1 : params.n_seq_max;
    const uint32_t n_keep_max = policy_->bounded() ? params.n_seq_max/n_stream*policy_->split().total() : 0;
    uint32_t n_ctx = params.n_ctx;
    if (n_ctx == 0) {
        n_ctx = n_stream*(policy_->bounded() ? n_keep_max + params.n_batch : (uint32_t) std::max(n_ctx_train(), 1));
    }
    if (policy_->bounded() && n_ctx/n_stream <= n_keep_max) {
        throw std::invalid_argument("n_ctx=" + std::to_string(n_ctx) + " leaves no room beside the budget (" +
                                    std::to_string(n_keep_max) + " entries per stream): use n_ctx > budget * n_seq_max, or 0");
    }

    capacity_ = n_ctx;

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = n_ctx;
    cp.n_batch         = std::min(params.n_batch, n_ctx);
    cp.n_ubatch        = cp.n_batch;
    cp.n_seq_max       = params.n_seq_max;
    cp.kv_unified      = params.kv_unified;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED; // scores need the softmax
    cp.no_perf         = true;
    if (params.kv_f32) {
        cp.type_k = GGML_TYPE_F32;
        cp.type_v = GGML_TYPE_F32;
    }
    if (params.n_threads > 0) {
        cp.n_threads       = params.n_threads;
        cp.n_threads_batch = params.n_threads;
    }
    if (params.capture_softmax) {
        cp.cb_eval           = &Engine::on_eval;
        cp.cb_eval_user_data = this;
    }

    g_last_error.clear();
    ctx_ = llama_init_from_model(model_->get(), cp);
    if (ctx_ == nullptr) {
        throw std::runtime_error("cannot create a llama.cpp context" + last_error_suffix());
    }
    mem_    = llama_get_memory(ctx_);
    batch_  = llama_batch_init((int32_t) cp.n_batch, 0, 1);
    n_head_ = llama_model_n_head(model_->get());

    if (params.roll_interval < 1) {
        throw std::invalid_argument("roll_interval must be >= 1 (tokens), got " + std::to_string(params.roll_interval));
    }
    if (params.position_rolling && !llama_memory_can_shift(mem_)) {
        throw std::invalid_argument("position_rolling=True needs a KV cache whose positions can be shifted; "
                                    "this model's cannot (M-RoPE, recurrent or sliding-window cache)");
    }
    if (policy_->needs_scores() || params.capture_softmax || params.export_scores) {
        scores_path_ = llama_attn_scores_enable(ctx_, true, params.scores_sum_rows);
        if (scores_path_ < 0) {
            throw std::runtime_error("cannot export attention scores for this model" + last_error_suffix());
        }
    }
}

Engine::~Engine() {
    llama_batch_free(batch_);
    if (ctx_) {
        llama_free(ctx_);
    }
}

SeqState & Engine::seq_state(llama_seq_id seq) {
    if (seq < 0 || (uint32_t) seq >= params_.n_seq_max) {
        throw std::invalid_argument("seq_id " + std::to_string(seq) + " out of range [0, " + std::to_string(params_.n_seq_max) + ")");
    }
    return seqs_[seq];
}

const SeqState & Engine::state(llama_seq_id seq) const {
    static const SeqState empty;
    const auto it = seqs_.find(seq);
    return it == seqs_.end() ? empty : it->second;
}

const std::vector<float> & Engine::last_logits(llama_seq_id seq) const {
    const auto it = last_logits_.find(seq);
    if (it == last_logits_.end()) {
        throw std::logic_error("no logits for sequence " + std::to_string(seq) + ": feed it tokens first");
    }
    return it->second;
}

const std::vector<float> & Engine::logits_all(llama_seq_id seq) const {
    static const std::vector<float> empty;
    const auto it = logits_all_.find(seq);
    return it == logits_all_.end() ? empty : it->second;
}

uint32_t Engine::stream_capacity() const {
    return params_.kv_unified ? capacity_ : capacity_/params_.n_seq_max;
}

int32_t Engine::room(llama_seq_id seq) const {
    const int32_t used = params_.kv_unified ? cells_used() : (int32_t) state(seq).positions.size();
    return (int32_t) stream_capacity() - used;
}

int32_t Engine::cells_used() const {
    int32_t n = 0;
    for (const auto & kv : seqs_) {
        n += (int32_t) kv.second.positions.size();
    }
    return n;
}

size_t Engine::kv_bytes() const {
    size_t total = 0;
    for (const auto & kv : llama_get_memory_breakdown(ctx_)) {
        total += kv.second.context;
    }
    return total;
}

void Engine::reset() {
    llama_memory_clear(mem_, true);
    seqs_.clear();
    last_logits_.clear();
    logits_all_.clear();
}

void Engine::reset_seq(llama_seq_id seq) {
    seq_state(seq);
    llama_memory_seq_rm(mem_, seq, -1, -1);
    seqs_.erase(seq);
    last_logits_.erase(seq);
    logits_all_.erase(seq);
}

void Engine::set_policy(const std::string & name, int32_t budget, int32_t heavy, int32_t recent, int32_t sinks) {
    auto policy = make_policy(name, budget, heavy, recent, sinks);
    if (policy->needs_scores() && scores_path_ < 0) {
        throw std::invalid_argument("policy '" + name + "' needs attention scores: create the engine with a scoring "
                                    "policy or export_scores=True");
    }
    const uint32_t n_seq_stream = params_.kv_unified ? params_.n_seq_max : 1;
    if (policy->bounded() && n_seq_stream*policy->split().total() >= stream_capacity()) {
        throw std::invalid_argument("budget " + std::to_string(budget) + " leaves no room in the context's " +
                                    std::to_string(capacity_) + " cells");
    }
    policy_ = std::move(policy);
}

void Engine::compress(llama_seq_id seq) {
    seq_state(seq);
    evict(seq);
}

std::shared_ptr<SeqSnapshot> Engine::snapshot(llama_seq_id seq) const {
    auto snap = std::make_shared<SeqSnapshot>();
    snap->kv.resize(llama_state_seq_get_size(ctx_, seq));
    const size_t n = llama_state_seq_get_data(ctx_, snap->kv.data(), snap->kv.size(), seq);
    snap->kv.resize(n);
    snap->state = state(seq);
    const auto it = last_logits_.find(seq);
    if (it != last_logits_.end()) {
        snap->logits = it->second;
    }
    return snap;
}

void Engine::restore(llama_seq_id seq, const SeqSnapshot & snap) {
    SeqState & st = seq_state(seq);
    llama_memory_seq_rm(mem_, seq, -1, -1);
    if (!snap.kv.empty() && llama_state_seq_set_data(ctx_, snap.kv.data(), snap.kv.size(), seq) == 0) {
        seqs_.erase(seq);
        throw std::runtime_error("cannot restore the snapshot: not enough free KV cells" + last_error_suffix());
    }
    st = snap.state;
    if (snap.logits.empty()) {
        last_logits_.erase(seq);
    } else {
        last_logits_[seq] = snap.logits;
    }
    logits_all_.erase(seq);
}

void Engine::eval(const std::map<llama_seq_id, std::vector<llama_token>> & tokens, bool all_logits) {
    const int32_t n_vocab = this->n_vocab();
    size_t n_total = 0;
    for (const auto & [seq, toks] : tokens) {
        seq_state(seq);
        for (const llama_token t : toks) {
            if (t < 0 || t >= n_vocab) {
                throw std::invalid_argument("token id " + std::to_string(t) + " out of range [0, " + std::to_string(n_vocab) + ")");
            }
        }
        n_total += toks.size();
        if (all_logits) {
            logits_all_[seq].clear();
        }
    }
    if (n_total == 0) {
        return;
    }

    // the capacity, not llama.cpp's padded n_ctx, decides: the same prompt is fed the same way whatever the padding
    bool fits = params_.kv_unified ? (int64_t) n_total <= room(0) : true;
    for (const auto & [seq, toks] : tokens) {
        fits = fits && (int64_t) toks.size() <= room(seq);
    }
    if (!fits && !policy_->bounded()) {
        throw std::invalid_argument("cannot feed " + std::to_string(n_total) + " tokens: " + std::to_string(cells_used()) +
                                    " of the context's " + std::to_string(capacity_) + " KV cells are in use and policy "
                                    "'full' never evicts (use a larger n_ctx or a bounded policy)");
    }

    // fits: the reference mode, attend everything then compress once; otherwise a bounded prefill that feeds what
    // fits beside the kept entries and evicts after every chunk, so the cache never holds more than budget + n_batch.
    // Each sequence is cut into pieces of n_batch tokens from its own start, and a chunk takes whole pieces only, so
    // a sequence is fed (and evicted) at the same boundaries alone or beside others.
    const size_t n_piece = llama_n_batch(ctx_);
    std::map<llama_seq_id, size_t> fed;
    size_t n_left = n_total;
    while (n_left > 0) {
        size_t take = std::min<size_t>((size_t) llama_n_batch(ctx_), n_left);
        if (!fits && params_.kv_unified) {
            take = std::min<size_t>(take, (size_t) std::max(room(0), 0));
        }

        std::map<llama_seq_id, std::vector<llama_token>> chunk;
        for (const auto & [seq, toks] : tokens) {
            size_t & off = fed[seq];
            size_t n = std::min(take, toks.size() - off);
            if (!fits && !params_.kv_unified) {
                n = std::min<size_t>(n, (size_t) std::max(room(seq), 0));
            }
            if (!fits) {
                const size_t piece = std::min(n_piece - off % n_piece, toks.size() - off);
                if (n < piece) {
                    if (!chunk.empty()) {
                        break; // the next piece goes into the next chunk, whole
                    }
                } else {
                    n = piece;
                }
            }
            if (n == 0) {
                continue;
            }
            chunk[seq].assign(toks.begin() + off, toks.begin() + off + n);
            off  += n;
            take -= n;
            n_left -= n;
        }
        if (chunk.empty()) {
            throw std::logic_error("no KV cell is free for the next chunk");
        }
        decode(chunk, all_logits);
        if (!fits) {
            for (const auto & kv : chunk) {
                evict(kv.first);
            }
        }
    }
    if (fits) {
        for (const auto & kv : tokens) {
            evict(kv.first);
        }
    }
}

void Engine::decode(const std::map<llama_seq_id, std::vector<llama_token>> & chunk, bool all_logits) {
    batch_.n_tokens = 0;
    for (const auto & [seq, toks] : chunk) {
        const SeqState & st = seqs_[seq];
        for (size_t i = 0; i < toks.size(); ++i) {
            const int32_t j = batch_.n_tokens++;
            batch_.token[j]     = toks[i];
            batch_.pos[j]       = st.next_pos + (llama_pos) i;
            batch_.n_seq_id[j]  = 1;
            batch_.seq_id[j][0] = seq;
            batch_.logits[j]    = all_logits || i + 1 == toks.size();
        }
    }

    g_last_error.clear();
    const int32_t rc = llama_decode(ctx_, batch_);
    if (rc != 0) {
        // llama.cpp drops only the failed ubatch: drop the whole chunk so the state stays as before the call
        for (const auto & kv : chunk) {
            llama_memory_seq_rm(mem_, kv.first, seqs_[kv.first].next_pos, -1);
        }
        throw std::runtime_error("llama_decode failed with status " + std::to_string(rc) + last_error_suffix());
    }

    const int32_t n_vocab = this->n_vocab();
    int32_t j = 0;
    for (const auto & [seq, toks] : chunk) {
        SeqState & st = seqs_[seq];
        const size_t n_new = toks.size();
        if (all_logits) {
            auto & rows = logits_all_[seq];
            for (size_t i = 0; i < n_new; ++i) {
                const float * row = llama_get_logits_ith(ctx_, j + (int32_t) i);
                rows.insert(rows.end(), row, row + n_vocab);
            }
        }
        const float * last = llama_get_logits_ith(ctx_, j + (int32_t) n_new - 1);
        last_logits_[seq].assign(last, last + n_vocab);
        j += (int32_t) n_new;

        for (size_t i = 0; i < n_new; ++i) {
            st.positions.push_back(st.next_pos + (llama_pos) i);
        }
        st.scores.resize(st.positions.size(), 0.0f);
        st.head_scores.resize(st.positions.size()*n_head_, 0.0f);
        st.next_pos   += (llama_pos) n_new;
        st.n_seen     += (int64_t) n_new;
        st.peak_cells  = std::max(st.peak_cells, (int32_t) st.positions.size());

        if (scores_path_ >= 0) {
            fold_scores(seq);
        }
    }
}

void Engine::fold_scores(llama_seq_id seq) {
    SeqState & st = seqs_[seq];

    const llama_pos * pos = nullptr;
    const float     * sc  = nullptr;
    const int32_t n = llama_attn_scores_get(ctx_, seq, &pos, &sc);
    if ((size_t) n != st.positions.size() || !std::equal(st.positions.begin(), st.positions.end(), pos)) {
        throw std::logic_error("attention scores of sequence " + std::to_string(seq) + " cover " + std::to_string(n) +
                               " positions, the engine tracks " + std::to_string(st.positions.size()));
    }
    for (int32_t i = 0; i < n; ++i) {
        // aggregation over heads: a plain sum, in head order
        float sum = 0.0f;
        for (int32_t h = 0; h < n_head_; ++h) {
            const float v = sc[(size_t) i*n_head_ + h];
            st.head_scores[(size_t) i*n_head_ + h] += v;
            sum += v;
        }
        st.scores[i] += sum;
    }
}

void Engine::evict(llama_seq_id seq) {
    SeqState & st = seqs_[seq];
    const size_t n = st.positions.size();
    if (!policy_->bounded() || n <= (size_t) policy_->split().total()) {
        return;
    }

    const std::vector<size_t> keep = policy_->keep({st.positions, st.scores});
    std::vector<bool> kept(n, false);
    for (const size_t k : keep) {
        kept[k] = true;
    }
    if (!kept[n - 1]) {
        throw std::logic_error("policy '" + policy_->name() + "' evicted the newest token");
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
        llama_memory_seq_rm(mem_, seq, st.positions[i], st.positions[e] + 1);
        i = e + 1;
    }

    std::vector<llama_pos> positions;
    std::vector<float> scores;
    std::vector<float> head_scores;
    positions.reserve(keep.size());
    scores.reserve(keep.size());
    head_scores.reserve(keep.size()*n_head_);
    for (const size_t k : keep) {
        positions.push_back(st.positions[k]);
        scores.push_back(st.scores[k]);
        head_scores.insert(head_scores.end(), st.head_scores.begin() + k*n_head_, st.head_scores.begin() + (k + 1)*n_head_);
    }
    st.positions.swap(positions);
    st.scores.swap(scores);
    st.head_scores.swap(head_scores);
    st.n_evicted += (int64_t) (n - keep.size());

    // a K shift rotates every cached key in every layer: deferring it keeps positions below budget + interval
    if (params_.position_rolling && st.next_pos - (llama_pos) st.positions.size() >= params_.roll_interval) {
        roll_positions(seq);
    }
}

void Engine::roll_positions(llama_seq_id seq) {
    SeqState & st = seqs_[seq];
    auto & p = st.positions;
    const size_t n = p.size();

    // runs of consecutive positions move by the same delta; ascending order never collides
    for (size_t a = 0; a < n; ) {
        size_t b = a;
        while (b + 1 < n && p[b + 1] == p[b] + 1) {
            ++b;
        }
        const llama_pos delta = (llama_pos) a - p[a];
        if (delta != 0) {
            llama_memory_seq_add(mem_, seq, p[a], p[b] + 1, delta);
        }
        a = b + 1;
    }
    for (size_t i = 0; i < n; ++i) {
        p[i] = (llama_pos) i;
    }
    st.next_pos = (llama_pos) n;
}

bool Engine::on_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    // exactly "kq_soft_max-<layer>": views and copies of it are named "kq_soft_max-<layer> (reshaped)" etc.
    static const char prefix[] = "kq_soft_max-";
    const char * rest = t->name + sizeof(prefix) - 1;
    const bool wanted = strncmp(t->name, prefix, sizeof(prefix) - 1) == 0 && *rest != '\0' &&
                        strspn(rest, "0123456789") == strlen(rest);
    if (ask) {
        return wanted;
    }
    if (!wanted) {
        return true;
    }

    auto * self = static_cast<Engine *>(user_data);
    const int64_t n_kv = t->ne[0], n_tps = t->ne[1], n_head = t->ne[2];
    if (t->ne[3] != 1 || t->type != GGML_TYPE_F32) {
        throw std::logic_error("softmax oracle: expected one F32 stream");
    }
    self->oracle_buf_.resize(ggml_nelements(t));
    ggml_backend_tensor_get(t, self->oracle_buf_.data(), 0, ggml_nbytes(t));

    auto & acc = self->oracle_acc_;
    acc.resize((size_t) self->n_ctx()*n_head, 0.0f);
    for (int64_t h = 0; h < n_head; ++h) {
        for (int64_t q = 0; q < n_tps; ++q) {
            const float * row = self->oracle_buf_.data() + (h*n_tps + q)*n_kv;
            for (int64_t j = 0; j < n_kv; ++j) {
                acc[j*n_head + h] += row[j];
            }
        }
    }
    return true;
}

//
// tokenizer and chat template
//

std::vector<llama_token> Engine::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    std::vector<llama_token> out(text.size() + 8);
    int32_t n = llama_tokenize(model_->vocab(), text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
    if (n < 0) {
        out.resize(-n);
        n = llama_tokenize(model_->vocab(), text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
    }
    if (n < 0) {
        throw std::runtime_error("tokenization failed");
    }
    out.resize(n);
    return out;
}

std::string Engine::token_to_piece(llama_token token, bool special) const {
    if (token < 0 || token >= n_vocab()) {
        throw std::invalid_argument("token id " + std::to_string(token) + " out of range");
    }
    char buf[256];
    int32_t n = llama_token_to_piece(model_->vocab(), token, buf, sizeof(buf), 0, special);
    if (n < 0) {
        std::string big(-n, '\0');
        n = llama_token_to_piece(model_->vocab(), token, big.data(), (int32_t) big.size(), 0, special);
        return big.substr(0, std::max(n, 0));
    }
    return std::string(buf, n);
}

std::string Engine::detokenize(const std::vector<llama_token> & tokens, bool special) const {
    for (const llama_token t : tokens) {
        if (t < 0 || t >= n_vocab()) {
            throw std::invalid_argument("token id " + std::to_string(t) + " out of range");
        }
    }
    std::string out(tokens.size()*8 + 16, '\0');
    int32_t n = llama_detokenize(model_->vocab(), tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false, special);
    if (n < 0) {
        out.resize(-n);
        n = llama_detokenize(model_->vocab(), tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false, special);
    }
    out.resize(std::max(n, 0));
    return out;
}

std::string Engine::apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages, bool add_assistant) const {
    const char * tmpl = llama_model_chat_template(model_->get(), nullptr);
    if (tmpl == nullptr) {
        throw std::invalid_argument("this model has no chat template: use create_completion with your own prompt");
    }
    std::vector<llama_chat_message> msgs;
    for (const auto & m : messages) {
        msgs.push_back({m.first.c_str(), m.second.c_str()});
    }
    size_t len = 1024;
    for (const auto & m : messages) {
        len += 2*(m.first.size() + m.second.size()) + 64;
    }
    std::string out(len, '\0');
    int32_t n = llama_chat_apply_template(tmpl, msgs.data(), msgs.size(), add_assistant, out.data(), (int32_t) out.size());
    if (n > (int32_t) out.size()) {
        out.resize(n);
        n = llama_chat_apply_template(tmpl, msgs.data(), msgs.size(), add_assistant, out.data(), (int32_t) out.size());
    }
    if (n < 0) {
        throw std::invalid_argument("llama.cpp does not support this model's chat template");
    }
    out.resize(n);
    return out;
}

//
// Sampler
//

Sampler::Sampler(float temperature, float top_p, int32_t top_k, float min_p, uint32_t seed) {
    chain_ = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (temperature <= 0.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_greedy());
        return;
    }
    if (top_k > 0) {
        llama_sampler_chain_add(chain_, llama_sampler_init_top_k(top_k));
    }
    if (top_p < 1.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_top_p(top_p, 1));
    }
    if (min_p > 0.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_min_p(min_p, 1));
    }
    llama_sampler_chain_add(chain_, llama_sampler_init_temp(temperature));
    llama_sampler_chain_add(chain_, llama_sampler_init_dist(seed));
}

Sampler::~Sampler() {
    llama_sampler_free(chain_);
}

llama_token Sampler::sample(const float * logits, int32_t n_vocab) {
    cand_.resize(n_vocab);
    for (int32_t i = 0; i < n_vocab; ++i) {
        cand_[i] = llama_token_data{i, logits[i], 0.0f};
    }
    llama_token_data_array arr = {cand_.data(), cand_.size(), -1, false};
    llama_sampler_apply(chain_, &arr);
    if (arr.selected < 0 || (size_t) arr.selected >= arr.size) {
        throw std::runtime_error("the sampler selected no token");
    }
    const llama_token tok = arr.data[arr.selected].id;
    llama_sampler_accept(chain_, tok);
    return tok;
}

} // namespace h2o
