#include "model.h"

// llama.cpp internals, for the per-layer K/V widths (not in the public API)
#include "llama-model.h"

#include "ggml-backend.h"
#ifdef GGML_USE_RPC
#include "ggml-rpc.h"
#endif

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>

#ifndef _WIN32
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

namespace h2o {

namespace {

bool        g_verbose = false;
std::string g_last_error; // the first error llama.cpp logged since clear_llama_error()

void log_callback(ggml_log_level level, const char * text, void *) {
    // the first error since clear_llama_error() is the reason; later ones ("failed to load model") are its echo
    if (level == GGML_LOG_LEVEL_ERROR && g_last_error.empty()) {
        g_last_error = text;
        while (!g_last_error.empty() && (g_last_error.back() == '\n' || g_last_error.back() == ' ')) {
            g_last_error.pop_back();
        }
    }
    if (g_verbose) {
        fputs(text, stderr);
    }
}

std::string builtin_template_names() {
    std::vector<const char *> names(llama_chat_builtin_templates(nullptr, 0));
    llama_chat_builtin_templates(names.data(), names.size());
    std::string out;
    for (const char * name : names) {
        out += (out.empty() ? "" : ", ") + std::string(name);
    }
    return out;
}

} // namespace

void init_backend(bool verbose) {
    static std::once_flag once;
    std::call_once(once, [] {
        llama_log_set(log_callback, nullptr);
        llama_backend_init();
    });
    g_verbose = g_verbose || verbose;
}

void clear_llama_error() {
    g_last_error.clear();
}

std::string llama_error_suffix() {
    return g_last_error.empty() ? "" : " (llama.cpp: " + g_last_error + ")";
}

// whether a TCP connection to "host:port" opens within timeout_ms (true where this cannot be checked)
bool endpoint_reachable(const std::string & endpoint, int timeout_ms) {
#ifdef _WIN32
    (void) endpoint; (void) timeout_ms;
    return true;
#else
    const size_t colon = endpoint.rfind(':');
    if (colon == std::string::npos) {
        return false;
    }
    addrinfo hints = {};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * found = nullptr;
    if (getaddrinfo(endpoint.substr(0, colon).c_str(), endpoint.substr(colon + 1).c_str(), &hints, &found) != 0) {
        return false;
    }
    bool reachable = false;
    for (addrinfo * a = found; a != nullptr && !reachable; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) {
            continue;
        }
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
            reachable = true;
        } else if (errno == EINPROGRESS) {
            pollfd p = {fd, POLLOUT, 0};
            int err = 0;
            socklen_t len = sizeof(err);
            reachable = poll(&p, 1, timeout_ms) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
        }
        close(fd);
    }
    freeaddrinfo(found);
    return reachable;
#endif
}

// the devices of ggml RPC servers, for this model only (never registered globally: a later model without
// rpc_servers must not offload to them)
static std::vector<ggml_backend_dev_t> rpc_devices(const std::vector<std::string> & servers) {
    std::vector<ggml_backend_dev_t> devices;
#ifndef GGML_USE_RPC
    if (!servers.empty()) {
        throw std::invalid_argument("this build has no RPC backend (built with -DH2O_LOCAL_RPC=OFF)");
    }
#endif
    for (const std::string & endpoint : servers) {
#ifdef GGML_USE_RPC
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(endpoint.c_str());
#else
        ggml_backend_reg_t reg = nullptr;
#endif
        if (reg == nullptr) {
            throw std::runtime_error("cannot reach the RPC server at " + endpoint + " (is `h2o-local rpc-server` running there?)");
        }
        for (size_t i = 0; i < ggml_backend_reg_dev_count(reg); ++i) {
            devices.push_back(ggml_backend_reg_dev_get(reg, i));
        }
    }
    return devices;
}

static bool same_device_id(ggml_backend_dev_t a, ggml_backend_dev_t b) {
    ggml_backend_dev_props pa;
    ggml_backend_dev_props pb;
    ggml_backend_dev_get_props(a, &pa);
    ggml_backend_dev_get_props(b, &pb);
    return pa.device_id && pb.device_id && std::strcmp(pa.device_id, pb.device_id) == 0;
}

