#include "engine.h"
#include "context_size.h"
#include "host_store.h"
#include "kv_types.h"
#include "prefill_plan.h"

#include "llama-attn-scores.h"
#include "llama-ext.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace h2o {

namespace {

// elements per key head (GGUF's attention.key_length, else n_embd / n_head)
int32_t key_head_size(const llama_model * model) {
    char arch[64] = {0};
    char value[32] = {0};
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));
    const std::string key = std::string(arch) + ".attention.key_length";
    if (llama_model_meta_val_str(model, key.c_str(), value, sizeof(value)) > 0) {
        return std::atoi(value);
    }
    return llama_model_n_embd(model) / std::max(llama_model_n_head(model), 1);
}

void check_params(const EngineParams & params) {
    if (params.policy == nullptr) {
        throw std::invalid_argument("EngineParams.policy is required");
    }
    if (params.n_seq_max < 1 || params.n_seq_max > 256) {
        throw std::invalid_argument("n_seq_max must be in [1, 256]");
    }
    if (params.n_batch < 1) {
        throw std::invalid_argument("n_batch must be >= 1");
    }
    if (params.roll_interval < 0) {
        throw std::invalid_argument("roll_interval must be >= 0 (tokens; 0: roll only near the trained context), got " +
                                    std::to_string(params.roll_interval));
    }
}

KvTypeFacts kv_type_facts(const Model & model, const Model::Offload & offload) {
    KvTypeFacts facts;
    facts.key_head = key_head_size(model.get());
    // the first device other than the CPU that holds a layer (and its KV cache); empty: everything on the CPU
    facts.offloaded_to = offload.devices.empty() ? "" : offload.devices.front();
    ggml_backend_dev_t dev = facts.offloaded_to.empty() ? nullptr : ggml_backend_dev_by_name(facts.offloaded_to.c_str());
    facts.software_device = dev != nullptr && std::strstr(ggml_backend_dev_description(dev), "llvmpipe") != nullptr;
    const char * rot_disable = std::getenv("LLAMA_ATTN_ROT_DISABLE");
    facts.rotation_disabled = rot_disable && std::atoi(rot_disable);
    return facts;
}

llama_context_params context_params(const EngineParams & params, const ContextSize & size, const KvTypeFacts & facts) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = size.n_ctx;
    cp.n_batch         = size.n_batch + size.n_probe_ride;
    cp.n_ubatch        = size.n_ubatch + size.n_probe_ride;
    cp.n_outputs_max   = size.n_outputs_max;
    cp.n_seq_max       = params.n_seq_max;
    cp.kv_unified      = params.kv_unified;
    cp.no_perf         = true;
    cp.op_offload      = params.op_offload;
    const KvTypes types = choose_kv_types(params, facts);
    cp.flash_attn_type = flash_attn_type(params, facts);
    cp.type_k = types.k;
    cp.type_v = types.v;
    if (params.n_threads > 0) {
        cp.n_threads       = params.n_threads;
        cp.n_threads_batch = params.n_threads;
    }
    if (params.n_threads_batch > 0) {
        cp.n_threads_batch = params.n_threads_batch;
    }
    return cp;
}

// the KV cells and logits a context needs against the memory of the machine and of the devices holding its layers
void check_memory(const Model & model, const Model::Offload & offload, const EngineParams & params,
                  const ContextSize & size, const KvTypeFacts & facts) {
    const int32_t n_layer = std::max(llama_model_n_layer(model.get()), 1);
    const uint64_t cell_bytes = (uint64_t) n_layer*2*llama_model_n_head_kv(model.get())*
                                (uint64_t) facts.key_head*(params.kv_f32 ? 4 : 2);
    check_host_memory(size, cell_bytes, model.n_vocab(), offload.devices.empty(), physical_memory_bytes());
    std::string devices;
    for (const std::string & d : offload.devices) {
        devices += (devices.empty() ? "" : ", ") + d;
    }
    check_device_memory(size, cell_bytes*offload.n_layer/n_layer, devices, offload.memory_bytes);
}

// With flash attention, a Vulkan device reduces the scores' separate pass with the transposed sum, not the out
// product: lavapipe crashed in its out-product path (SmolLM2 with 7 or more layers there: a prompt of 64 tokens,
// then one over more cells); the transposed sum ran. Cause not found (docs/gpu.md).
bool sum_rows_on_vulkan(llama_context * ctx, const Model::Offload & offload) {
    const auto vulkan = [](const std::string & d) { return d.rfind("Vulkan", 0) == 0; };
    return llama_flash_attn_enabled(ctx) && std::any_of(offload.devices.begin(), offload.devices.end(), vulkan);
}

} // namespace

