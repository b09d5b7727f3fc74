"""The K and V cache types a context gets, whether it asks for flash attention, and what is refused before any model
is loaded (cpp/kv_types.cpp): a function of the settings, the model's key head size and where its layers are, so
each rule is checked here alone."""
import pytest

from h2o_local import _engine


def engine_params(**settings):
    params = _engine.EngineParams()
    for name, value in settings.items():
        setattr(params, name, value)
    return params


def types(key_head=64, offloaded_to="", rotation_disabled=False, **settings):
    return _engine.choose_kv_types(engine_params(**settings), key_head, offloaded_to, rotation_disabled)


def test_f16_unless_asked_and_f32_with_kv_f32():
    assert types() == ("f16", "f16")
    assert types(kv_f32=True) == ("f32", "f32")
    assert types(type_k="q8_0") == ("q8_0", "f16")
    assert types(type_k="q4_0", type_v="q8_0", flash_attn=True) == ("q4_0", "q8_0")


def test_an_unknown_type_names_the_ones_llama_cpp_takes():
    with pytest.raises(ValueError, match="type_k must be one of f32, f16, bf16, q8_0"):
        types(type_k="q3_k")


def test_a_quantized_v_needs_flash_attention():
    with pytest.raises(ValueError, match="needs flash attention, and flash_attn=False was asked for"):
        types(type_v="q8_0", flash_attn=0)
    assert types(type_v="q8_0") == ("f16", "q8_0")  # auto: flash_attn_type turns it on


def flash(offloaded_to="", software_device=False, **settings):
    return _engine.flash_attn_type(engine_params(**settings), offloaded_to, software_device)


def test_flash_attention_is_auto_on_a_gpu_and_off_on_the_cpu_unless_asked():
    assert flash() == "disabled"  # the default, on the CPU: the kernel gains nothing there
    for device in ("CUDA0", "CUDA1", "MTL0", "Vulkan0"):
        assert flash(device) == "auto"  # llama.cpp's own rule decides there: on where the device supports it
        assert flash(device, n_seq_max=4, kv_unified=False) == "auto"  # a stream per sequence (the server's slots)
    # a Vulkan device that is the CPU itself (Mesa's lavapipe) is the CPU here; RPC is untested
    for device, settings in (("Vulkan0", {"software_device": True}), ("RPC0", {})):
        assert flash(device, **settings) == "disabled" and flash(device, flash_attn=1, **settings) == "enabled"
    assert flash(type_v="q8_0") == flash("CUDA0", type_v="q4_0") == "enabled"  # a quantized V needs it
    assert flash(type_v="f16") == "disabled"
    for where in ("", "CUDA0"):
        assert flash(where, flash_attn=1) == "enabled" and flash(where, flash_attn=0) == "disabled"
    with pytest.raises(ValueError, match="flash_attn must be -1"):
        flash(flash_attn=2)


def test_a_head_must_hold_whole_quantization_blocks():
    with pytest.raises(ValueError, match="blocks of 32 values; this model's key heads hold 16"):
        types(key_head=16, type_k="q8_0")
    with pytest.raises(ValueError, match="blocks of 32 values; this model's heads hold 48"):
        types(key_head=48, type_v="q4_0", flash_attn=True)


def test_rolling_quantized_keys_needs_the_rotated_shift_on_the_cpu():
    assert types(type_k="q8_0", position_rolling=True, roll_interval=1) == ("q8_0", "f16")
    with pytest.raises(ValueError, match="multiple of 64 values"):
        types(key_head=96, type_k="q8_0", position_rolling=True, roll_interval=1)
    with pytest.raises(ValueError, match="LLAMA_ATTN_ROT_DISABLE"):
        types(type_k="q8_0", position_rolling=True, roll_interval=1, rotation_disabled=True)


@pytest.mark.parametrize("device", ["Vulkan0", "CUDA0", "Metal"])
def test_rolling_quantized_keys_on_a_device_is_refused(device):
    """Seen to corrupt memory on Vulkan (docs/gpu.md); F16 keys roll on a device."""
    with pytest.raises(ValueError, match=f"not supported with layers on {device}"):
        types(type_k="q4_0", position_rolling=True, roll_interval=1, offloaded_to=device)
    assert types(position_rolling=True, roll_interval=1, offloaded_to=device) == ("f16", "f16")


def test_rolling_bf16_keys_is_refused_instead_of_aborting_in_ggml_rope():
    with pytest.raises(ValueError, match="f16 and f32 only"):
        types(type_k="bf16", position_rolling=True, roll_interval=1)
    assert types(type_k="bf16") == ("bf16", "f16")


def test_a_q8_0_host_copy_of_recalled_entries_needs_f16_rows():
    assert types(host_q8_0=True) == ("f16", "f16")
    assert types(host_q8_0=True, type_k="f16") == ("f16", "f16")
    for settings in ({"kv_f32": True}, {"type_k": "q8_0"}, {"type_k": "bf16"},
                     {"type_v": "q4_0", "flash_attn": True}):
        with pytest.raises(ValueError, match="recall_type 'q8_0' quantizes F16 rows; this cache keeps"):
            types(host_q8_0=True, **settings)