// The devices a model may use, as llama.cpp's default selection orders them (RPC servers first, then this machine's
// GPUs, one per device id, or its integrated GPUs where it has no discrete one), but with only this model's own RPC
// servers: a registered RPC device, or one another model reached, is never on the list, so a server that died under
// an earlier model cannot abort a later one. nullptr-terminated, for llama_model_params::devices.
static std::vector<ggml_backend_dev_t> model_devices(const std::vector<std::string> & rpc_servers) {
    std::vector<ggml_backend_dev_t> gpus;
    std::vector<ggml_backend_dev_t> igpus;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (std::strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "RPC") == 0) {
            continue;
        }
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(dev);
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU &&
            std::none_of(gpus.begin(), gpus.end(), [dev](ggml_backend_dev_t g) { return same_device_id(g, dev); })) {
            gpus.push_back(dev);
        }
        // several backends may show one integrated GPU: the first backend's devices only
        if (type == GGML_BACKEND_DEVICE_TYPE_IGPU &&
            (igpus.empty() || ggml_backend_dev_backend_reg(dev) == ggml_backend_dev_backend_reg(igpus.back()))) {
            igpus.push_back(dev);
        }
    }
    std::vector<ggml_backend_dev_t> devices = rpc_devices(rpc_servers);
    const std::vector<ggml_backend_dev_t> & local = gpus.empty() ? igpus : gpus;
    devices.insert(devices.end(), local.begin(), local.end());
    devices.push_back(nullptr);
    return devices;
}

Model::Model(const std::string & path, int32_t n_gpu_layers, bool metadata_only, bool verbose,
             const std::vector<std::string> & rpc_servers) : rpc_servers_(rpc_servers) {
    init_backend(verbose);
    clear_llama_error();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = n_gpu_layers;
    std::vector<ggml_backend_dev_t> devices = model_devices(rpc_servers);
    mp.devices = devices.data();
    mp.no_alloc     = metadata_only;
    if (metadata_only) {
        mp.load_mode = LLAMA_LOAD_MODE_NONE; // llama.cpp's memory-fit pass: no weights read, nothing mapped
    }
    model_ = llama_model_load_from_file(path.c_str(), mp);
    if (model_ == nullptr) {
        throw std::invalid_argument("cannot load '" + path + "': not a loadable GGUF model" + llama_error_suffix());
    }
}

Model::~Model() {
    if (!rpc_servers_reachable()) {
        // llama.cpp aborts on a command it cannot send: what the model holds stays allocated instead
        std::fprintf(stderr, "h2o_local: an RPC server of this model no longer answers; its memory here is left "
                             "allocated (freeing it would abort the process)\n");
        return;
    }
    llama_model_free(model_);
}

bool Model::rpc_servers_reachable() const {
    for (const std::string & endpoint : rpc_servers_) {
        if (!endpoint_reachable(endpoint, 1000)) {
            return false;
        }
    }
    return true;
}

std::map<std::string, std::string> Model::metadata() const {
    std::map<std::string, std::string> out;
    std::vector<char> buf(256);
    const auto read = [&](int32_t i, auto fn) {
        int32_t n = fn(model_, i, buf.data(), buf.size());
        if (n >= (int32_t) buf.size()) { // snprintf's rule: the length it needed, the text cut
            buf.resize((size_t) n + 1);
            n = fn(model_, i, buf.data(), buf.size());
        }
        return n < 0 ? std::string() : std::string(buf.data(), (size_t) n);
    };
    for (int32_t i = 0; i < llama_model_meta_count(model_); ++i) {
        out[read(i, llama_model_meta_key_by_index)] = read(i, llama_model_meta_val_str_by_index);
    }
    return out;
}

ModelFacts Model::facts() const {
    ModelFacts f;
    char arch[128] = {0};
    if (llama_model_meta_val_str(model_, "general.architecture", arch, sizeof(arch)) > 0) {
        f.arch = arch;
    }
    f.n_ctx_train = llama_model_n_ctx_train(model_);
    f.n_vocab     = n_vocab();
    f.n_layer     = llama_model_n_layer(model_);
    f.n_head      = llama_model_n_head(model_);
    f.n_head_kv   = llama_model_n_head_kv(model_);
    f.n_embd      = llama_model_n_embd(model_);
    const auto & hp = model_->hparams;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (hp.has_kv(il) && !hp.is_swa(il)) {
            f.kv_bytes_per_cell += (uint64_t) (hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il)) * sizeof(ggml_fp16_t);
        }
    }
    f.model_bytes = llama_model_size(model_);
    f.n_params    = llama_model_n_params(model_);
    f.add_bos     = llama_vocab_get_add_bos(vocab());
    f.token_bos   = llama_vocab_bos(vocab());
    f.token_eos   = llama_vocab_eos(vocab());
    f.token_nl    = llama_vocab_nl(vocab());
    f.fim         = {llama_vocab_fim_pre(vocab()), llama_vocab_fim_suf(vocab()), llama_vocab_fim_mid(vocab()),
                     llama_vocab_fim_rep(vocab()), llama_vocab_fim_sep(vocab())};
    const char * tmpl = llama_model_chat_template(model_, nullptr);
    f.chat_template = tmpl ? tmpl : "";
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        ggml_backend_dev_t dev = model_->dev_layer((int) il);
        f.layer_devices.push_back(dev ? ggml_backend_dev_name(dev) : "CPU");
    }
    return f;
}

