#include "kv_types.h"

#include <stdexcept>

namespace h2o {

ggml_type kv_cache_type(const char * what, const std::string & name) {
    static const ggml_type types[] = {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                      GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1};
    std::string names;
    for (const ggml_type t : types) {
        if (name == ggml_type_name(t)) {
            return t;
        }
        names += std::string(names.empty() ? "" : ", ") + ggml_type_name(t);
    }
    throw std::invalid_argument(std::string(what) + " must be one of " + names + ", got '" + name + "'");
}

double kv_type_bytes(const std::string & name) {
    const ggml_type t = kv_cache_type("a KV cache type", name);
    return (double) ggml_type_size(t)/ggml_blck_size(t);
}

static void check_rolling_keys(const std::string & name, ggml_type k, const KvTypeFacts & facts) {
    if (ggml_is_quantized(k)) {
        // llama.cpp shifts quantized keys through its Hadamard-rotated path only (heads of a multiple of 64 values,
        // rotation not disabled); the other path crashes inside the K shift
        if (facts.key_head % 64 != 0 || facts.rotation_disabled) {
            throw std::invalid_argument("position_rolling with type_k '" + name + "' needs key heads of a "
                                        "multiple of 64 values and LLAMA_ATTN_ROT_DISABLE unset (llama.cpp cannot "
                                        "shift other quantized keys); this model's hold " + std::to_string(facts.key_head));
        }
        // that path, with the keys on a device, wrote out of bounds on Vulkan (lavapipe: heap corruption, aborts);
        // untested on CUDA and Metal: refused on every device until it is shown to work there
        if (!facts.offloaded_to.empty()) {
            throw std::invalid_argument("position_rolling with type_k '" + name + "' is not supported with layers on " +
                                        facts.offloaded_to + ": llama.cpp's shift of quantized keys is known to "
                                        "corrupt memory there (use type_k f16, or n_gpu_layers=0)");
        }
    } else if (k != GGML_TYPE_F16 && k != GGML_TYPE_F32) {
        // unquantized keys are shifted by ggml_rope in place, which takes F32 and F16 only (bf16 aborts)
        throw std::invalid_argument("position_rolling with type_k '" + name + "' is not possible: llama.cpp rotates "
                                    "unquantized keys in place with ggml_rope, which takes f16 and f32 only (use f16, "
                                    "f32 or q8_0)");
    }
}

bool keys_can_roll(const EngineParams & params, const KvTypeFacts & facts) {
    if (params.type_k.empty()) {
        return true;
    }
    try {
        check_rolling_keys(params.type_k, kv_cache_type("type_k", params.type_k), facts);
        return true;
    } catch (const std::invalid_argument &) {
        return false;
    }
}

KvTypes choose_kv_types(const EngineParams & params, const KvTypeFacts & facts) {
    KvTypes out;
    if (params.kv_f32) {
        out.k = out.v = GGML_TYPE_F32;
    }
    if (!params.type_k.empty()) {
        out.k = kv_cache_type("type_k", params.type_k);
        // the K shift and the per-head views cut keys per head: a head must hold whole quantization blocks
        if (facts.key_head % ggml_blck_size(out.k) != 0) {
            throw std::invalid_argument("type_k '" + params.type_k + "' stores blocks of " +
                                        std::to_string(ggml_blck_size(out.k)) + " values; this model's key heads "
                                        "hold " + std::to_string(facts.key_head) + " (use f16, f32 or bf16)");
        }
        if (params.position_rolling && params.roll_interval > 0) { // rolling when needed leaves keys that cannot roll
            check_rolling_keys(params.type_k, out.k, facts);
        }
    }
    if (!params.type_v.empty()) {
        out.v = kv_cache_type("type_v", params.type_v);
        if (ggml_is_quantized(out.v) && params.flash_attn == FLASH_ATTN_OFF) {
            throw std::invalid_argument("a quantized type_v needs flash attention, and flash_attn=False was asked for "
                                        "(llama.cpp keeps V unquantized without it)");
        }
        if (facts.key_head % ggml_blck_size(out.v) != 0) {
            throw std::invalid_argument("type_v '" + params.type_v + "' stores blocks of " +
                                        std::to_string(ggml_blck_size(out.v)) + " values; this model's heads "
                                        "hold " + std::to_string(facts.key_head));
        }
    }
    if (params.host_q8_0 && (out.k != GGML_TYPE_F16 || out.v != GGML_TYPE_F16)) {
        throw std::invalid_argument(std::string("recall_type 'q8_0' quantizes F16 rows; this cache keeps ") +
                                    ggml_type_name(out.k) + "/" + ggml_type_name(out.v) + " (recall_type None keeps "
                                    "its own rows)");
    }
    return out;
}

llama_flash_attn_type flash_attn_type(const EngineParams & params, const KvTypeFacts & facts) {
    if (params.flash_attn == FLASH_ATTN_ON) {
        return LLAMA_FLASH_ATTN_TYPE_ENABLED;
    }
    if (params.flash_attn == FLASH_ATTN_OFF) {
        return LLAMA_FLASH_ATTN_TYPE_DISABLED;
    }
    if (params.flash_attn != FLASH_ATTN_AUTO) {
        throw std::invalid_argument("flash_attn must be -1 (auto), 0 (off) or 1 (on), got " +
                                    std::to_string(params.flash_attn));
    }
    if (!params.type_v.empty() && ggml_is_quantized(kv_cache_type("type_v", params.type_v))) {
        return LLAMA_FLASH_ATTN_TYPE_ENABLED;
    }
    // a GPU: CUDA, Metal (ggml's "MTL") and Vulkan, but not a Vulkan device that is the CPU itself (Mesa's lavapipe:
    // off as on the CPU, and its flash-attention shader crashed Mesa 22.3, not 25: docs/gpu.md); the other backends
    // (RPC, ...) are untested here
    const std::string & dev = facts.offloaded_to;
    const bool gpu = dev.rfind("CUDA", 0) == 0 || dev.rfind("MTL", 0) == 0 || dev.rfind("Vulkan", 0) == 0;
    return gpu && !facts.software_device ? LLAMA_FLASH_ATTN_TYPE_AUTO : LLAMA_FLASH_ATTN_TYPE_DISABLED;
}

} // namespace h2o
