"""llama.cpp's RPC backend: layers offloaded to an `h2o-local rpc-server` on loopback give the tokens, the kept
entries and the exported scores of the local run."""
import contextlib
import socket
import struct
import subprocess
import threading
import sys
import time

import numpy as np
import pytest

from h2o_local import Llama
from device_tolerance import CPU_BACKEND as CPU

TEXT = "Layers on another machine attend the same way as layers here. " * 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server(tries: int = 5):
    """(process, "host:port") of an RPC server of this build on a free port. The port is chosen here and bound by
    the server: where another process took it in between (test workers starting servers at once), ours exits or
    another answers the handshake there, and it is tried again on another port."""
    from h2o_local.rpc import check_server

    log = ""
    for _ in range(tries):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "h2o_local", "rpc-server", "--port", str(port), "--threads", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                check_server(f"127.0.0.1:{port}", timeout_s=5)
            except OSError:  # not listening yet, or another server there (ConnectionError)
                time.sleep(0.2)
                continue
            if proc.poll() is None:
                return proc, f"127.0.0.1:{port}"
        proc.kill()
        log = proc.communicate()[0].decode(errors="replace")
    pytest.fail(f"the RPC server did not start in {tries} tries: {log}")


@pytest.fixture(scope="module")
def rpc_server():
    proc, endpoint = start_rpc_server()
    yield endpoint
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("policy", ["h2o", "keydiff"])
def test_offloading_layers_over_rpc_changes_nothing(tiny_model, rpc_server, policy):
    # the CPU backend here against the one the RPC server runs there; no batch sent to this machine's GPU, if any
    local = Llama(tiny_model, policy=policy, budget=24, n_batch=32, **CPU)
    remote = Llama(tiny_model, policy=policy, budget=24, n_batch=32, rpc_servers=[rpc_server], n_gpu_layers=1,
                   op_offload=False)
    prompt = local.tokenize(TEXT)
    out_local = local.generate(prompt, max_tokens=16, temperature=0)
    out_remote = remote.generate(prompt, max_tokens=16, temperature=0)
    assert out_remote == out_local
    a, b = local.kv_state(), remote.kv_state()
    assert b.positions.tolist() == a.positions.tolist() and b.n_evicted == a.n_evicted > 0
    np.testing.assert_allclose(b.scores, a.scores, rtol=1e-5, atol=1e-6)


def test_an_unreachable_or_malformed_rpc_server_is_a_clear_error(tiny_model):
    with pytest.raises(ConnectionError, match="cannot reach the RPC server"):
        Llama(tiny_model, policy="h2o", budget=16, rpc_servers=[f"127.0.0.1:{free_port()}"], n_gpu_layers=1)
    with pytest.raises(ValueError, match="not 'host:port'"):
        Llama(tiny_model, policy="h2o", budget=16, rpc_servers=["localhost"], n_gpu_layers=1)
    with pytest.raises(TypeError, match="list of 'host:port'"):
        Llama(tiny_model, policy="h2o", budget=16, rpc_servers="127.0.0.1:50052")


@contextlib.contextmanager
def fake_server(answer):
    """A TCP server on loopback that accepts and sends `answer` then waits (None: says nothing; b"": hangs up)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    conns = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conns.append(conn)
            if answer == b"":
                conn.close()
            elif answer is not None:
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for c in conns:
            c.close()


@pytest.mark.parametrize("answer", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n", b""])
def test_a_port_that_is_not_an_rpc_server_is_a_connection_error_not_an_abort_or_a_hang(tiny_model, answer):
    with fake_server(answer) as endpoint:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=endpoint):
            Llama(tiny_model, policy="h2o", budget=16, rpc_servers=[endpoint], n_gpu_layers=1)
        assert time.monotonic() - t0 < 30
    assert Llama(tiny_model, policy="h2o", budget=16).generate("still here", max_tokens=2, temperature=0) is not None


def test_a_peer_that_answers_the_hello_then_goes_silent_is_a_clear_error_not_a_hang(tiny_model):
    """llama.cpp's client waits for ever on a server that stops answering after its hello (the load hung)."""
    from h2o_local import _engine
    from h2o_local.rpc import CONN_CAPS_SIZE

    major, minor, patch = _engine.RPC_PROTO_VERSION
    hello = struct.pack("<Q", 4 + CONN_CAPS_SIZE) + bytes([major, minor, patch, 0]) + bytes(CONN_CAPS_SIZE)
    with fake_server(hello) as endpoint:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=f"RPC server at {endpoint} stopped answering after its hello"):
            Llama(tiny_model, policy="h2o", budget=16, rpc_servers=[endpoint], n_gpu_layers=1)
        assert time.monotonic() - t0 < 30


def test_the_handshake_accepts_the_real_server(rpc_server):
    from h2o_local.rpc import check_server

    check_server(rpc_server)  # raises if the pinned protocol's hello changed


def test_a_llama_whose_rpc_server_died_is_freed_without_aborting(tiny_model, tmp_path):
    """llama.cpp aborts on any command it cannot send to an RPC server, freeing a buffer included: a Llama whose
    server went away, freed later by the garbage collector (after another Llama was made), killed the process
    (SIGABRT in ggml-rpc.cpp, seen on CUDA after tests/engine/test_rpc.py, then reproduced on the CPU build). In a child
    process, so that an abort cannot take the test run with it."""
    script = tmp_path / "dead_server.py"
    script.write_text(f"""
import gc, socket, subprocess, sys, time
from h2o_local import Llama
port = {free_port()}
server = subprocess.Popen([sys.executable, "-m", "h2o_local", "rpc-server", "--port", str(port), "--threads", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(300):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
    except OSError:
        time.sleep(0.2)
remote = Llama({tiny_model!r}, policy="h2o", budget=24, rpc_servers=[f"127.0.0.1:{{port}}"])
assert "RPC0" in remote.layer_devices, remote.layer_devices  # beside this machine's GPUs, where it has any
remote.generate("before", max_tokens=4, temperature=0)
server.terminate()
server.wait()
local = Llama({tiny_model!r}, policy="h2o", budget=24)
assert not any(d.startswith("RPC") for d in local.layer_devices), local.layer_devices  # only its own devices
del remote
gc.collect()
print("survived:", local.generate("after", max_tokens=4, temperature=0) is not None)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "survived: True" in done.stdout, done.stderr[-2000:]
    assert "no longer answers" in done.stderr
