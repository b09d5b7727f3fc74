// The K and V cache types of a context: chosen from the settings, and refused where llama.cpp cannot work with them
// on the model (and the device) at hand. A function of plain facts, so that it can be tested without a model.
#pragma once

#include "engine.h"

#include "ggml.h"

#include <cstdint>
#include <string>

namespace h2o {

struct KvTypeFacts {
    int32_t     key_head = 0;             // elements per key head (GGUF's attention.key_length)
    std::string offloaded_to;             // the first device other than the CPU that holds a layer; empty: none
    bool        rotation_disabled = false; // LLAMA_ATTN_ROT_DISABLE: llama.cpp's Hadamard rotation of quantized K/V off
};

struct KvTypes {
    ggml_type k = GGML_TYPE_F16;
    ggml_type v = GGML_TYPE_F16;
};

// a KV cache type by its ggml name, one of those llama.cpp takes (its --cache-type-k list); `what` names the setting
ggml_type kv_cache_type(const char * what, const std::string & name);

// params.kv_f32, type_k, type_v, flash_attn, position_rolling and host_q8_0; throws std::invalid_argument with the reason
KvTypes choose_kv_types(const EngineParams & params, const KvTypeFacts & facts);

} // namespace h2o
