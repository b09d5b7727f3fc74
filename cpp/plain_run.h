#pragma once
// llama.cpp's own API in this build, with nothing of h2o_local around it: no Engine, no score export, no policy, no
// eviction. benchmarks/bench.py times it beside ours (its "llama.cpp" settings) to say which part of a step is
// llama.cpp's own cost and which is ours, on machines where the peer (llama-cpp-python, unpatched) was not built.
// The patch's mechanisms stay dormant unless asked, so this is llama.cpp's own decode on the same kernels.
//
// Contract: the first warmup_tokens of the prompt are read and one step decoded, then the cache is cleared (a device
// loads its kernels on first use: llama-bench warms up the same way); then the prompt is read in chunks of n_batch
// tokens into a context of prompt + n_decode + 16 cells, and n_decode greedy steps run (the first token chosen from
// the prompt's logits), each timed from llama_decode to its logits on the host (seconds).

#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

namespace h2o {

struct PlainRunParams {
    std::string model;          // GGUF path
    int32_t n_gpu_layers = 0;   // llama.cpp's: -1 all
    bool flash_attn      = false;
    uint32_t n_batch     = 512; // tokens per llama_decode of the prompt (n_ubatch the same)
    int32_t n_threads    = 0;   // 0: llama.cpp's default
    int32_t warmup_tokens = 0;  // read before the timed run, then cleared (0: a cold run)
};

struct PlainRunTimes {
    double prefill_s = 0.0;
    std::vector<double> step_s;   // one per decode step
    std::vector<llama_token> tokens; // the greedy tokens decoded, in order
    uint64_t model_bytes = 0;
    uint32_t n_ctx       = 0;     // KV cells allocated
};

PlainRunTimes plain_run(const PlainRunParams & params, const std::vector<llama_token> & prompt, int32_t n_decode);

} // namespace h2o