Engine::Engine(const std::string & model_path, const EngineParams & params) : params_(params) {
    check_params(params);
    settings_ = SeqSettings(params.policy, params.host_entries);
    const Policy & policy = settings_.policy();
    check_per_head(policy);

    model_ = std::make_unique<Model>(model_path, params.n_gpu_layers, false, params.verbose, params.rpc_servers);
    prober_ = Prober(*model_, params.n_batch);

    const ProbeSource probe_source = policy.probe().source;
    const bool probe_can_ride = params.probe_rides &&
                                (probe_source == ProbeSource::question || probe_source == ProbeSource::catalyst);
    const ContextSize size = context_size(params, policy, llama_model_n_ctx_train(model_->get()),
                                          probe_cells(policy), probe_can_ride ? probe_cells(policy) : 0);
    capacity_ = size.n_ctx;
    n_batch_  = size.n_batch;
    n_ubatch_ = size.n_ubatch;
    check_evictable(policy);
    check_room(policy);
    if (policy.bounded()) {
        policy.split().after_prefix(params.n_keep);
    } else if (params.n_keep < 0) {
        throw std::invalid_argument("keep must be >= 0 tokens");
    }

    const Model::Offload offload = model_->offload();
    const KvTypeFacts facts = kv_type_facts(*model_, offload);
    if (rolls_when_needed() && !keys_can_roll(params_, facts)) {
        params_.position_rolling = false; // these keys cannot be shifted: positions stay as they were fed
    }
    const llama_context_params cp = context_params(params_, size, facts);
    check_memory(*model_, offload, params, size, facts);
    clear_llama_error();
    ctx_ = llama_init_from_model(model_->get(), cp);
    if (ctx_ == nullptr) {
        throw std::runtime_error("cannot create a llama.cpp context" + llama_error_suffix());
    }
    batch_  = llama_batch_init((int32_t) cp.n_batch, 0, 1);
    n_head_ = llama_model_n_head(model_->get());
    origin_ = origin();

    if (params_.position_rolling && !llama_memory_can_shift(llama_get_memory(ctx_))) {
        if (!rolls_when_needed()) {
            throw std::invalid_argument("position_rolling with a roll_interval needs a KV cache whose positions can be "
                                        "shifted; this model's cannot (M-RoPE, recurrent or sliding-window cache)");
        }
        params_.position_rolling = false;
    }
    if (policy.needs_scores() || params.export_scores) {
        scores_path_ = llama_attn_scores_enable(ctx_, true, params.scores_sum_rows || sum_rows_on_vulkan(ctx_, offload));
        if (scores_path_ < 0) {
            throw std::invalid_argument("cannot export attention scores for this model" + llama_error_suffix());
        }
        // the CPU's flash kernel sums all its queries together: a riding probe would take the scores' separate pass
        // there, which costs more on the CPU than the probe's own decode
        const bool on_cpu_kernel = llama_flash_attn_enabled(ctx_) && offload.n_layer < llama_model_n_layer(model_->get());
        prober_.set_rides(size.n_probe_ride > 0 && !on_cpu_kernel);
    }
    use_per_head(policy);
    check_recall(policy, settings_.recall());
    key_layout_ = KeyLayout::of(llama_model_n_layer(model_->get()), llama_model_n_head_kv(model_->get()),
                                facts.key_head, choose_kv_types(params_, facts).k, llama_kv_entry_size(ctx_));
}

Engine::~Engine() {
    llama_batch_free(batch_);
    if (ctx_ && model_->rpc_servers_reachable()) { // else its buffers stay: freeing them would abort (Model::~Model)
        llama_free(ctx_);
    }
}

SeqCache & Engine::seq_cache(llama_seq_id seq) {
    if (seq < 0 || (uint32_t) seq >= params_.n_seq_max) {
        throw std::invalid_argument("seq_id " + std::to_string(seq) + " out of range [0, " + std::to_string(params_.n_seq_max) + ")");
    }
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) {
        it = seqs_.emplace(seq, SeqCache(ctx_, seq, n_head_)).first;
        it->second.set_keep(settings_.policy(), params_.n_keep);
        it->second.set_spill(settings_.recall_of(seq), params_.host_q8_0);
        it->second.set_key_layout(key_layout_);
    }
    return it->second;
}

