// pybind11 bindings: h2o_local._engine. The Python package (h2o_local/) is the user API; this is its engine room.
#include "context_size.h"
#include "embedder.h"
#include "engine.h"
#include "host_store.h"
#include "kv_types.h"
#include "plain_run.h"
#include "prefill_plan.h"
#include "recall_text.h"
#include "snapshot_format.h"

#include "ggml-backend.h"
#ifdef GGML_USE_RPC
#include "ggml-rpc.h"
#endif

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sstream>
#include <variant>

namespace py = pybind11;
using namespace pybind11::literals;
using namespace h2o;

namespace {

// engine calls that may wait for the engine's mutex must not hold the GIL meanwhile (the holder may need it)
template <typename F>
auto without_gil(F f) {
    py::gil_scoped_release release;
    return f();
}

template <typename T>
py::array_t<T> to_numpy(const T * data, std::vector<py::ssize_t> shape) {
    py::array_t<T> out(shape);
    std::copy(data, data + out.size(), out.mutable_data());
    return out;
}

// a PolicyConfig from keywords named as its fields (through the bound class: each field, the options by their rows)
PolicyConfig policy_config(const std::string & name, int32_t budget, const py::kwargs & fields) {
    py::object cfg = py::cast(PolicyConfig());
    cfg.attr("name") = name;
    cfg.attr("budget") = budget;
    for (const auto & item : fields) {
        const std::string key = py::str(item.first);
        if (key == "name" || key == "budget" || !py::hasattr(cfg, key.c_str())) {
            throw py::type_error("unexpected policy field '" + key + "'");
        }
        const bool unset = item.second.is_none();
        cfg.attr(key.c_str()) = unset ? (key == "probe" ? py::object(py::str("")) : py::object(py::int_(-1))) : item.second;
    }
    return cfg.cast<PolicyConfig>();
}

py::dict facts_dict(const ModelFacts & f) {
    const py::object tmpl = f.chat_template.empty() ? py::object(py::none()) : py::object(py::str(f.chat_template));
    return py::dict("arch"_a = f.arch, "n_ctx_train"_a = f.n_ctx_train, "n_vocab"_a = f.n_vocab, "n_layer"_a = f.n_layer,
                    "n_head"_a = f.n_head, "n_head_kv"_a = f.n_head_kv, "n_embd"_a = f.n_embd,
                    "kv_bytes_per_cell"_a = f.kv_bytes_per_cell, "model_bytes"_a = f.model_bytes, "n_params"_a = f.n_params,
                    "add_bos"_a = f.add_bos, "token_bos"_a = f.token_bos, "token_eos"_a = f.token_eos, "token_nl"_a = f.token_nl, "fim"_a = f.fim,
                    "chat_template"_a = tmpl,
                    "layer_devices"_a = f.layer_devices);
}

py::dict state_dict(const Engine & e, llama_seq_id seq) {
    const SeqState st = without_gil([&] { return e.state(seq); });
    const auto n = (py::ssize_t) st.positions.size();
    py::dict d;
    d["positions"]   = to_numpy(st.positions.data(), {n});
    d["origins"]     = to_numpy(st.origins.data(), {n});
    d["scores"]      = to_numpy(st.scores.total.data(), {n});
    d["head_scores"] = to_numpy(st.scores.head.data(), {n, (py::ssize_t) e.n_head()});
    d["queries"]     = to_numpy(st.scores.queries.data(), {n});
    d["probe_scores"] = to_numpy(st.scores.probe.data(), {n});
    std::vector<uint8_t> reply = st.scores.reply;
    reply.resize(n, 0);
    d["reply_marks"] = py::array_t<bool>(py::array::ShapeContainer{(py::ssize_t) n}, (const bool *) reply.data());
    d["tokens"]      = to_numpy(st.tokens.data(), {n});
    d["next_pos"]    = st.next_pos;
    d["n_seen"]      = st.n_seen;
    d["n_evicted"]   = st.n_evicted;
    d["peak_cells"]  = st.peak_cells;
    d["n_keep"]      = st.n_keep;
    d["evict_seconds"] = st.evict_seconds;
    d["probe_seconds"] = st.probe_seconds;
    d["n_probes"]      = st.n_probes;
    d["decode_seconds"]  = st.decode_seconds;
    d["compact_seconds"] = st.compact_seconds;
    d["n_head_moves"]  = st.n_head_moves;
    const HostStore h = without_gil([&] { return e.host(seq, false); });
    const auto n_host = (py::ssize_t) h.size();
    d["host_positions"] = to_numpy(h.positions().data(), {n_host});
    d["host_origins"]   = to_numpy(h.origins().data(), {n_host});
    d["host_bytes"]     = h.size()*h.entry_bytes();
    d["n_spilled"]      = h.n_spilled();
    d["n_recalled"]     = h.n_recalled();
    d["n_dropped"]      = h.n_dropped();
    d["text_origins"]   = to_numpy(h.text_origins().data(), {(py::ssize_t) h.text_origins().size()});
    // per-head cells: [layer][KV head][cell] the position each cell holds there (None: every cell holds its own)
    const HeadParts & hp = st.parts;
    if (hp.empty()) {
        d["head_positions"] = py::none();
        d["head_layers"]    = py::none();
    } else {
        py::array_t<llama_pos> hpos({(py::ssize_t) hp.layers.size(), (py::ssize_t) hp.n_head_kv, n});
        for (size_t k = 0; k < hp.pos.size(); ++k) {
            const std::vector<llama_pos> in_cells = hp.positions_in_cells(k);
            std::copy(in_cells.begin(), in_cells.end(), hpos.mutable_data() + k*n);
        }
        d["head_positions"] = hpos;
        d["head_layers"]    = to_numpy(hp.layers.data(), {(py::ssize_t) hp.layers.size()});
    }
    return d;
}

py::bytes snapshot_bytes(const SeqSnapshot & s) {
    const std::vector<uint8_t> b = snapshot_to_bytes(s);
    return py::bytes((const char *) b.data(), b.size());
}

std::shared_ptr<SeqSnapshot> snapshot_of(const py::bytes & b) {
    const std::string_view v = b;
    return std::make_shared<SeqSnapshot>(snapshot_from_bytes((const uint8_t *) v.data(), v.size()));
}

const Model & model_of(const Model & m) { return m; }
const Model & model_of(const Engine & e) { return e.model(); }

// the vocabulary calls and facts, shared by the metadata-only model and the engine
template <typename C>
void def_vocab(C & cls) {
    using T = typename C::type;
    cls.def("tokenize", [](const T & o, const std::string & text, bool add_special, bool parse_special) {
            return model_of(o).tokenize(text, add_special, parse_special);
        }, py::arg("text"), py::arg("add_special"), py::arg("parse_special"),
           py::call_guard<py::gil_scoped_release>()) // a long text takes long: other threads go on
        .def("token_to_piece", [](const T & o, llama_token t, bool special) {
            return py::bytes(model_of(o).token_to_piece(t, special));
        }, py::arg("token"), py::arg("special") = false)
        .def("detokenize", [](const T & o, const std::vector<llama_token> & toks, bool special) {
            return py::bytes(model_of(o).detokenize(toks, special));
        }, py::arg("tokens"), py::arg("special") = false)
        .def("apply_chat_template", [](const T & o, const std::vector<std::pair<std::string, std::string>> & messages,
                                       bool add_assistant, const std::string & tmpl) {
            return model_of(o).apply_chat_template(messages, add_assistant, tmpl);
        }, py::arg("messages"), py::arg("add_assistant") = true, py::arg("template") = "")
        .def("is_eog", [](const T & o, llama_token t) { return model_of(o).is_eog(t); })
        .def("facts", [](const T & o) { return facts_dict(model_of(o).facts()); })
        .def("metadata", [](const T & o) {
            py::dict out; // a file's text that is not UTF-8 shows U+FFFD rather than failing
            const auto text = [](const std::string & s) {
                return py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t) s.size(), "replace"));
            };
            for (const auto & [key, value] : model_of(o).metadata()) {
                out[text(key)] = text(value);
            }
            return out;
        });
}

