// The K and V cache types of a context: chosen from the settings, and refused where llama.cpp cannot work with them
// on the model (and the device) at hand. A function of plain facts, so that it can be tested without a model.
#pragma once

#include "engine_params.h"

#include "ggml.h"
#include "llama.h"

#include <cstdint>
#include <string>

namespace h2o {

struct KvTypeFacts {
    int32_t     key_head = 0;             // elements per key head (GGUF's attention.key_length)
    std::string offloaded_to;             // the first device other than the CPU that holds a layer; empty: none
    bool        software_device = false;  // offloaded_to runs on the CPU itself (Mesa's lavapipe, "llvmpipe")
    bool        rotation_disabled = false; // LLAMA_ATTN_ROT_DISABLE: llama.cpp's Hadamard rotation of quantized K/V off
};

enum : int32_t { FLASH_ATTN_AUTO = -1, FLASH_ATTN_OFF = 0, FLASH_ATTN_ON = 1 }; // EngineParams::flash_attn

struct KvTypes {
    ggml_type k = GGML_TYPE_F16;
    ggml_type v = GGML_TYPE_F16;
};

// a KV cache type by its ggml name, one of those llama.cpp takes (its --cache-type-k list); `what` names the setting
ggml_type kv_cache_type(const char * what, const std::string & name);

// bytes per element of a KV cache type by ggml name ("f16", "q8_0", ...): the type's block bytes over its values
double kv_type_bytes(const std::string & name);

// whether llama.cpp can shift keys of params.type_k on this model and device (position rolling)
bool keys_can_roll(const EngineParams & params, const KvTypeFacts & facts);

// params.kv_f32, type_k, type_v, flash_attn, position_rolling and host_q8_0; throws std::invalid_argument with the reason
KvTypes choose_kv_types(const EngineParams & params, const KvTypeFacts & facts);

// What a context asks llama.cpp for: params.flash_attn as given, and FLASH_ATTN_AUTO resolved as llama.cpp's own
// `-fa auto` where the layers run on a CUDA or Metal GPU (on where the device supports it), on for a quantized V
// cache (which needs it), and off on the CPU, where the kernel gains nothing for these models and the scoring
// policies pay a pass beside it (docs/performance-log.md, runs 9 and 14), and on other devices (Vulkan, RPC: see
// flash_attn_type in kv_types.cpp).
llama_flash_attn_type flash_attn_type(const EngineParams & params, const KvTypeFacts & facts);

} // namespace h2o