bool Engine::flash_attn() const {
    return llama_flash_attn_enabled(ctx_);
}

size_t Engine::entry_size() const {
    return llama_kv_entry_size(ctx_);
}

std::vector<uint8_t> Engine::kv_entries(llama_seq_id seq, const std::vector<llama_pos> & positions) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    seq_cache(seq);
    llama_memory_update(ctx_);
    std::vector<uint8_t> out(positions.size()*entry_size());
    const int32_t rc = llama_kv_entries_get(ctx_, seq, (int32_t) positions.size(), positions.data(), out.data());
    if (rc != 0) {
        throw std::invalid_argument("cannot read the KV entries of sequence " + std::to_string(seq) + " (status " +
                                    std::to_string(rc) + ": a position it does not hold?)");
    }
    return out;
}

SeqState Engine::state(llama_seq_id seq) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const auto it = seqs_.find(seq);
    return it == seqs_.end() ? SeqState() : it->second.state();
}

llama_pos Engine::next_pos(llama_seq_id seq) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const auto it = seqs_.find(seq);
    return it == seqs_.end() ? 0 : it->second.next_pos();
}

int32_t Engine::size_of(llama_seq_id seq) const {
    const auto it = seqs_.find(seq);
    return it == seqs_.end() ? 0 : it->second.size();
}

const std::vector<float> & Engine::logits_of(llama_seq_id seq) const {
    const auto it = last_logits_.find(seq);
    if (it == last_logits_.end()) {
        throw std::logic_error("no logits for sequence " + std::to_string(seq) + ": feed it tokens first");
    }
    return it->second;
}

std::vector<float> Engine::last_logits(llama_seq_id seq) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return logits_of(seq);
}

std::vector<float> Engine::take_logits_all(llama_seq_id seq) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const auto it = logits_all_.find(seq);
    if (it == logits_all_.end()) {
        return {};
    }
    std::vector<float> rows = std::move(it->second);
    logits_all_.erase(it);
    return rows;
}

std::vector<float> Engine::logits_all(llama_seq_id seq) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const auto it = logits_all_.find(seq);
    return it == logits_all_.end() ? std::vector<float>() : it->second;
}

void Engine::last_scores(llama_seq_id seq, std::vector<llama_pos> & pos, std::vector<float> & sums) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const llama_pos * p = nullptr;
    const float * s = nullptr;
    const int32_t n = scores_path_ < 0 ? 0 : llama_attn_scores_get(ctx_, seq, &p, &s);
    pos.assign(p, p + n);
    sums.assign(s, s + (size_t) n*n_head_);
}

void Engine::keys(llama_seq_id seq, int32_t il, std::vector<llama_pos> & pos, std::vector<float> & keys,
                  int32_t & n_embd) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (seq < 0 || (uint32_t) seq >= params_.n_seq_max) {
        throw std::invalid_argument("seq_id " + std::to_string(seq) + " out of range [0, " + std::to_string(params_.n_seq_max) + ")");
    }
    if (il < 0 || il >= model_->facts().n_layer) {
        throw std::invalid_argument("layer " + std::to_string(il) + " out of range [0, " +
                                    std::to_string(model_->facts().n_layer) + ")");
    }
    const llama_pos * p = nullptr;
    const float * k = nullptr;
    const int32_t n = std::max(llama_attn_keys_get(ctx_, seq, il, std::numeric_limits<llama_pos>::min(), &p, &n_embd, &k), 0);
    pos.assign(p, p + n);
    keys.assign(k, k + (size_t) n*n_embd);
}

llama_token Engine::sample(llama_seq_id seq, Sampler & sampler) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const auto & logits = logits_of(seq);
    if (sampler.n_vocab() != (int32_t) logits.size()) {
        throw std::invalid_argument("the sampler was made for another vocabulary size");
    }
    return sampler.sample(logits.data());
}

uint32_t Engine::stream_capacity() const {
    return params_.kv_unified ? capacity_ : capacity_/params_.n_seq_max;
}

int32_t Engine::room(llama_seq_id seq) const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const int32_t used = params_.kv_unified ? cells_used() : size_of(seq);
    return (int32_t) stream_capacity() - used;
}