// A scorer written in Python (research): a subclass of _engine.RankedPolicy overrides rank(total, head, queries)
// with NumPy arrays in and one number per entry out (larger = more worth keeping); sinks, heavy and recent are
// chosen from that ranking in C++ as for every RankedPolicy. Called with the GIL taken, inside eval.
class PyRankedPolicy : public RankedPolicy {
public:
    using RankedPolicy::RankedPolicy;

protected:
    std::vector<float> rank(const SeqScores & scores) const override {
        py::gil_scoped_acquire gil;
        const py::function override = py::get_override(static_cast<const RankedPolicy *>(this), "rank");
        if (!override) {
            return RankedPolicy::rank(scores);
        }
        const auto n = (py::ssize_t) scores.size();
        const py::object out = override(to_numpy(scores.total.data(), {n}),
                                        to_numpy(scores.head.data(), {n, (py::ssize_t) scores.n_head}),
                                        to_numpy(scores.queries.data(), {n}));
        const auto ranks = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(out);
        if (!ranks || ranks.ndim() != 1 || ranks.shape(0) != n) {
            throw std::invalid_argument("rank() must return one number per entry (" + std::to_string(n) + ")");
        }
        return std::vector<float>(ranks.data(), ranks.data() + n);
    }
};

} // namespace

