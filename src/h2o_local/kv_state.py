"""What one sequence's KV cache holds (`Llama.kv_state()`), and its saved form (`Llama.save_state()`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import _engine

# a sequence's saved cache (`Llama.save_state`): KV cells, positions, scores, counters, last logits, the token shown
# and not fed; `.to_bytes()` and `Snapshot.from_bytes(data)` (ValueError for anything but a well-formed snapshot)
Snapshot = _engine.SeqSnapshot


@dataclass(frozen=True)
class KVState:
    """What the KV cache of one sequence holds (see `Llama.kv_state`)."""

    positions: np.ndarray    # int32 [n]: kept positions, ascending (renumbered 0..n-1 when the positions roll)
    scores: np.ndarray       # float32 [n]: accumulated attention of each kept position, summed over heads
    head_scores: np.ndarray  # float32 [n, n_head]: the same per query head
    queries: np.ndarray      # int64 [n]: queries that have attended each kept position (its own included)
    n_evicted: int           # tokens evicted so far
    n_seen: int              # tokens fed so far
    peak_cells: int          # most entries held at once (right after a decode, before its eviction)
    kv_bytes: int            # bytes allocated for the whole context's KV cache
    kv_cells: int            # KV cells allocated (n_ctx)
    n_keep: int = 0          # the oldest entries protected from eviction (`keep`)
    tokens: Optional[np.ndarray] = None        # int32 [n]: the token of each kept entry
    probe_scores: Optional[np.ndarray] = None  # float32 [n]: the most attention a probe gave each (0: none yet)
    reply_marks: Optional[np.ndarray] = None   # bool [n]: the last exchange's entries, kept before what a probe ranks
                                               # (the reply option; marked at each probe)
    # a per-head policy (`per_head=True`): int32 [n_layers, n_head_kv, n], the position whose K and V cell i holds
    # in that layer and KV head (`positions[i]` is where the cell was written, what the attention mask reads);
    # None when every cell holds its own position everywhere
    head_positions: Optional[np.ndarray] = None
    head_layers: Optional[np.ndarray] = None   # int32 [n_layers]: the layers of head_positions
    evict_seconds: float = 0.0  # time spent choosing and removing what is evicted, moves included (seconds)
    n_head_moves: int = 0       # per-head cells: K/V slices of one layer's KV head moved between cells so far
    # time spent in probe decodes, the device's work included (seconds); a probe that rode in its chunk's decode
    # (`probe_rides`) adds none: its time is the chunk's, in decode_seconds
    probe_seconds: float = 0.0
    n_probes: int = 0           # probes run so far (the question probe: one per eviction while a prompt is read)
    decode_seconds: float = 0.0   # in the decodes that fed it, the device's work and the wait included (probes apart)
    compact_seconds: float = 0.0  # moving the kept cells to the bottom of the cache after a prompt (seconds)
    # recall (`Llama(recall=...)`): the positions of the entries kept in host memory (in the order they left), their
    # K and V bytes there, entries spilled so far, brought back by a later prompt and kept, and dropped for the cap
    host_positions: Optional[np.ndarray] = None
    host_bytes: int = 0
    # each kept (and each stored) entry's place in the conversation: its token index, the position it was fed at,
    # which rolling does not change (equal to positions until the sequence rolls)
    origins: Optional[np.ndarray] = None
    host_origins: Optional[np.ndarray] = None
    n_spilled: int = 0
    n_recalled: int = 0
    n_dropped: int = 0
    # the places in the conversation of the text the store dropped past its cap (its tokens stay in host memory, 8
    # bytes each, for the policy's reread: a later question may read them again), ascending
    text_origins: Optional[np.ndarray] = None

    @property
    def n_cells(self) -> int:
        """Entries held now."""
        return int(self.positions.shape[0])

    def __repr__(self) -> str:
        """Counts and sizes, not the arrays (they are the fields: `st.positions`, `st.scores`, ...)."""
        host = "" if self.host_positions is None else \
            f", host={len(self.host_positions)} entries ({self.host_bytes / 2**20:.1f} MiB), recalled={self.n_recalled}"
        return (f"KVState(kept={self.n_cells} entries, seen={self.n_seen}, evicted={self.n_evicted}, "
                f"peak={self.peak_cells}, keep={self.n_keep}, kv={self.kv_bytes / 2**20:.1f} MiB in {self.kv_cells} "
                f"cells{host})")

    def held(self) -> Tuple[np.ndarray, np.ndarray]:
        """The token indices whose K and V the cache holds, ascending (per-head cells: in at least one layer's KV
        head), and the share of the layers' KV heads that hold each (1.0 everywhere for whole-token cells). Token
        indices are the entries' origins: their positions as fed, before any roll."""
        if self.head_positions is None:
            return (self.positions if self.origins is None else self.origins), np.ones(self.n_cells)
        parts = self.head_positions.reshape(-1, self.head_positions.shape[-1])
        positions, counts = np.unique(parts, return_counts=True)
        return positions, counts / parts.shape[0]
