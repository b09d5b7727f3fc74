"""A stateful randomized test: long random sequences of eval / generate / evict / roll / reset / save / load /
set_policy over two sequences, checked after every step against a small Python model of what the cache must hold.

CI runs a small number of examples; a large run:
    H2O_LOCAL_FUZZ_EXAMPLES=2000 H2O_LOCAL_FUZZ_STEPS=80 pytest tests/api/test_state_machine.py
"""
import pytest

import hypothesis
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant, rule,  # noqa: E402
                                 run_state_machine_as_test)

from h2o_local import H2O, Llama, Local, Sink  # noqa: E402
from engine_view import position_range
from device_tolerance import CPU_BACKEND, approximate, assert_logits_close
from fuzz_settings import EXAMPLES, PHASES, STEPS

BUDGET, N_BATCH, N_SEQ = 12, 8, 2
PROBE = 70  # the token fed to compare a snapshot's continuation with the original's

seqs = st.integers(0, N_SEQ - 1)
token_lists = st.lists(st.integers(3, 258), min_size=1, max_size=20)


class CacheMachine(RuleBasedStateMachine):
    rolling = False
    snapshots = Bundle("snapshots")

    @initialize()
    def create(self):
        self.llm = Llama(self.model_path, policy="h2o", budget=BUDGET, n_batch=N_BATCH, n_seq_max=N_SEQ,
                         position_rolling=self.rolling, roll_interval=3 if self.rolling else 1)
        self.budget = BUDGET
        self.seen = [0] * N_SEQ    # tokens fed since the last reset
        self.cells = [0] * N_SEQ   # entries the cache must hold
        self.pending = 0           # seq 0: a token shown by generate and not fed yet

    # ------------------------------------------------------------------ rules
    @rule(seq=seqs, tokens=token_lists)
    def eval(self, seq, tokens):
        self.llm.eval(tokens, seq_id=seq)
        self._fed(seq, len(tokens))
        if seq == 0:
            self.pending = 0  # the shown token belongs to seq 0: a call on another sequence keeps it

    @rule(prompt=st.lists(st.integers(3, 258), max_size=6), max_tokens=st.integers(0, 6))
    def generate_on(self, prompt, max_tokens):
        if not prompt and self.seen[0] + self.pending == 0:
            return  # nothing to continue from
        shown = 0
        reason = None
        for e in self.llm.generate_events(prompt, reset=False, max_tokens=max_tokens, temperature=0):
            if e.token is None:
                reason = e.finish_reason
            else:
                shown += 1
        # each shown token is fed before the next is drawn; after "length" the last one waits for the next call
        # (an end-of-generation token is drawn after the last shown one was fed, and is itself not fed)
        last_pending = 1 if shown and reason == "length" else 0
        self._fed(0, self.pending + len(prompt) + shown - last_pending)
        self.pending = last_pending
        assert shown <= max_tokens

    @rule(seq=st.one_of(st.none(), seqs))
    def reset(self, seq):
        self.llm.reset(seq)
        for s in range(N_SEQ) if seq is None else [seq]:
            self.seen[s] = self.cells[s] = 0
        if seq in (None, 0):
            self.pending = 0

    @rule(target=snapshots, seq=seqs)
    def save(self, seq):
        # a snapshot of seq 0 carries the token generate showed but did not feed
        pending = self.pending if seq == 0 else 0
        state = self.llm.save_state(seq)
        probe = None
        if self.cells[seq] and not pending:
            # what the original computes next; put back from the snapshot afterwards (a load must compute the same)
            self.llm.eval([PROBE], seq_id=seq)
            probe = self.llm.last_logits(seq).copy()
            self.llm.load_state(state, seq_id=seq)
        return state, self.llm.kv_state(seq).positions.tolist(), self.seen[seq], self.cells[seq], pending, probe

    @rule(snap=snapshots, seq=seqs)
    def load(self, snap, seq):
        state, positions, seen, cells, pending, probe = snap
        self.llm.load_state(state, seq_id=seq)
        assert self.llm.kv_state(seq).positions.tolist() == positions
        if probe is not None:
            self.llm.eval([PROBE], seq_id=seq)
            # cells may sit elsewhere than in the original: float summation order only (a lost K shift: several units);
            # a flash kernel multiplies in F16, so its other order is compared at a device's tolerance (5.03e-3 seen)
            assert_logits_close(self.llm.last_logits(seq), probe, device=approximate(self.llm), cpu_atol=5e-3)
            self.llm.load_state(state, seq_id=seq)
        self.seen[seq], self.cells[seq] = seen, cells
        if seq == 0:
            self.pending = pending

    @rule(kind=st.sampled_from(["h2o", "local", "sink"]), budget=st.integers(4, BUDGET), seq=seqs)
    def switch_policy_and_compress(self, kind, budget, seq):
        policy = {"h2o": H2O(budget=budget), "local": Local(budget=budget), "sink": Sink(budget=budget)}[kind]
        self.llm.set_policy(policy)
        self.budget = budget
        self.llm.compress(seq)
        self.cells[seq] = min(self.cells[seq], budget)
        if seq == 0:
            self.pending = 0

    # ------------------------------------------------------------------ the model
    def _fed(self, seq, n):
        if n == 0:
            return  # no forward pass, no eviction (a sequence may hold more than a budget lowered since)
        self.seen[seq] += n
        self.cells[seq] = min(self.cells[seq] + n, self.budget)

    @invariant()
    def cache_matches_the_model(self):
        if not hasattr(self, "llm"):
            return
        for s in range(N_SEQ):
            st_ = self.llm.kv_state(s)
            pos = st_.positions.tolist()
            assert st_.n_cells == self.cells[s], (s, st_.n_cells, self.cells[s])
            assert st_.n_seen == self.seen[s]
            assert st_.n_seen - st_.n_evicted == st_.n_cells
            assert pos == sorted(set(pos))
            assert position_range(self.llm, s) == ((min(pos), max(pos)) if pos else (-1, -1))
            if pos and not self.rolling:
                assert pos[-1] == st_.n_seen - 1  # the newest token is always kept, at its own position
            if self.rolling:
                assert not pos or pos[-1] < BUDGET + 3 + N_BATCH  # drift bounded by the roll interval