Model::Offload Model::offload() const {
    Offload out;
    std::vector<ggml_backend_dev_t> seen;
    bool memory_known = true;
    for (uint32_t il = 0; il < model_->hparams.n_layer(); ++il) {
        ggml_backend_dev_t dev = model_->dev_layer((int) il);
        if (dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            continue;
        }
        ++out.n_layer;
        if (std::find(seen.begin(), seen.end(), dev) != seen.end()) {
            continue;
        }
        seen.push_back(dev);
        out.devices.push_back(ggml_backend_dev_name(dev));
        size_t free = 0;
        size_t total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        memory_known = memory_known && total > 0;
        out.memory_bytes += total;
    }
    if (!memory_known) {
        out.memory_bytes = 0;
    }
    return out;
}

void check_token_id(llama_token t, int32_t n_vocab, const char * what) {
    if (t < 0 || t >= n_vocab) {
        throw std::invalid_argument((what != nullptr ? std::string(what) + " " : std::string()) + "token id " +
                                    std::to_string(t) + " out of range [0, " + std::to_string(n_vocab) + ")");
    }
}

void Model::check_token(llama_token token) const {
    check_token_id(token, n_vocab());
}

std::vector<llama_token> Model::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    std::vector<llama_token> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab(), text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
    if (n < 0) {
        out.resize(-n);
        n = llama_tokenize(vocab(), text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
    }
    if (n < 0) {
        throw std::runtime_error("tokenization failed");
    }
    out.resize(n);
    return out;
}

std::string Model::token_to_piece(llama_token token, bool special) const {
    check_token(token);
    char buf[256];
    int32_t n = llama_token_to_piece(vocab(), token, buf, sizeof(buf), 0, special);
    if (n < 0) {
        std::string big(-n, '\0');
        n = llama_token_to_piece(vocab(), token, big.data(), (int32_t) big.size(), 0, special);
        return big.substr(0, std::max(n, 0));
    }
    return std::string(buf, n);
}

std::string Model::detokenize(const std::vector<llama_token> & tokens, bool special) const {
    for (const llama_token t : tokens) {
        check_token(t);
    }
    std::string out(tokens.size()*8 + 16, '\0');
    int32_t n = llama_detokenize(vocab(), tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false, special);
    if (n < 0) {
        out.resize(-n);
        n = llama_detokenize(vocab(), tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false, special);
    }
    out.resize(std::max(n, 0));
    return out;
}

std::string Model::apply_chat_template(const std::vector<std::pair<std::string, std::string>> & messages,
                                       bool add_assistant, const std::string & tmpl) const {
    const char * t = tmpl.empty() ? llama_model_chat_template(model_, nullptr) : tmpl.c_str();
    if (t == nullptr) {
        throw std::invalid_argument("this model has no chat template: use create_completion with your own prompt");
    }
    std::vector<llama_chat_message> msgs;
    size_t len = 1024;
    for (const auto & m : messages) {
        msgs.push_back({m.first.c_str(), m.second.c_str()});
        len += 2*(m.first.size() + m.second.size()) + 64;
    }
    std::string out(len, '\0');
    int32_t n = llama_chat_apply_template(t, msgs.data(), msgs.size(), add_assistant, out.data(), (int32_t) out.size());
    if (n > (int32_t) out.size()) {
        out.resize(n);
        n = llama_chat_apply_template(t, msgs.data(), msgs.size(), add_assistant, out.data(), (int32_t) out.size());
    }
    if (n < 0) {
        if (!tmpl.empty()) {
            throw std::invalid_argument("'" + tmpl.substr(0, 64) + "' is not a chat template llama.cpp knows: give "
                                        "Jinja source or a built-in name (" + builtin_template_names() + ")");
        }
        throw std::invalid_argument("llama.cpp does not support this model's chat template");
    }
    out.resize(n);
    return out;
}

} // namespace h2o
