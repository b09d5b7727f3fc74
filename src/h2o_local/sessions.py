"""When a prompt continues a cache: the one rule, for the server's saved sessions and for `ChatSession`.

A cache that holds `held` tokens (fed, then at most one shown and not fed) with a protected prefix of `n_keep`
tokens continues a prompt when the prompt's tokens, as a fresh request tokenizes them, start with `held` and go on,
and its protected prefix is the same: then only the rest is fed, and (with no eviction) the answer is a fresh
request's. Text is never compared: a prompt that extends a held text inside a word, or re-tokenizes an answer
otherwise, or was built with another protected prefix, does not continue it.

One exception, for conversations resent whole: a saved session whose request's tokens part from it within its last
answer (from ANSWER_SLACK tokens before the answer's first: BPE merges an answer's first spaces or newlines with the
template's newline before it) is continued from where they part, as llama-server reuses a cached prompt's common
prefix; what it held after that point is forgotten (`Llama.truncate`). A request that parts earlier (another
question after the same system prompt) does not continue it.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple


ANSWER_SLACK = 2  # tokens before a saved answer's first that a resent history may part at


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tuple(a[:mid]) == tuple(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def continues(held: Sequence[int], held_keep: int, tokens: Sequence[int], n_keep: int, whole: bool = False) -> bool:
    """True when a cache holding `held` (protected prefix `held_keep`) continues the prompt `tokens` (`n_keep`);
    `whole`: also when it holds the whole prompt (a saved cache keeps the logits after its last token)."""
    n = len(held)
    # the last held token first: most saved sessions of a long conversation part from it early, and the whole
    # comparison is as long as the conversation
    longer = len(tokens) >= n if whole else len(tokens) > n
    return held_keep == n_keep and longer and (n == 0 or tokens[n - 1] == held[-1]) and \
        tuple(tokens[:n]) == tuple(held)


@dataclass
class Session:
    tokens: Tuple[int, ...]  # the tokens the cache holds, then the one shown last and not fed (if any)
    n_fed: int               # how many of them the cache holds
    n_keep: int              # its protected prefix
    snapshot: Any            # SeqSnapshot
    nbytes: int
    policy: str = ""         # the policy that made it (a label; "": the owner's)
    answer_from: int = -1    # where its last answer begins (-1: it holds none; ANSWER_SLACK)


@dataclass
class Match:
    session: Session
    n_held: int              # how many of the request's tokens it holds: its n_fed, or where the request parts from it


class SessionCache:
    """Saved slot caches keyed by the tokens they hold, their protected prefix and the policy that made them, least
    recently used first out, within `limit_bytes`."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = int(limit_bytes)
        self._items: "collections.OrderedDict[Tuple[int, str, Tuple[int, ...]], Session]" = collections.OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def put(self, tokens: Sequence[int], n_fed: int, n_keep: int, snapshot: Any, policy: str = "",
            answer_from: int = -1) -> None:
        """Save `snapshot` as the cache of `tokens` (the first `n_fed` fed); `answer_from`: where the answer it
        ends with begins (the prompt's length), -1 for none."""
        nbytes = int(snapshot.nbytes)
        if nbytes > self.limit_bytes or n_fed < 1:
            return
        key = (int(n_keep), policy, tuple(tokens))
        self._drop(key)
        self._items[key] = Session(key[2], int(n_fed), key[0], snapshot, nbytes, policy, int(answer_from))
        self.nbytes += nbytes
        while self.nbytes > self.limit_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes

    def _drop(self, key) -> None:
        s = self._items.pop(key, None)
        if s is not None:
            self.nbytes -= s.nbytes

    def longest_prefix(self, tokens: Sequence[int], n_keep: int, policy: str = "") -> Optional[Match]:
        """The saved session with the same protected prefix and policy whose tokens are the longest prefix of
        `tokens`, the whole of them included (a prompt resent as it was, a regenerated answer: its snapshot's
        last logits are the prompt's); else one that `tokens` part from within its last answer (the module's
        exception), the latest parting first. It stays saved (a conversation may branch from it again) and becomes
        the most recently used."""
        best = self._longest(tokens, n_keep, policy)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        s = best.session
        self._items.move_to_end((s.n_keep, s.policy, s.tokens))
        return best

    def held(self, tokens: Sequence[int], n_keep: int, policy: str = "") -> int:
        """How many of `tokens` the session `longest_prefix` would continue holds (0: none), without using it: what
        a request need not read. Safe beside the thread that saves and uses sessions."""
        best = self._longest(tokens, n_keep, policy)
        return 0 if best is None else best.n_held

    def _longest(self, tokens: Sequence[int], n_keep: int, policy: str) -> Optional[Match]:
        # longest first: a long conversation's earlier turns are saved too, and each is compared whole
        saved = sorted(list(self._items.values()), key=lambda s: len(s.tokens), reverse=True)  # a copy: another
        for s in saved:                                                                          # thread may save
            if s.policy == policy and continues(s.tokens, s.n_keep, tokens, n_keep, whole=True):
                return Match(s, s.n_fed)
        best: Optional[Match] = None
        for s in saved:
            if s.policy != policy or s.n_keep != n_keep or s.answer_from < 0:
                continue
            # the request holds the saved prompt but for its last ANSWER_SLACK tokens, and those are more than its
            # protected prefix and a few tokens after it (else it is another request that begins alike)
            start = s.answer_from - ANSWER_SLACK
            if start <= s.n_keep + ANSWER_SLACK or len(tokens) < s.answer_from or \
                    tuple(tokens[:start]) != tuple(s.tokens[:start]):
                continue
            # parted within the answer; one token at least is left to read (its logits are the next draw's)
            n = min(common_prefix(tokens, s.tokens[:s.n_fed]), len(tokens) - 1)
            if n >= start and (best is None or n > best.n_held):
                best = Match(s, n)
        return best

    def __len__(self) -> int:
        return len(self._items)