class RollingCacheMachine(CacheMachine):
    rolling = True


def _run(machine, model_path):
    machine.model_path = model_path
    run_state_machine_as_test(machine, settings=settings(max_examples=EXAMPLES, stateful_step_count=STEPS,
                                                         deadline=None, database=None, phases=PHASES,
                                                         suppress_health_check=list(hypothesis.HealthCheck)))


def test_random_sessions_keep_the_cache_consistent(tiny_model):
    _run(CacheMachine, tiny_model)


def test_random_sessions_with_position_rolling(tiny_model):
    _run(RollingCacheMachine, tiny_model)


# --- the server's saved sessions: whatever clients send through either endpoint, every answer is a fresh request's --

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
words = st.lists(st.sampled_from(["sea", "light", "keeper", "the", "a", "wrote", "?", "!", "é", "\n", "42"]),
                 min_size=1, max_size=6).map(" ".join)


def chatml_text(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


class SessionStoreMachine(RuleBasedStateMachine):
    """Two servers on the same model with a budget that never evicts: one saves and continues sessions, the other
    none. Clients start, continue and edit chats, and send completions that plant a chat's text (cut anywhere) or
    token ids; every answer must be the one the server without sessions gives. On the CPU backend without flash
    attention, whose results do not depend on how a prefix was cut into batches (a GPU's products and the CPU's flash
    kernel round differently by batch, so that a near tie forks a greedy answer there)."""

    @initialize()
    def start(self):
        self.chats = []

    def _both(self, path, body):
        a, b = (self.post(port, path, body) for port in self.ports)
        assert a[0] == b[0], (body, a, b)
        if a[0] == 200:
            assert a[1]["choices"] == b[1]["choices"], (body, a, b)
            assert a[1]["usage"]["prompt_tokens"] == b[1]["usage"]["prompt_tokens"]
        return a

    def _chat(self, messages, max_tokens):
        status, out = self._both("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                           "temperature": 0})
        if status == 200:
            self.chats.append(messages + [out["choices"][0]["message"]])

    @rule(system=st.booleans(), text=words, max_tokens=st.integers(1, 8))
    def new_chat(self, system, text, max_tokens):
        self._chat(([{"role": "system", "content": "You are tiny."}] if system else [])
                   + [{"role": "user", "content": text}], max_tokens)

    @rule(data=st.data(), text=words, max_tokens=st.integers(1, 8))
    def continue_chat(self, data, text, max_tokens):
        if self.chats:
            chat = data.draw(st.sampled_from(self.chats))
            if len(chat) < 8:
                self._chat(chat + [{"role": "user", "content": text}], max_tokens)

    @rule(data=st.data(), text=words)
    def edit_chat(self, data, text):
        users = [(c, i) for c in self.chats for i, m in enumerate(c) if m["role"] == "user"]
        if users:
            chat, i = data.draw(st.sampled_from(users))
            self._chat(chat[:i] + [{"role": "user", "content": text}], 4)

    @rule(data=st.data(), cut=st.integers(0, 5), max_tokens=st.integers(0, 3))
    def plant_a_chat_as_a_completion(self, data, cut, max_tokens):
        if self.chats:
            chat = data.draw(st.sampled_from(self.chats))
            text = chatml_text(chat)
            self._both("/v1/completions", {"prompt": text[:len(text) - cut] or "x", "max_tokens": max_tokens,
                                            "temperature": 0})

    @rule(ids=st.lists(st.integers(3, 258), min_size=1, max_size=12), max_tokens=st.integers(0, 4))
    def completion_of_token_ids(self, ids, max_tokens):
        self._both("/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "temperature": 0})


def test_random_clients_cannot_change_what_a_conversation_continues(tmp_path):
    import httpx

    from h2o_local.server import create_app, serve_in_background
    from tiny_model import write_tiny_llama

    model = str(write_tiny_llama(tmp_path / "chat.gguf", chat_template=CHATML, n_ctx_train=4096))

    def app(session_mib):
        llm = Llama(model, policy="h2o", budget=2000, n_seq_max=2, kv_unified=False, keep="system", n_threads=1,
                    flash_attn=False, **CPU_BACKEND)
        return create_app(llm, model_id="tiny", session_mib=session_mib)

    with serve_in_background(app(64)) as with_sessions, serve_in_background(app(0)) as without, \
            httpx.Client(timeout=60) as client:
        SessionStoreMachine.ports = (with_sessions, without)
        SessionStoreMachine.post = staticmethod(
            lambda port, path, body: (lambda r: (r.status_code, r.json()))(
                client.post(f"http://127.0.0.1:{port}{path}", json=body)))
        run_state_machine_as_test(SessionStoreMachine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS // 2, deadline=None, database=None, phases=PHASES,
            suppress_health_check=list(hypothesis.HealthCheck)))
        # the store is used, not only filled: a chat continued with its own answer continues a saved session
        # (random runs of the CI's size do not always do that)
        machine = SessionStoreMachine()
        machine.start()
        machine.new_chat(True, "sea light", 4)
        last = machine.chats[-1]
        machine._chat(last + [{"role": "user", "content": "keeper"}], 4)
        hits = client.get(f"http://127.0.0.1:{with_sessions}/health").json()["session_hits"]
    assert hits > 0


# --- ChatSession: turns, abandoned streams, saves and loads of good and damaged files ---------------------------------

def _held(session):
    st = session.llm.kv_state()
    return ([dict(m) for m in session.messages], st.positions.tolist(), list(session.llm.save_state().pending))


class ChatSessionMachine(RuleBasedStateMachine):
    """A chat with a cache that evicts: whatever happens, the history alternates user / assistant after the system
    prompt; an abandoned answer stream closed late changes nothing; a save loads back to the same history and cache;
    a damaged file changes nothing."""

    files = Bundle("files")

    @initialize()
    def start(self):
        from h2o_local.chat_session import ChatSession

        self.session = ChatSession(Llama(self.model_path, policy="h2o", budget=48, n_threads=1, keep="system"),
                                   system="You are tiny.", max_tokens=6, temperature=0)
        self.stale = []
        self.saved = {}
        self.loads = 0

    @rule(text=words)
    def send(self, text):
        shown = "".join(self.session.send(text))
        last = self.session.messages[-1]
        # the history holds what the cache holds: the text shown, and the bytes of a character cut at max_tokens
        assert last["role"] == "assistant" and last["content"].startswith(shown)

    @rule(text=words, shown=st.integers(0, 3))
    def send_and_leave_the_stream_open(self, text, shown):
        stream = self.session.send(text)
        for _ in range(shown):
            next(stream, None)
        self.stale.append((stream, self.loads))

    @rule(data=st.data())
    def close_an_old_stream(self, data):
        if self.stale:
            stream, loads = self.stale.pop(data.draw(st.integers(0, len(self.stale) - 1)))
            newest = stream is self.session.answer_stream and self.session.messages[-1]["role"] == "user"
            before = _held(self.session)
            stream.close()
            if not newest:  # an answer a newer turn, a reset or a load has ended: closing it changes no history,
                assert self.session.messages == before[0]
                if loads != self.loads:  # and no cache loaded since it was opened
                    assert _held(self.session) == before

    @rule(target=files)
    def save(self):
        path = self.dir / f"s{len(self.saved)}.session"
        self.session.save(path)
        self.saved[path] = _held(self.session)
        return path

    @rule(path=files)
    def load(self, path):
        self.session.load(path)
        self.loads += 1
        assert _held(self.session) == self.saved[path]

    @rule(path=files, damage=st.sampled_from(["kv", "json", "cut", "policy"]))
    def load_a_damaged_file(self, path, damage):
        import json
        import zipfile

        with zipfile.ZipFile(path) as z:
            meta, kv = json.loads(z.read("session.json")), z.read("kv.bin")
        if damage == "kv":
            kv = kv[:24] + bytes(len(kv) - 24)
        elif damage == "json":
            meta["messages"] = [{"role": "user", "content": 7}]
        elif damage == "policy":
            meta["policy"] = "local-48"
        bad = self.dir / "bad.session"
        with zipfile.ZipFile(bad, "w") as z:
            z.writestr("session.json", json.dumps(meta))
            z.writestr("kv.bin", kv)
        if damage == "cut":
            bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        before = _held(self.session)
        with pytest.raises(ValueError):
            self.session.load(bad)
        assert _held(self.session) == before

    @rule()
    def reset(self):
        self.session.reset()

    @invariant()
    def history_alternates(self):
        if hasattr(self, "session"):
            roles = [m["role"] for m in self.session.messages]
            assert roles[:1] == ["system"]
            assert all(r == ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(roles[1:]))
            # only an answer being streamed leaves the last message a user's
            assert roles[-1] != "user" or any(s is self.session.answer_stream for s, _ in self.stale)

    def teardown(self):
        for stream, _ in getattr(self, "stale", []):
            stream.close()


def test_random_chats_with_saves_loads_and_abandoned_streams(tmp_path):
    from tiny_model import write_tiny_llama

    ChatSessionMachine.model_path = str(write_tiny_llama(tmp_path / "chat.gguf", chat_template=CHATML,
                                                         n_ctx_train=4096))
    ChatSessionMachine.dir = tmp_path
    run_state_machine_as_test(ChatSessionMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None, phases=PHASES,
        suppress_health_check=list(hypothesis.HealthCheck)))