int32_t Engine::cells_used() const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    int32_t n = 0;
    for (const auto & kv : seqs_) {
        n += kv.second.size();
    }
    return n;
}

size_t Engine::kv_bytes() const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    size_t total = 0;
    for (const auto & kv : llama_get_memory_breakdown(ctx_)) {
        total += kv.second.context;
    }
    return total;
}

void Engine::reset() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    llama_memory_clear(llama_get_memory(ctx_), true);
    seqs_.clear();
    last_logits_.clear();
    logits_all_.clear();
}

void Engine::reset_seq(llama_seq_id seq) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    seq_cache(seq).clear();
    seqs_.erase(seq);
    last_logits_.erase(seq);
    logits_all_.erase(seq);
}

void Engine::truncate(llama_seq_id seq, int64_t n) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    seq_cache(seq).truncate(n);
    last_logits_.erase(seq);
    logits_all_.erase(seq);
}

void Engine::set_keep(llama_seq_id seq, int32_t n_keep) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    seq_cache(seq).set_keep(policy_of(seq), n_keep);
}

void Engine::compress(llama_seq_id seq) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const int64_t n_evicted = seq_cache(seq).state().n_evicted;
    probe_and_evict(seq, nullptr);
    if (seqs_.at(seq).state().n_evicted > n_evicted) {
        compact(seq);
    }
}

void Engine::eval(const TokenMap & tokens, bool logits_all, const std::function<Riders()> & between_chunks) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const size_t n_total = check_tokens(tokens, logits_all);
    if (n_total == 0) {
        return;
    }
    const PrefillPlan plan = plan_for(tokens, (bool) between_chunks);
    if (!plan.fits && !plan_bounded(tokens)) {
        throw std::invalid_argument("cannot feed " + std::to_string(n_total) + " tokens: " + std::to_string(cells_used()) +
                                    " of the context's " + std::to_string(capacity_) + " KV cells are in use and policy "
                                    "'full' never evicts (use a larger n_ctx or a bounded policy)");
    }
    std::map<llama_seq_id, int64_t> n_evicted;
    CleanState clean;
    for (const auto & kv : tokens) {
        n_evicted[kv.first] = seqs_.at(kv.first).state().n_evicted;
        mark_clean(clean, kv.first);
        seqs_.at(kv.first).note_feed(kv.second.size(), policy_of(kv.first).probe().question);
    }
    recall_prompts(clean, tokens); // a new prompt first brings back what it asks about of what its sequence spilled
    feed_steps(clean, plan, tokens, logits_all, between_chunks);
    if (plan.fits) {
        for (const auto & kv : tokens) {
            evict_or_roll_back(clean, kv.first, &kv.second);
        }
    }
    // a prompt that evicted leaves its kept cells scattered over every cell it went through (single tokens reuse the
    // lowest free cell, so generation keeps a compact cache compact)
    for (const auto & kv : tokens) {
        if (kv.second.size() > 1 && seqs_.at(kv.first).state().n_evicted > n_evicted[kv.first]) {
            compact(kv.first);
        }
    }
}

size_t Engine::check_tokens(const TokenMap & tokens, bool logits_all) {
    const int32_t n_vocab = model_->n_vocab();
    size_t n_total = 0;
    for (const auto & [seq, toks] : tokens) {
        seq_cache(seq);
        for (const llama_token t : toks) {
            check_token_id(t, n_vocab);
        }
        n_total += toks.size();
        if (logits_all) { // exactly the rows this feed gives: a large prompt's are the most memory it takes
            std::vector<float> rows;
            rows.reserve(toks.size() * (size_t) n_vocab);
            logits_all_[seq] = std::move(rows);
        }
    }
    return n_total;
}

bool Engine::plan_bounded(const TokenMap & tokens) const {
    for (const auto & kv : tokens) {
        if (!policy_of(kv.first).bounded()) {
            return false;
        }
    }
    return true;
}

// whether feeding n tokens to seq can end in an eviction (recall may first bring entries back)
bool Engine::feed_may_evict(llama_seq_id seq, size_t n, const Policy & policy) const {
    const auto it = seqs_.find(seq);
    const int64_t held = it == seqs_.end() ? 0 : it->second.size();
    const bool recalls = it != seqs_.end() && it->second.host().size() > 0;
    return recalls || held + (int64_t) n > (int64_t) policy.split().total();
}

