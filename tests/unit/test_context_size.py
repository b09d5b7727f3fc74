"""How big a context is made (cpp/context_size.cpp): its KV cells, batch and logits rows, and the refusal of one the
machine cannot hold, each rule checked alone on plain numbers."""
import pytest

from h2o_local import _engine
from h2o_local.policies import resolve


def size(policy, n_ctx_train=4096, n_probe=0, n_ride=0, **settings):
    params = _engine.EngineParams()
    for name, value in settings.items():
        setattr(params, name, value)
    return _engine.context_size(params, resolve(policy).cpp, n_ctx_train, n_probe, n_ride)


def test_the_full_cache_gets_the_trained_context_per_stream():
    assert size("full", n_batch=512)["n_ctx"] == 4096
    assert size("full", n_seq_max=3, kv_unified=False)["n_ctx"] == 3 * 4096


def test_a_bounded_cache_gets_the_budgets_one_batch_and_one_probe_per_stream():
    assert size("h2o-64", n_batch=32)["n_ctx"] == 64 + 32
    assert size("h2o-64", n_batch=32, n_probe=8)["n_ctx"] == 64 + 32 + 8
    assert size("h2o-64", n_batch=32, n_probe=8, n_seq_max=4)["n_ctx"] == 4 * 64 + 32 + 8  # one shared cell space
    assert size("h2o-64", n_batch=32, n_probe=8, n_seq_max=4, kv_unified=False)["n_ctx"] == 4 * (64 + 32 + 8)


def test_the_batch_fits_the_context_and_a_step_of_every_sequence_fits_the_outputs():
    s = size("full", n_ctx=100, n_batch=512)
    assert (s["n_ctx"], s["n_batch"], s["n_outputs_max"]) == (100, 100, 100)
    assert size("h2o-8", n_batch=4, n_seq_max=16)["n_outputs_max"] == 16


def test_a_ubatch_is_the_batch_unless_asked_smaller_and_never_larger():
    assert size("h2o-64", n_batch=32)["n_ubatch"] == 32
    assert size("h2o-64", n_batch=32, n_ubatch=8)["n_ubatch"] == 8
    assert size("h2o-64", n_batch=32, n_ubatch=1000)["n_ubatch"] == 32  # llama.cpp's min(n_batch, n_ubatch)
    assert size("full", n_ctx=100, n_batch=512, n_ubatch=256)["n_ubatch"] == 100  # the batch, cut to the context
    assert size("h2o-64", n_batch=2048, n_ubatch=512)["n_ctx"] == 64 + 2048  # the cells follow the batch


def test_an_n_ctx_without_room_beside_the_budgets_is_refused():
    with pytest.raises(ValueError, match="leaves no room beside the budget"):
        size("h2o-64", n_ctx=64)
    with pytest.raises(ValueError, match=r"\(128 entries per stream\)"):
        size("h2o-64", n_ctx=128, n_seq_max=2, kv_unified=True)


def test_a_context_the_machine_cannot_hold_is_refused_before_it_is_made():
    gib = 2**30
    _engine.check_host_memory(1000, 512, 2**20, 32000, True, 16 * gib)  # 1 GiB of cells + 62 MiB of logits
    with pytest.raises(ValueError, match="more than this machine's 1 GiB"):
        _engine.check_host_memory(1000, 512, 2**20, 32000, True, gib)
    _engine.check_host_memory(1000, 512, 2**20, 32000, False, gib)  # the cells are on a device: only the logits count
    _engine.check_host_memory(10**9, 10**6, 2**20, 32000, True, 0)  # memory unknown: nothing refused


def test_a_cache_its_devices_cannot_hold_is_refused_before_llama_cpp_allocates_it():
    """On a GPU the KV cells of the offloaded layers are checked against the devices' memory (llama.cpp's failed
    allocation there was a RuntimeError without the reason, seen on CUDA)."""
    gib = 2**30
    _engine.check_device_memory(1000, 2**20, "CUDA0", 2 * gib)  # 1000 MiB of cells
    with pytest.raises(ValueError, match=r"on CUDA0, more than this machine's CUDA0 hold \(1 GiB\)"):
        _engine.check_device_memory(2000, 2**20, "CUDA0", gib)
    _engine.check_device_memory(10**9, 2**20, "RPC0", 0)  # memory unknown: nothing refused


def test_llama_cpp_s_batch_has_room_for_a_probe_that_rides_with_a_chunk():
    """A question probe decoded in its chunk's llama_decode (probe_rides): llama.cpp's batch and ubatch grow by it,
    the chunks a prompt is read in (n_batch, n_ubatch) do not; a probe never rides with a full cache, and in a context
    asked smaller the batch grows by what fits in its n_ctx."""
    question = resolve("tova", 256, probe="question")
    got = size(question, n_probe=32, n_ride=32, n_batch=512)
    assert (got["n_batch"], got["n_ubatch"], got["n_probe_ride"]) == (512, 512, 32) and got["n_ctx"] == 256 + 512 + 32
    assert size("full", n_ride=32, n_batch=512)["n_probe_ride"] == 0
    assert size(question, n_probe=32, n_ride=32, n_batch=512, n_ctx=512 + 8)["n_probe_ride"] == 8
