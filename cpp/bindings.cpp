// pybind11 bindings: h2o_local._engine. The Python package (h2o_local/) is the user API; this is its engine room.
#include "engine.h"

#include "llama-attn-scores.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;
using h2o::Engine;
using h2o::EngineParams;
using h2o::Sampler;

namespace {

template <typename T>
py::array_t<T> to_numpy(const std::vector<T> & v, std::vector<py::ssize_t> shape) {
    py::array_t<T> out(shape);
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
}

py::dict state_dict(const Engine & e, llama_seq_id seq) {
    const auto & st = e.state(seq);
    const auto n = (py::ssize_t) st.positions.size();
    py::dict d;
    d["positions"]   = to_numpy(st.positions, {n});
    d["scores"]      = to_numpy(st.scores, {n});
    d["head_scores"] = to_numpy(st.head_scores, {n, (py::ssize_t) e.n_head()});
    d["next_pos"]    = st.next_pos;
    d["n_seen"]      = st.n_seen;
    d["n_evicted"]   = st.n_evicted;
    d["peak_cells"]  = st.peak_cells;
    return d;
}

} // namespace

PYBIND11_MODULE(_engine, m) {
    m.doc() = "h2o_local engine: a patched llama.cpp context with per-sequence KV eviction";

    py::class_<Engine>(m, "Engine")
        .def(py::init([](const std::string & model_path, const std::string & policy, int32_t budget, int32_t heavy,
                         int32_t recent, int32_t sinks, bool position_rolling, int32_t roll_interval, uint32_t n_ctx, uint32_t n_batch,
                         uint32_t n_seq_max, bool kv_unified, int32_t n_threads, int32_t n_gpu_layers, bool scores_sum_rows,
                         bool capture_softmax, bool export_scores, bool kv_f32, bool verbose) {
                 EngineParams p;
                 p.policy = policy; p.budget = budget; p.heavy = heavy; p.recent = recent; p.sinks = sinks;
                 p.position_rolling = position_rolling; p.roll_interval = roll_interval; p.n_ctx = n_ctx; p.n_batch = n_batch; p.n_seq_max = n_seq_max;
                 p.kv_unified = kv_unified;
                 p.n_threads = n_threads; p.n_gpu_layers = n_gpu_layers; p.scores_sum_rows = scores_sum_rows;
                 p.capture_softmax = capture_softmax; p.export_scores = export_scores; p.kv_f32 = kv_f32; p.verbose = verbose;
                 py::gil_scoped_release release;
                 return new Engine(model_path, p);
             }),
             py::arg("model_path"), py::kw_only(), py::arg("policy") = "h2o", py::arg("budget") = -1,
             py::arg("heavy") = -1, py::arg("recent") = -1, py::arg("sinks") = -1, py::arg("position_rolling") = false,
             py::arg("roll_interval") = 1,
             py::arg("n_ctx") = 0, py::arg("n_batch") = 512, py::arg("n_seq_max") = 1, py::arg("kv_unified") = true, py::arg("n_threads") = 0,
             py::arg("n_gpu_layers") = 0, py::arg("scores_sum_rows") = false, py::arg("capture_softmax") = false, py::arg("export_scores") = false, py::arg("kv_f32") = false,
             py::arg("verbose") = false)
        .def("eval", &Engine::eval, py::arg("tokens"), py::arg("all_logits") = false,
             py::call_guard<py::gil_scoped_release>(),
             "Feed {seq_id: [token, ...]} in one batch, evicting as the policy says.")
        .def("set_policy", &Engine::set_policy, py::arg("policy"), py::arg("budget") = -1, py::arg("heavy") = -1,
             py::arg("recent") = -1, py::arg("sinks") = -1)
        .def("compress", &Engine::compress, py::arg("seq_id") = 0)
        .def("snapshot", &Engine::snapshot, py::arg("seq_id") = 0)
        .def("restore", &Engine::restore, py::arg("seq_id"), py::arg("snapshot"))
        .def("reset", &Engine::reset)
        .def("reset_seq", &Engine::reset_seq, py::arg("seq_id"))
        .def("last_logits", [](const Engine & e, llama_seq_id seq) {
            return to_numpy(e.last_logits(seq), {(py::ssize_t) e.n_vocab()});
        }, py::arg("seq_id") = 0)
        .def("logits_all", [](const Engine & e, llama_seq_id seq) {
            const auto & v = e.logits_all(seq);
            return to_numpy(v, {(py::ssize_t) (v.size()/e.n_vocab()), (py::ssize_t) e.n_vocab()});
        }, py::arg("seq_id") = 0)
        .def("last_scores", [](const Engine & e, llama_seq_id seq) {
            const llama_pos * pos = nullptr;
            const float * sc = nullptr;
            const int32_t n = llama_attn_scores_get(e.ctx(), seq, &pos, &sc);
            py::array_t<int32_t> p(n);
            py::array_t<float> s({(py::ssize_t) n, (py::ssize_t) e.n_head()});
            if (n > 0) {
                std::copy(pos, pos + n, p.mutable_data());
                std::copy(sc, sc + (size_t) n*e.n_head(), s.mutable_data());
            }
            return py::make_tuple(p, s);
        }, py::arg("seq_id") = 0, "The raw scores the patch exported for seq_id in the last llama_decode: (positions, [n, n_head]).")
        .def("state", &state_dict, py::arg("seq_id") = 0)
        .def("seq_pos_range", [](const Engine & e, llama_seq_id seq) {
            llama_memory_t mem = llama_get_memory(e.ctx());
            return py::make_tuple(llama_memory_seq_pos_min(mem, seq), llama_memory_seq_pos_max(mem, seq));
        }, py::arg("seq_id") = 0, "llama.cpp's own (min, max) position of seq_id; (-1, -1) when empty")
        .def("oracle_cell_scores", [](const Engine & e) {
            const auto & v = e.oracle_cell_scores();
            return to_numpy(v, {(py::ssize_t) (v.size()/std::max(e.n_head(), 1)), (py::ssize_t) e.n_head()});
        })
        .def("clear_oracle", &Engine::clear_oracle)
        .def("tokenize", &Engine::tokenize, py::arg("text"), py::arg("add_special"), py::arg("parse_special"))
        .def("token_to_piece", [](const Engine & e, llama_token t, bool special) {
            return py::bytes(e.token_to_piece(t, special));
        }, py::arg("token"), py::arg("special") = false)
        .def("detokenize", [](const Engine & e, const std::vector<llama_token> & toks, bool special) {
            return py::bytes(e.detokenize(toks, special));
        }, py::arg("tokens"), py::arg("special") = false)
        .def("apply_chat_template", &Engine::apply_chat_template, py::arg("messages"), py::arg("add_assistant") = true)
        .def("is_eog", [](const Engine & e, llama_token t) { return llama_vocab_is_eog(llama_model_get_vocab(e.model()), t); })
        .def_property_readonly("token_bos", [](const Engine & e) { return llama_vocab_bos(llama_model_get_vocab(e.model())); })
        .def_property_readonly("token_eos", [](const Engine & e) { return llama_vocab_eos(llama_model_get_vocab(e.model())); })
        .def_property_readonly("add_bos", [](const Engine & e) { return llama_vocab_get_add_bos(llama_model_get_vocab(e.model())); })
        .def_property_readonly("n_ctx", &Engine::n_ctx)
        .def_property_readonly("capacity", &Engine::capacity)
        .def_property_readonly("n_vocab", &Engine::n_vocab)
        .def_property_readonly("n_head", &Engine::n_head)
        .def_property_readonly("n_head_kv", [](const Engine & e) { return llama_model_n_head_kv(e.model()); })
        .def_property_readonly("n_layer", [](const Engine & e) { return llama_model_n_layer(e.model()); })
        .def_property_readonly("n_ctx_train", &Engine::n_ctx_train)
        .def_property_readonly("n_batch", [](const Engine & e) { return llama_n_batch(e.ctx()); })
        .def_property_readonly("kv_bytes", &Engine::kv_bytes)
        .def_property_readonly("model_bytes", [](const Engine & e) { return llama_model_size(e.model()); })
        .def_property_readonly("cells_used", &Engine::cells_used)
        .def_property_readonly("scores_sum_rows", &Engine::scores_sum_rows)
        .def_property_readonly("policy", [](const Engine & e) { return e.policy().name(); })
        .def_property_readonly("split", [](const Engine & e) {
            const auto s = e.policy().split();
            return py::make_tuple(s.sinks, s.heavy, s.recent);
        }, "(sinks, heavy, recent) entries kept per sequence");

    py::class_<h2o::SeqSnapshot, std::shared_ptr<h2o::SeqSnapshot>>(m, "SeqSnapshot")
        .def_property_readonly("nbytes", [](const h2o::SeqSnapshot & s) { return s.kv.size(); })
        .def_property_readonly("n_cells", [](const h2o::SeqSnapshot & s) { return s.state.positions.size(); });

    py::class_<Sampler>(m, "Sampler")
        .def(py::init<float, float, int32_t, float, uint32_t>(), py::arg("temperature"), py::arg("top_p"),
             py::arg("top_k"), py::arg("min_p"), py::arg("seed"))
        .def("sample", [](Sampler & s, py::array_t<float, py::array::c_style | py::array::forcecast> logits) {
            return s.sample(logits.data(), (int32_t) logits.size());
        }, py::arg("logits"));
}