PrefillPlan Engine::plan_for(const TokenMap & tokens, bool with_riders) const {
    // the capacity, not llama.cpp's padded n_ctx, decides: the same prompt is fed the same way whatever the padding
    PrefillInput in;
    for (const auto & [seq, toks] : tokens) {
        in.sizes[seq] = toks.size();
    }
    for (const auto & kv : seqs_) {
        in.cells[kv.first] = kv.second.size();
    }
    // a probe needs its cells beside a piece before the piece is evicted; sequences are probed and evicted one at
    // a time, so one probe's cells per stream suffice
    // (sequences with policies of their own: the plan takes the largest budget, probe and query window of those fed)
    int32_t n_probe = 0;
    int32_t budget = 0;
    int32_t window = 0;
    for (const auto & kv : tokens) {
        const Policy & policy = policy_of(kv.first);
        const ProbeSpec probe = policy.probe();
        n_probe = std::max(n_probe, policy.bounded() ? probe_cells(policy) : 0);
        budget  = std::max(budget, policy.bounded() ? policy.split().total() : 0);
        // the query window (and the question probe's tokens, the prompt's end) is decoded on its own, so that its
        // attention is seen apart from the rest of the prompt's (the probe's baseline leaves out the question's own
        // queries); only where this feed ends in an eviction: another cut changes llama.cpp's arithmetic, and a
        // budget that never evicts must give the full cache's output exactly
        if (policy.bounded() && feed_may_evict(kv.first, kv.second.size(), policy)) {
            window = std::max({window, policy.query_window(), probe.source == ProbeSource::question ? probe.question : 0});
        }
    }
    in.capacity       = (int32_t) stream_capacity() - n_probe;
    in.kv_unified     = params_.kv_unified;
    in.defer_eviction = !params_.kv_unified || params_.n_seq_max == 1;
    in.bounded        = plan_bounded(tokens);
    in.budget         = budget;
    // with riders, each chunk leaves room for one token of every other sequence
    const size_t n_riders_max = with_riders ? (size_t) params_.n_seq_max - 1 : 0;
    in.n_batch        = n_batch() > 2*n_riders_max ? n_batch() - n_riders_max : n_batch();
    in.query_window   = (size_t) window;
    return plan_prefill(in);
}

void Engine::mark_clean(CleanState & clean, llama_seq_id seq) const {
    clean.states[seq] = seqs_.at(seq).state();
    const auto it = last_logits_.find(seq);
    clean.logits[seq] = it == last_logits_.end() ? std::nullopt : std::make_optional(it->second);
}

void Engine::evict_or_roll_back(CleanState & clean, llama_seq_id seq, const std::vector<llama_token> * prompt,
                                bool probed) {
    try {
        probe_and_evict(seq, prompt, probed);
    } catch (...) {
        for (const auto & [s, state] : clean.states) {
            seqs_.at(s).roll_back(state);
            if (clean.logits[s]) {
                last_logits_[s] = *clean.logits[s];
            } else {
                last_logits_.erase(s);
            }
            logits_all_.erase(s);
        }
        throw;
    }
    mark_clean(clean, seq);
}

void Engine::recall_prompts(CleanState & clean, const TokenMap & tokens) {
    for (const auto & [seq, toks] : tokens) {
        if (toks.size() > 1 && seqs_.at(seq).spill_cap() > 0 && seqs_.at(seq).host().size() > 0) {
            try {
                recall(seq, toks, true);
            } catch (...) {
                evict_or_roll_back(clean, seq, nullptr); // never more than the budget on the device
                throw;
            }
            mark_clean(clean, seq);
        }
    }
}