PYBIND11_MODULE(_engine, m) {
    m.doc() = "h2o_local engine: a patched llama.cpp context with per-sequence KV eviction";

    // a grammar that cannot be followed fails its request (ValueError: the request's input is at fault); the
    // subclass is registered last, so that its translator is tried first
    const auto & grammar_error = py::register_exception<GrammarError>(m, "GrammarError", PyExc_ValueError);
    py::register_exception<GrammarWorkExceeded>(m, "GrammarWorkExceeded", grammar_error.ptr());

    m.def("policy_names", &policy_names, "The registered eviction policies, sorted.");
    m.def("backend_devices", [] {
        init_backend(false);
        py::list out;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(dev, &free, &total);
            const char * type = "cpu";
            switch (ggml_backend_dev_type(dev)) {
                case GGML_BACKEND_DEVICE_TYPE_GPU:   type = "gpu";   break;
                case GGML_BACKEND_DEVICE_TYPE_IGPU:  type = "igpu";  break;
                case GGML_BACKEND_DEVICE_TYPE_ACCEL: type = "accel"; break;
                default: break;
            }
            out.append(py::dict("name"_a = ggml_backend_dev_name(dev), "description"_a = ggml_backend_dev_description(dev),
                                "type"_a = type, "memory_free"_a = free, "memory_total"_a = total));
        }
        return out;
    }, "The ggml devices this build and machine offer: name, description, type (cpu, gpu, igpu, accel), memory in bytes.");
    m.def("plain_run", [](const std::string & model, const std::vector<llama_token> & prompt, int32_t n_decode,
                          int32_t n_gpu_layers, bool flash_attn, uint32_t n_batch, int32_t n_threads,
                          int32_t warmup_tokens) {
        init_backend(false);
        PlainRunParams p;
        p.model = model;
        p.n_gpu_layers = n_gpu_layers;
        p.flash_attn = flash_attn;
        p.n_batch = n_batch;
        p.n_threads = n_threads;
        p.warmup_tokens = warmup_tokens;
        PlainRunTimes t;
        {
            py::gil_scoped_release unlocked;
            t = plain_run(p, prompt, n_decode);
        }
        return py::dict("prefill_s"_a = t.prefill_s, "step_s"_a = t.step_s, "tokens"_a = t.tokens, "model_bytes"_a = t.model_bytes,
                        "n_ctx"_a = t.n_ctx);
    }, py::arg("model"), py::arg("prompt"), py::arg("n_decode"), py::arg("n_gpu_layers") = 0,
       py::arg("flash_attn") = false, py::arg("n_batch") = 512, py::arg("n_threads") = 0, py::arg("warmup_tokens") = 0,
       "llama.cpp's own API on this build, nothing of h2o_local around it (plain_run.h): a warm-up of the prompt's "
       "first warmup_tokens (then cleared), the prompt, then greedy steps (their tokens and seconds). The benchmarks' "
       "baseline.");
    m.def("padded_cells", &padded_cells, py::arg("n_cells"), py::arg("n_seq"), py::arg("kv_unified"),
          "KV cells llama.cpp allocates for n_cells (rounded up per stream).");
    m.def("kv_type_bytes", &kv_type_bytes, py::arg("name"), "Bytes per element of a KV cache type (ggml name).");
    m.def("q8_0_entry_bytes", &q8_0_entry_bytes, py::arg("raw_bytes"), "Bytes of one F16 entry kept as q8_0 blocks.");
    m.def("reread_choice", [](const std::vector<llama_token> & tokens, const std::vector<llama_token> & question,
                              size_t max_tokens, size_t window) {
              return reread_choice(tokens, question, window, max_tokens);
          }, py::arg("tokens"), py::arg("question"), py::arg("max_tokens"), py::arg("window") = kRereadWindow,
          "The indices (ascending) of the dropped text `tokens` whose windows a question reads again (recall_text.h).");
    m.def("check_host_memory", [](uint32_t n_ctx, uint32_t n_outputs_max, uint64_t kv_bytes_per_cell, int32_t n_vocab,
                                  bool kv_on_host, uint64_t have) {
        ContextSize c;
        c.n_ctx = n_ctx; c.n_outputs_max = n_outputs_max;
        check_host_memory(c, kv_bytes_per_cell, n_vocab, kv_on_host, have);
    }, py::arg("n_ctx"), py::arg("n_outputs_max"), py::arg("kv_bytes_per_cell"), py::arg("n_vocab"),
       py::arg("kv_on_host"), py::arg("have"), "Raises ValueError when the context needs more than `have` bytes.");
    m.def("check_device_memory", [](uint32_t n_ctx, uint64_t device_kv_bytes_per_cell, const std::string & devices,
                                    uint64_t have) {
        ContextSize c;
        c.n_ctx = n_ctx;
        check_device_memory(c, device_kv_bytes_per_cell, devices, have);
    }, py::arg("n_ctx"), py::arg("device_kv_bytes_per_cell"), py::arg("devices"), py::arg("have"),
       "Raises ValueError when the KV cells on `devices` need more than their `have` bytes.");
    m.def("plan_prefill", [](const std::map<llama_seq_id, size_t> & sizes, const std::map<llama_seq_id, int32_t> & cells,
                             int32_t capacity, bool kv_unified, bool defer_eviction, bool bounded, int32_t budget,
                             size_t n_batch, size_t query_window) {
        PrefillInput in;
        in.sizes = sizes; in.cells = cells; in.capacity = capacity; in.kv_unified = kv_unified;
        in.defer_eviction = defer_eviction; in.bounded = bounded; in.budget = budget; in.n_batch = n_batch;
        in.query_window = query_window;
        const PrefillPlan plan = plan_prefill(in);
        py::list steps;
        for (const PrefillStep & s : plan.steps) {
            py::dict chunk;
            for (const auto & [seq, part] : s.chunk) {
                chunk[py::int_(seq)] = py::make_tuple(part.first, part.second);
            }
            steps.append(py::make_tuple(chunk, std::vector<llama_seq_id>(s.query_windows.begin(), s.query_windows.end()),
                                        s.evict_after));
        }
        return py::make_tuple(plan.fits, steps);
    }, py::arg("sizes"), py::arg("cells"), py::arg("capacity"), py::arg("kv_unified"), py::arg("defer_eviction"),
       py::arg("bounded"), py::arg("budget"), py::arg("n_batch"), py::arg("query_window"),
       "How a feed is cut (cpp/prefill_plan.h): (fits, [({seq: (offset, n)}, window seqs, seqs evicting after), ...]).");
    m.def("bounded_cells", &bounded_cells, py::arg("n_seq"), py::arg("budget"), py::arg("n_batch"), py::arg("kv_unified"),
          "KV cells a bounded cache needs: budgets + one batch (unified), or a budget + one batch per stream.");
    // a resolved policy: validation, defaults and the budget split happen here, once; the engine takes this object
    // a policy as asked for (cpp/policy_config.h): its fields, the options by their rows
    auto config = py::class_<PolicyConfig>(m, "PolicyConfig", "A policy as asked for; < 0: not given.")
        .def(py::init<>())
        .def_readwrite("name", &PolicyConfig::name)
        .def_readwrite("budget", &PolicyConfig::budget)
        .def_readwrite("heavy", &PolicyConfig::heavy)
        .def_readwrite("recent", &PolicyConfig::recent)
        .def_readwrite("sinks", &PolicyConfig::sinks)
        .def_readwrite("query_window", &PolicyConfig::query_window)
        .def_readwrite("probe", &PolicyConfig::probe)
        .def_readwrite("question", &PolicyConfig::question);
    py::list options;
    for (const PolicyOption & o : policy_options()) {
        const auto field = o.field;
        config.def_property(o.name, [field](const PolicyConfig & c) { return c.*field; },
                            [field](PolicyConfig & c, int32_t v) { c.*field = v; });
        options.append(py::dict("name"_a = o.name, "suffix"_a = o.suffix, "unset"_a = o.unset, "minimum"_a = o.minimum,
                                "maximum"_a = o.maximum, "unit"_a = o.unit, "flag"_a = o.flag, "help"_a = o.help));
    }
    m.attr("POLICY_OPTIONS") = options;
    m.def("parse_policy_label", &parse_policy_label, py::arg("text"),
          "The config a label names (\"tova-256+s4+q32\"); ValueError when it is no label.");
    m.def("apply_label_suffix", &apply_label_suffix, py::arg("config"), py::arg("suffix"),
          "Set what one label suffix (\"s4\", \"q32\", \"p9\", \"ph\") says; False when it is no policy suffix.");
    m.def("default_policy_config", &default_policy_config, py::arg("given"),
          "The default policy's config with what was given (cpp/policy_config.h).");
    py::class_<Policy, std::shared_ptr<Policy>>(m, "Policy", "A resolved eviction policy (see h2o_local.policies).")
        .def(py::init([](const PolicyConfig & cfg) { return std::shared_ptr<Policy>(make_policy(cfg)); }), py::arg("config"))
        .def(py::init([](const std::string & name, int32_t budget, const py::kwargs & fields) {
                 return std::shared_ptr<Policy>(make_policy(policy_config(name, budget, fields)));
             }), py::arg("name"), py::arg("budget") = -1,
             "A policy from its name, budget and the fields of PolicyConfig by keyword (None or < 0: not given).")
        .def_property_readonly("probe", [](const Policy & p) { return probe_source_name(p.probe().source); })
        .def_property_readonly("question", [](const Policy & p) { return p.probe().question; })
        .def("option", [](const Policy & p, const std::string & name) {
            const PolicyOption * o = find_policy_option(name);
            if (o == nullptr) {
                throw py::key_error(name);
            }
            const auto * r = dynamic_cast<const RankedPolicy *>(&p);
            return r != nullptr ? r->options().*o->field : o->unset;
        }, py::arg("name"), "An option's value (policy_options()), resolved: its unset value when not given.")
        .def_property_readonly("label", &policy_label)
        .def_property_readonly("per_head", &Policy::per_head)
        .def_property_readonly("name", &Policy::name)
        .def_property_readonly("bounded", &Policy::bounded)
        .def_property_readonly("needs_scores", &Policy::needs_scores)
        .def_property_readonly("needs_keys", &Policy::needs_keys)
        .def_property_readonly("query_window", &Policy::query_window)
        .def_property_readonly("sinks", [](const Policy & p) { return p.split().sinks; })
        .def_property_readonly("heavy", [](const Policy & p) { return p.split().heavy; })
        .def_property_readonly("recent", [](const Policy & p) { return p.split().recent; })
        .def_property_readonly("budget", [](const Policy & p) { return p.bounded() ? p.split().total() : -1; })
        .def("select", [](const Policy & p, const std::vector<llama_pos> & positions, const std::vector<float> & total,
                        py::array_t<float, py::array::c_style | py::array::forcecast> head,
                        const std::vector<int64_t> & queries, std::vector<float> probe, int32_t incoming,
                        const std::vector<bool> & reply) {
            SeqScores s;
            s.n_head  = head.ndim() == 2 ? (int32_t) head.shape(1) : 0;
            s.total   = total;
            s.head.assign(head.data(), head.data() + head.size());
            s.queries = queries;
            s.probe   = probe.empty() ? std::vector<float>(positions.size(), 0.0f) : std::move(probe);
            s.reply.assign(reply.begin(), reply.end());
            if (total.size() != positions.size() || queries.size() != positions.size() ||
                s.head.size() != positions.size()*(size_t) s.n_head || s.probe.size() != positions.size() ||
                !(reply.empty() || reply.size() == positions.size())) {
                throw std::invalid_argument("positions, total, head [n, n_head], queries, probe and reply must describe n "
                                            "entries");
            }
            if (std::any_of(s.probe.begin(), s.probe.end(), [](float v) { return v < 0.0f; })) {
                throw std::invalid_argument("a probe's lift is >= 0 (mark the last exchange with reply=)");
            }
            return p.select(positions, s, p.split_before(incoming));
        }, py::arg("positions"), py::arg("total"), py::arg("head"), py::arg("queries"),
           py::arg("probe") = std::vector<float>(), py::arg("incoming") = 0, py::arg("reply") = std::vector<bool>(),
           "The indices the policy keeps of n entries with these scores (its rule alone, on synthetic scores); "
           "incoming: as recall ranks before a prompt of that many tokens (the handoff option); reply: the last exchange's "
           "entries (the reply option).");

    py::class_<RankedPolicy, PyRankedPolicy, Policy, std::shared_ptr<RankedPolicy>>(
        m, "RankedPolicy", "Subclass it and define rank(total, head, queries) to score entries in Python.")
        .def(py::init([](const std::string & name, int32_t budget, int32_t heavy, int32_t recent, int32_t sinks) {
                 PolicyConfig cfg;
                 cfg.name = name; cfg.budget = budget; cfg.heavy = heavy; cfg.recent = recent; cfg.sinks = sinks;
                 return std::make_shared<PyRankedPolicy>(name, ranked_split(cfg, half_recent));
             }), py::arg("name"), py::arg("budget"), py::arg("heavy") = -1, py::arg("recent") = -1,
             py::arg("sinks") = -1);

    m.attr("PROBE_TEXTS") = py::dict("catalyst"_a = probe_text(ProbeSource::catalyst),
                                     "repeat"_a = probe_text(ProbeSource::repeat));
    m.attr("DEFAULT_QUESTION_TOKENS") = kDefaultQuestionTokens;
