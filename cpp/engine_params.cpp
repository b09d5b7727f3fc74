#include "engine_params.h"

namespace h2o {

const std::vector<EngineSetting> & engine_settings() {
    static const std::vector<EngineSetting> rows = {
        {"position_rolling", "--position-rolling", std::nullopt, "",
         "renumber a bounded cache's kept positions so that a conversation runs past the trained context (on: only "
         "when needed; --no-position-rolling keeps them as fed)", &EngineParams::position_rolling},
        {"roll_interval", "--roll-interval", 0, "tokens",
         "with rolling, renumber positions once they drifted this many tokens (0: only near the trained context)",
         &EngineParams::roll_interval},
        {"n_ctx", "-c --ctx-size", 0, "tokens",
         "the full cache's context, with --budget 0 (0: the model's trained context); a bounded cache needs none: it "
         "holds --budget entries and a conversation runs past any length", &EngineParams::n_ctx},
        {"n_batch", "-b --n-batch --batch-size", 1, "tokens",
         "tokens per decode; the cache holds budget + n-batch cells", &EngineParams::n_batch},
        {"n_ubatch", "-ub --ubatch-size", 0, "tokens",
         "tokens per ubatch, llama.cpp's physical batch (its compute buffers); a prompt is evicted after each whole "
         "batch (0: the batch size)", &EngineParams::n_ubatch},
        {"n_threads_batch", "-tb --threads-batch", 0, "threads",
         "CPU threads for prompts (batches of more than one token; llama.cpp's --threads-batch); 0: as the threads "
         "for generation", &EngineParams::n_threads_batch, 512}, // ggml's GGML_MAX_N_THREADS
        {"n_seq_max", "", 1, "sequences", "sequences in one context, each with its own budget and scores",
         &EngineParams::n_seq_max},
        {"kv_unified", "", std::nullopt, "", "one cell space for all sequences (else a stream each)",
         &EngineParams::kv_unified},
        {"n_gpu_layers", "-ngl --n-gpu-layers --gpu-layers", std::nullopt, "layers",
         "layers offloaded to the GPU or RPC servers (-1: all; 0: none; a CPU build runs all on the CPU)",
         &EngineParams::n_gpu_layers},
        {"kv_f32", "", std::nullopt, "", "F32 instead of F16 K/V cells (exact K shifts, twice the bytes)",
         &EngineParams::kv_f32},
        {"op_offload", "", std::nullopt, "", "large batches' products of CPU-held weights run on the GPU (llama.cpp's)",
         &EngineParams::op_offload},
        {"compact_cells", "", std::nullopt, "", "after a prompt evicted, move the kept cells to the bottom",
         &EngineParams::compact_cells},
        {"export_scores", "", std::nullopt, "", "export scores even when the policy does not use them",
         &EngineParams::export_scores},
        {"verbose", "", std::nullopt, "", "llama.cpp's log on stderr", &EngineParams::verbose},
        {"probe_rides", "", std::nullopt, "", "a prompt's probe decoded with the chunk before the eviction it ranks for",
         &EngineParams::probe_rides},
    };
    return rows;
}

} // namespace h2o