void Engine::feed_steps(CleanState & clean, const PrefillPlan & plan, const TokenMap & tokens, bool logits_all,
                        const std::function<Riders()> & between_chunks) {
    for (size_t i = 0; i < plan.steps.size(); ++i) {
        if (i > 0 && params_.check_interrupt) {
            params_.check_interrupt();
        }
        Riders riders;
        if (i > 0 && between_chunks) {
            riders = between_chunks();
            check_riders(riders, tokens);
        }
        const PrefillStep & step = plan.steps[i];
        TokenMap chunk;
        size_t n_chunk = 0;
        for (const auto & [seq, part] : step.chunk) {
            const auto & toks = tokens.at(seq);
            chunk[seq].assign(toks.begin() + part.first, toks.begin() + part.first + part.second);
            n_chunk += part.second;
        }
        size_t n_riding = 0;
        for (const auto & kv : riders) {
            n_riding += kv.second.size();
            mark_clean(clean, kv.first);
        }
        if (n_riding > 0 && (logits_all || n_chunk + n_riding > (size_t) n_batch())) {
            decode(riders, false, {}); // no room beside this chunk (or its every row is wanted): before it
        } else {
            chunk.insert(riders.begin(), riders.end());
        }
        const TokenMap rides = riding_probes(step, chunk, tokens);
        decode(chunk, logits_all, step.query_windows, {}, rides);
        for (const auto & kv : riders) {
            evict_or_roll_back(clean, kv.first, &kv.second);
        }
        for (const llama_seq_id seq : step.evict_after) {
            evict_or_roll_back(clean, seq, &tokens.at(seq), rides.count(seq) > 0);
        }
    }
}

void Engine::check_riders(const Riders & riders, const TokenMap & fed) {
    const int32_t n_vocab = model_->n_vocab();
    for (const auto & [seq, toks] : riders) {
        if (params_.kv_unified) {
            throw std::invalid_argument("tokens can ride with a prompt's chunks only where each sequence has a stream of its own (kv_unified=False)");
        }
        seq_cache(seq);
        if (fed.count(seq) || toks.empty()) {
            throw std::invalid_argument("sequence " + std::to_string(seq) + " cannot ride: it is being fed, or has no token");
        }
        for (const llama_token t : toks) {
            check_token_id(t, n_vocab);
        }
    }
}

void Engine::decode(const std::map<llama_seq_id, std::vector<llama_token>> & chunk, bool logits_all,
                    const std::set<llama_seq_id> & query_windows, const std::set<llama_seq_id> & probes,
                    const TokenMap & rides) {
    fill_batch(chunk, logits_all, probes, rides);
    decode_batch(chunk, probes);
    int32_t j = 0; // the chunk's first token in the batch
    for (const auto & [seq, toks] : chunk) {
        const bool probing = probes.count(seq) > 0;
        if (!probing) {
            keep_logits(seq, j, (int32_t) toks.size(), logits_all);
        }
        j += (int32_t) toks.size();
        const auto ride = rides.find(seq);
        observe_decoded(seq, toks, probing, query_windows.count(seq) > 0,
                        ride == rides.end() ? nullptr : &ride->second);
    }
}

void Engine::fill_batch(const TokenMap & chunk, bool logits_all, const std::set<llama_seq_id> & probes,
                        const TokenMap & rides) {
    batch_.n_tokens = 0;
    const auto add = [&](llama_seq_id seq, llama_token token, llama_pos pos, bool logits) {
        const int32_t j = batch_.n_tokens++;
        batch_.token[j]     = token;
        batch_.pos[j]       = pos;
        batch_.n_seq_id[j]  = 1;
        batch_.seq_id[j][0] = seq;
        batch_.logits[j]    = logits;
    };
    for (const auto & [seq, toks] : chunk) {
        const llama_pos p0 = seqs_.at(seq).next_pos();
        // a probe's tokens give no logits: it leaves the sequence's own (last_logits_) as they were
        const bool wants_logits = probes.count(seq) == 0;
        for (size_t i = 0; i < toks.size(); ++i) {
            add(seq, toks[i], p0 + (llama_pos) i, wants_logits && (logits_all || i + 1 == toks.size()));
        }
    }
    // after every sequence's tokens, so that a probe's cells lie where a decode of its own after this one puts them
    // (and with them the cells of the entries that come after)
    for (const auto & [seq, toks] : rides) {
        const llama_pos p_probe = seqs_.at(seq).next_pos() + (llama_pos) chunk.at(seq).size();
        for (size_t i = 0; i < toks.size(); ++i) {
            add(seq, toks[i], p_probe + (llama_pos) i, false);
        }
        if (llama_attn_scores_probe(ctx_, seq, p_probe) != 0) {
            throw std::logic_error("a probe rides with a chunk, but no scores are exported");
        }
    }
}