#ifdef H2O_LLAMA_CPP_COMMIT
    m.attr("LLAMA_CPP_COMMIT") = H2O_LLAMA_CPP_COMMIT;
#else
    m.attr("LLAMA_CPP_COMMIT") = "";
#endif

#ifdef GGML_USE_RPC
    m.attr("RPC_PROTO_VERSION") = py::make_tuple(RPC_PROTO_MAJOR_VERSION, RPC_PROTO_MINOR_VERSION, RPC_PROTO_PATCH_VERSION);
#else
    m.attr("RPC_PROTO_VERSION") = py::none();
#endif
    m.def("rpc_serve", [](const std::string & endpoint, int32_t n_threads) {
        ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        if (cpu == nullptr) {
            throw std::runtime_error("no CPU backend to serve");
        }
#ifdef GGML_USE_RPC
        py::gil_scoped_release release;
        ggml_backend_rpc_start_server(endpoint.c_str(), nullptr, (size_t) std::max(n_threads, 1), 1, &cpu);
#else
        throw std::runtime_error("this build has no RPC backend (built with -DH2O_LOCAL_RPC=OFF)");
#endif
    }, py::arg("endpoint"), py::arg("n_threads"),
       "Serve this machine's CPU backend to ggml RPC clients at host:port (blocks; never returns on success).");

    py::class_<Model> model(m, "Model", "The model's metadata and vocabulary, without its weights.");
    model.def(py::init([](const std::string & path) {
        py::gil_scoped_release release;
        return new Model(path, 0, true, false);
    }), py::arg("model_path"));
    def_vocab(model);

    // the engine's settings with their defaults, in one place (llama.cpp's llama_context_params pattern)
    py::class_<EngineParams> params(m, "EngineParams");
    params
        .def(py::init<>())
        .def_property("policy", [](const EngineParams & p) { return std::const_pointer_cast<Policy>(p.policy); },
                      [](EngineParams & p, std::shared_ptr<Policy> v) { p.policy = std::move(v); })
        .def_readwrite("n_keep", &EngineParams::n_keep)
        .def_readwrite("n_threads", &EngineParams::n_threads)
        .def_readwrite("scores_sum_rows", &EngineParams::scores_sum_rows)
        .def_readwrite("type_k", &EngineParams::type_k)
        .def_readwrite("type_v", &EngineParams::type_v)
        .def_readwrite("flash_attn", &EngineParams::flash_attn, "-1: auto (on where the layers run on a GPU), 0: off, 1: on")
        .def_readwrite("rpc_servers", &EngineParams::rpc_servers)
        .def_readwrite("host_entries", &EngineParams::host_entries)
        .def_readwrite("host_q8_0", &EngineParams::host_q8_0);
    // the plain settings, from their rows (engine_params.cpp)
    py::list settings;
    const EngineParams defaults;
    for (const EngineSetting & s : engine_settings()) {
        std::visit([&](auto field) {
            params.def_readwrite(s.name, field, s.help);
            std::vector<std::string> flags;
            std::istringstream words(s.flags);
            for (std::string f; words >> f; ) {
                flags.push_back(f);
            }
            settings.append(py::dict("name"_a = s.name, "flags"_a = flags,
                                     "minimum"_a = s.minimum ? py::cast(*s.minimum) : py::none(),
                                     "maximum"_a = s.maximum ? py::cast(*s.maximum) : py::none(), "unit"_a = s.unit,
                                     "help"_a = s.help, "default"_a = defaults.*field));
        }, s.field);
    }
    m.attr("ENGINE_SETTINGS") = settings;

    // declared before their methods: each one's signatures name the other
    py::class_<Engine> engine(m, "Engine");
    py::class_<Sampler> sampler(m, "Sampler");
    sampler
        .def(py::init([](int32_t n_vocab, float temperature, float top_p, int32_t top_k, float min_p, uint32_t seed,
                         std::vector<llama_token> banned, const std::map<llama_token, float> & logit_bias,
                         int32_t penalty_last_n, float repeat_penalty, float frequency_penalty, float presence_penalty,
                         std::vector<llama_token> history, const std::string & grammar, uint64_t grammar_max_work,
                         const Engine * engine, float typical_p, int32_t mirostat, float mirostat_tau,
                         float mirostat_eta, const Sampler * grammar_of) {
                 SamplerParams p;
                 p.temperature = temperature; p.top_p = top_p; p.top_k = top_k; p.min_p = min_p; p.seed = seed;
                 p.typical_p = typical_p; p.mirostat = mirostat; p.mirostat_tau = mirostat_tau;
                 p.mirostat_eta = mirostat_eta;
                 p.banned = std::move(banned);
                 for (const auto & [token, bias] : logit_bias) {
                     p.logit_bias.push_back({token, bias});
                 }
                 p.penalty_last_n = penalty_last_n; p.repeat_penalty = repeat_penalty;
                 p.frequency_penalty = frequency_penalty; p.presence_penalty = presence_penalty;
                 p.history = std::move(history);
                 p.grammar = grammar;
                 p.grammar_max_work = grammar_max_work;
                 py::gil_scoped_release release; // parsing a grammar and checking its start can take long
                 if (grammar_of != nullptr) {
                     return new Sampler(p, n_vocab, *grammar_of);
                 }
                 return new Sampler(p, n_vocab, engine != nullptr ? engine->model().vocab() : nullptr);
             }), py::arg("n_vocab"), py::kw_only(), py::arg("temperature"), py::arg("top_p"), py::arg("top_k"),
             py::arg("min_p"), py::arg("seed"), py::arg("banned") = std::vector<llama_token>(),
             py::arg("logit_bias") = std::map<llama_token, float>(), py::arg("penalty_last_n") = 64,
             py::arg("repeat_penalty") = 1.0f, py::arg("frequency_penalty") = 0.0f, py::arg("presence_penalty") = 0.0f,
             py::arg("history") = std::vector<llama_token>(), py::arg("grammar") = "",
             py::arg("grammar_max_work") = 0, py::arg("engine") = nullptr, py::arg("typical_p") = 1.0f,
             py::arg("mirostat") = 0, py::arg("mirostat_tau") = 5.0f, py::arg("mirostat_eta") = 0.1f,
             py::arg("grammar_of") = nullptr, py::keep_alive<1, 17>(),
             "grammar_of: a sampler whose grammar (parsed and checked) this one copies instead of parsing `grammar`; "
             "give the same engine")
        .def("sample", [](Sampler & s, py::array_t<float, py::array::c_style | py::array::forcecast> logits) {
            if (logits.size() != s.n_vocab()) {
                throw std::invalid_argument("expected " + std::to_string(s.n_vocab()) + " logits, got " + std::to_string(logits.size()));
            }
            const float * row = logits.data();
            py::gil_scoped_release release; // a grammar can take long: other threads (a server's steps) go on
            return s.sample(row);
        }, py::arg("logits"), "The next token drawn from a row of logits given from Python.")
        .def_property_readonly("has_grammar", &Sampler::has_grammar,
                               "Whether a grammar constrains it (its draws can take long: a server draws them aside).");

    // after the classes their signatures name
    m.def("context_size", [](const EngineParams & params, std::shared_ptr<Policy> policy, int32_t n_ctx_train,
                             int32_t n_probe, int32_t n_ride) {
        const ContextSize c = context_size(params, *policy, n_ctx_train, n_probe, n_ride);
        return py::dict("n_ctx"_a = c.n_ctx, "n_batch"_a = c.n_batch, "n_ubatch"_a = c.n_ubatch,
                        "n_outputs_max"_a = c.n_outputs_max, "n_probe_ride"_a = c.n_probe_ride);
    }, py::arg("params"), py::arg("policy"), py::arg("n_ctx_train"), py::arg("n_probe") = 0, py::arg("n_ride") = 0,
       "The KV cells, batch and logits rows of a context for params under policy (n_probe: one probe's cells; n_ride: "
       "the probe's tokens that can ride with a chunk's decode).");
    m.def("choose_kv_types", [](const EngineParams & params, int32_t key_head, const std::string & offloaded_to,
                                bool rotation_disabled) {
        KvTypeFacts facts;
        facts.key_head = key_head; facts.offloaded_to = offloaded_to; facts.rotation_disabled = rotation_disabled;
        const KvTypes t = choose_kv_types(params, facts);
        return py::make_tuple(ggml_type_name(t.k), ggml_type_name(t.v));
    }, py::arg("params"), py::arg("key_head"), py::arg("offloaded_to") = "", py::arg("rotation_disabled") = false,
       "The (K, V) cache types a context gets from params on a model with key heads of key_head values whose layers "
       "are on offloaded_to (empty: the CPU); raises ValueError for what llama.cpp cannot do with them.");
    m.def("flash_attn_type", [](const EngineParams & params, const std::string & offloaded_to, bool software_device) {
        KvTypeFacts facts;
        facts.offloaded_to = offloaded_to;
        facts.software_device = software_device;
        return std::string(llama_flash_attn_type_name(flash_attn_type(params, facts)));
    }, py::arg("params"), py::arg("offloaded_to") = "", py::arg("software_device") = false,
       "What a context with params asks llama.cpp for (\"enabled\", \"disabled\" or \"auto\") when its layers are "
       "on offloaded_to (empty: the CPU; software_device: a device that runs on the CPU, as Mesa's lavapipe).");

    // before Engine: its methods' signatures name it
    py::class_<SeqSnapshot, std::shared_ptr<SeqSnapshot>>(m, "SeqSnapshot")
        .def_property_readonly("nbytes", [](const SeqSnapshot & s) { return s.kv.size() + s.host.nbytes(); })
        .def_property_readonly("n_host", [](const SeqSnapshot & s) { return s.host.size(); })
        .def_property_readonly("n_cells", [](const SeqSnapshot & s) { return s.state.positions.size(); })
        .def_property_readonly("origin", [](const SeqSnapshot & s) { return s.origin; })
        .def_readwrite("pending", &SeqSnapshot::pending)
        .def("to_bytes", &snapshot_bytes)
        .def_static("from_bytes", &snapshot_of, py::arg("data"))
        .def(py::pickle(&snapshot_bytes, &snapshot_of));

    engine
        .def(py::init([](const std::string & model_path, EngineParams p) {
                 p.check_interrupt = [] {
                     py::gil_scoped_acquire gil;
                     if (PyErr_CheckSignals() != 0) {
                         throw py::error_already_set(); // KeyboardInterrupt, raised where eval was called
                     }
                 };
                 py::gil_scoped_release release;
                 return new Engine(model_path, p);
             }), py::arg("model_path"), py::arg("params"))
        .def("eval", [](Engine & e, const std::map<llama_seq_id, std::vector<llama_token>> & tokens, bool logits_all,
                        py::object between_chunks) {
                 std::function<Engine::Riders()> hook;
                 if (!between_chunks.is_none()) {
                     hook = [between_chunks] {
                         py::gil_scoped_acquire gil;
                         py::object riders = between_chunks();
                         return riders.is_none() ? Engine::Riders() : riders.cast<Engine::Riders>();
                     };
                 }
                 py::gil_scoped_release release;
                 e.eval(tokens, logits_all, hook);
             }, py::arg("tokens"), py::arg("logits_all") = false, py::arg("between_chunks") = py::none(),
             "Feed {seq_id: [token, ...]} in one batch, evicting as the policy says. between_chunks() is called "
             "between the chunks of a long feed and may return {seq_id: [token]} of other sequences (each with a "
             "stream of its own) to decode with the next chunk; it may also eval such sequences, or raise.")
        .def("sample", &Engine::sample, py::arg("seq_id"), py::arg("sampler"), py::call_guard<py::gil_scoped_release>(),
             "The next token of seq_id, drawn from its last logits in place.")
        .def("set_policy", [](Engine & e, std::shared_ptr<Policy> policy) { e.set_policy(std::move(policy)); },
             py::arg("policy"), py::call_guard<py::gil_scoped_release>())
        .def("set_seq_policy", [](Engine & e, llama_seq_id seq, std::shared_ptr<Policy> policy) {
                 e.set_seq_policy(seq, std::move(policy));
             }, py::arg("seq_id"), py::arg("policy").none(true), py::call_guard<py::gil_scoped_release>(),
             "A policy for one sequence until it is reset (None: the engine's again).")
        .def("configure_seq", [](Engine & e, llama_seq_id seq, std::shared_ptr<Policy> policy, int64_t recall_cap) {
                 e.configure_seq(seq, std::move(policy), recall_cap);
             }, py::arg("seq_id"), py::arg("policy").none(true), py::arg("recall_cap"),
             py::call_guard<py::gil_scoped_release>(),
             "One sequence's policy (None: the engine's) and recall cap (-1: the engine's), checked together.")
        .def("has_seq_policy", &Engine::has_seq_policy, py::arg("seq_id"))
        .def("set_keep", &Engine::set_keep, py::arg("seq_id"), py::arg("n_keep"), py::call_guard<py::gil_scoped_release>())
        .def("compress", &Engine::compress, py::arg("seq_id") = 0, py::call_guard<py::gil_scoped_release>())
        .def("snapshot", &Engine::snapshot, py::arg("seq_id") = 0, py::call_guard<py::gil_scoped_release>())
        .def("restore", &Engine::restore, py::arg("seq_id"), py::arg("snapshot"), py::call_guard<py::gil_scoped_release>())
        .def("reset", &Engine::reset, py::call_guard<py::gil_scoped_release>())
        .def("reset_seq", &Engine::reset_seq, py::arg("seq_id"), py::call_guard<py::gil_scoped_release>())
        .def("truncate", &Engine::truncate, py::arg("seq_id"), py::arg("n_tokens"),
             py::call_guard<py::gil_scoped_release>())
        .def("last_logits", [](const Engine & e, llama_seq_id seq) {
            const auto v = without_gil([&] { return e.last_logits(seq); });
            return to_numpy(v.data(), {(py::ssize_t) v.size()});
        }, py::arg("seq_id") = 0)
        .def("logits_all", [](const Engine & e, llama_seq_id seq) {
            const auto v = without_gil([&] { return e.logits_all(seq); });
            const auto n_vocab = (py::ssize_t) e.model().n_vocab();
            return to_numpy(v.data(), {(py::ssize_t) v.size()/n_vocab, n_vocab});
        }, py::arg("seq_id") = 0)
        .def("take_logits_all", [](Engine & e, llama_seq_id seq) {
            auto * rows = new std::vector<float>(without_gil([&] { return e.take_logits_all(seq); }));
            py::capsule owner(rows, [](void * p) { delete static_cast<std::vector<float> *>(p); });
            const auto n_vocab = (py::ssize_t) e.model().n_vocab();
            return py::array_t<float>({(py::ssize_t) rows->size()/n_vocab, n_vocab}, rows->data(), owner);
        }, py::arg("seq_id") = 0, "logits_all's rows moved out, without a copy: the engine keeps none of them")
        .def("last_scores", [](const Engine & e, llama_seq_id seq) {
            std::vector<llama_pos> pos;
            std::vector<float> sums;
            without_gil([&] { e.last_scores(seq, pos, sums); return 0; });
            const auto n = (py::ssize_t) pos.size();
            return py::make_tuple(to_numpy(pos.data(), {n}), to_numpy(sums.data(), {n, (py::ssize_t) e.n_head()}));
        }, py::arg("seq_id") = 0, "The raw scores the patch exported for seq_id in the last llama_decode: (positions, [n, n_head]).")
        .def("keys", [](const Engine & e, llama_seq_id seq, int32_t il) {
            std::vector<llama_pos> pos;
            std::vector<float> keys;
            int32_t n_embd = 0;
            without_gil([&] { e.keys(seq, il, pos, keys, n_embd); return 0; });
            const auto n = (py::ssize_t) pos.size();
            return py::make_tuple(to_numpy(pos.data(), {n}), to_numpy(keys.data(), {n, (py::ssize_t) n_embd}));
        }, py::arg("seq_id"), py::arg("layer"),
           "The cached keys of seq_id's kept entries in a layer, F32 after RoPE: (positions, [n, n_embd_k_gqa]).")
        .def("set_recall", &Engine::set_recall, py::arg("cap"), py::call_guard<py::gil_scoped_release>())
        .def("set_seq_recall", &Engine::set_seq_recall, py::arg("seq_id"), py::arg("cap"),
             py::call_guard<py::gil_scoped_release>())
        .def("check_recall", [](const Engine & e, const std::shared_ptr<Policy> & policy) {
            e.check_recall(*policy, 1);
        }, py::arg("policy"), "Raise ValueError when this policy cannot recall on this engine.")
        .def("recall_for", &Engine::recall_for, py::arg("seq_id"), py::arg("question"),
             py::call_guard<py::gil_scoped_release>())
        .def("state", &state_dict, py::arg("seq_id") = 0)
        .def("kv_entries", [](Engine & e, llama_seq_id seq, const std::vector<llama_pos> & positions) {
            const std::vector<uint8_t> b = without_gil([&] { return e.kv_entries(seq, positions); });
            return py::bytes((const char *) b.data(), b.size());
        }, py::arg("seq_id"), py::arg("positions"), "K and V bytes of the cells at these positions (entry_size each).")
        .def("host_kv", [](const Engine & e, llama_seq_id seq) {
            const HostStore h = without_gil([&] { return e.host(seq, true); });
            return py::make_tuple(h.positions(), py::bytes((const char *) h.kv().data(), h.kv().size()));
        }, py::arg("seq_id"), "What seq spilled: (positions, K and V bytes, entry_size each, in that order).")
        .def_property_readonly("entry_size", &Engine::entry_size)
        .def("next_pos", &Engine::next_pos, py::arg("seq_id") = 0, py::call_guard<py::gil_scoped_release>())
        .def("seq_pos_range", [](const Engine & e, llama_seq_id seq) {
            llama_memory_t mem = llama_get_memory(e.ctx());
            return py::make_tuple(llama_memory_seq_pos_min(mem, seq), llama_memory_seq_pos_max(mem, seq));
        }, py::arg("seq_id") = 0, "llama.cpp's own (min, max) position of seq_id; (-1, -1) when empty")
        .def_property_readonly("n_ctx", &Engine::n_ctx)
        .def_property_readonly("capacity", &Engine::capacity)
        .def_property_readonly("stream_capacity", &Engine::stream_capacity)
        .def_property_readonly("n_decode", &Engine::n_decode, "llama_decode calls made so far")
        .def_property_readonly("n_graphs_reused", &Engine::n_graphs_reused,
                               "ubatches that reused the previous compute graph (llama.cpp's graph reuse)")
        .def_property_readonly("kv_unified", &Engine::kv_unified)
        .def("room", &Engine::room, py::arg("seq_id"), py::call_guard<py::gil_scoped_release>(),
             "KV cells still free for seq_id: its stream's, or the whole unified cache's (shared by all sequences).")
        .def_property_readonly("n_batch", &Engine::n_batch)
        .def_property_readonly("n_ubatch", &Engine::n_ubatch)
        .def_property_readonly("n_threads", &Engine::n_threads)
        .def_property_readonly("n_threads_batch", &Engine::n_threads_batch)
        .def_property_readonly("position_rolling", [](const Engine & e) { return e.params().position_rolling; },
                               "Whether bounded sequences' positions are renumbered (off where this cache cannot shift "
                               "them, with roll_interval 0).")
        .def_property_readonly("kv_bytes", [](const Engine & e) { return without_gil([&] { return e.kv_bytes(); }); })
        .def("probe_cells", [](const Engine & e, const Policy & p) { return e.probe_cells(p); }, py::arg("policy"),
             "KV cells the policy's probe needs beside a sequence's entries.")
        .def_property_readonly("cells_used", [](const Engine & e) { return without_gil([&] { return e.cells_used(); }); })
        .def_property_readonly("scores_sum_rows", &Engine::scores_sum_rows)
        .def_property_readonly("flash_attn", &Engine::flash_attn, "Whether the context runs flash attention.")
        .def_property_readonly("probe_rides", &Engine::probe_rides,
                               "Whether a prompt's probe is decoded with the chunk before its eviction.")
        .def_property_readonly("params", [](const Engine & e) {
            EngineParams p = e.params();
            p.check_interrupt = nullptr;
            return p;
        }, "The settings the engine was created with (its defaults filled in where they were left at theirs).");
    def_vocab(engine);

    py::class_<Embedder>(m, "Embedder", "Embeddings in a context of their own, on the engine's model (embedder.h).")
        .def(py::init([](const Engine & engine, int32_t n_ctx, int32_t n_threads, int32_t pooling) {
                 EmbedderParams p;
                 p.n_ctx     = n_ctx;
                 p.n_threads = n_threads;
                 p.pooling   = pooling;
                 p.flash_attn = engine.flash_attn();
                 py::gil_scoped_release release;
                 return new Embedder(engine.model(), p);
             }), py::arg("engine"), py::arg("n_ctx"), py::arg("n_threads") = 0,
             py::arg("pooling") = (int32_t) LLAMA_POOLING_TYPE_UNSPECIFIED, py::keep_alive<1, 2>())
        .def_property_readonly("n_ctx", &Embedder::n_ctx)
        .def_property_readonly("n_embd", &Embedder::n_embd)
        .def_property_readonly("pooling", &Embedder::pooling)
        .def("embed", [](Embedder & e, const std::vector<llama_token> & tokens) {
            std::vector<std::vector<float>> rows;
            {
                py::gil_scoped_release release;
                rows = e.embed(tokens);
            }
            return rows;
        }, py::arg("tokens"), "The input's rows: one if pooled, one per token with pooling none.");
}