void Engine::decode_batch(const TokenMap & chunk, const std::set<llama_seq_id> & probes) {
    clear_llama_error();
    ++n_decode_;
    const auto t0 = std::chrono::steady_clock::now();
    const int32_t rc = llama_decode(ctx_, batch_);
    if (rc != 0) {
        // llama.cpp drops only the failed ubatch: drop the whole chunk so the state stays as before the call
        for (const auto & kv : chunk) {
            seqs_.at(kv.first).drop_unfinished();
        }
        throw std::runtime_error("llama_decode failed with status " + std::to_string(rc) + llama_error_suffix());
    }
    llama_synchronize(ctx_); // the logits read below waits for the device anyway: the time is its work too
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (const auto & kv : chunk) {
        if (probes.count(kv.first) == 0) {
            seqs_.at(kv.first).note_decode(seconds);
        }
    }
}

void Engine::keep_logits(llama_seq_id seq, int32_t first, int32_t n_new, bool logits_all) {
    const int32_t n_vocab = model_->n_vocab();
    if (logits_all) {
        auto & rows = logits_all_[seq];
        for (int32_t i = 0; i < n_new; ++i) {
            const float * row = llama_get_logits_ith(ctx_, first + i);
            rows.insert(rows.end(), row, row + n_vocab);
        }
    }
    const float * last = llama_get_logits_ith(ctx_, first + n_new - 1);
    last_logits_[seq].assign(last, last + n_vocab);
}

void Engine::observe_decoded(llama_seq_id seq, const std::vector<llama_token> & toks, bool probing, bool window,
                             const std::vector<llama_token> * ride) {
    SeqCache & sc = seqs_.at(seq);
    const int32_t n_new = (int32_t) toks.size();
    const int32_t n_ride = ride == nullptr ? 0 : (int32_t) ride->size();
    sc.append(toks);
    if (scores_path_ >= 0) {
        const llama_pos * pos = nullptr;
        const float * sums = nullptr;
        const int32_t n = llama_attn_scores_get(ctx_, seq, &pos, &sums);
        if (probing) {
            prober_.add(sc.state().positions, pos, sums, n);
        } else {
            const Policy & policy = policy_of(seq);
            if (policy.per_head()) { // first: a sequence's first per-head decode starts from the scores before it
                sc.observe_heads(policy, n_new, window);
            }
            // (a riding probe's entries are the newest n_ride: the chunk's queries gave them nothing)
            sc.observe(policy, pos, sums, n - n_ride, n_new, window,
                       !(window && policy.probe().source == ProbeSource::question));
        }
    }
    if (n_ride > 0) {
        prober_.start((size_t) sc.size(), n_head_);
        sc.append(*ride);
        const llama_pos * pos = nullptr;
        const float * sums = nullptr;
        const int32_t n = llama_attn_scores_get_probe(ctx_, seq, &pos, &sums);
        prober_.add(sc.state().positions, pos, sums, n);
        finish_probe(seq, n_ride, 0.0); // its time is the chunk's decode's
    }
}

RollRule Engine::roll_rule(llama_seq_id seq) const {
    RollRule rule;
    const Policy & policy = policy_of(seq);
    rule.on = params_.position_rolling && !policy.per_head();
    rule.interval = std::max(params_.roll_interval, 1);
    if (rolls_when_needed()) {
        // room below the trained context for one more batch and its probe; at least half of it (a batch larger
        // than that can pass it within one prompt, and rolling at every eviction would cost more than it saves)
        const int64_t n_train = llama_model_n_ctx_train(model_->get());
        const int64_t margin = (int64_t) n_batch() + probe_cells(policy);
        rule.after = (llama_pos) std::max<int64_t>({1, n_train - margin, n_train/2});
    }
    return rule;
}

void Engine::evict(llama_seq_id seq, int32_t incoming) {
    seqs_.at(seq).evict(policy_of(seq), roll_rule(seq), incoming);
}

// llama.cpp attends cells [0, n_kv) with n_kv padded above the highest used cell, so kept entries spread over the
// cells a long prompt went through cost what all those cells cost. Taking the kept entries out and putting them
// back puts them contiguous at the bottom of its stream (only done when the sequence has its stream to itself, so
// that the lowest free cells are its own).
void Engine::compact(llama_seq_id seq) {
    if (!params_.compact_cells || (params_.kv_unified && params_.n_seq_max > 1)) {
        return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (!seqs_.at(seq).compact_cells()) {
        seqs_.erase(seq);
        last_logits_.erase(seq);
        throw std::runtime_error("could not move the kept KV cells of sequence " + std::to_string(seq) +
                                 llama_error_suffix());
    }
    seqs_.at(seq).note_compact(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

} // namespace h2o
