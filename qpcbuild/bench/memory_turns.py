"""Our loaded bundle and a peer that loads its own float32 copy of both models (vLLM) may not
fit in the host's memory together: a 1.5B + 0.5B pair is about 9 GB in our process and 14 GB in
vLLM's (24 GiB here; its engine was killed by the kernel's OOM killer). They then take turns:
before such a peer runs, our sessions are released when the memory it needs is not available;
before our next configuration, that peer stops what it holds and our sessions load again. Both
happen between timed passes, never inside one."""

from __future__ import annotations

import gc
from typing import Any

from ..measuring import Say


class MemoryTurns:
    def __init__(self, sessions: list[Any], peers: list[Any], say: Say) -> None:
        self.sessions = [s for s in sessions if hasattr(s, "release")]
        self.peers = peers
        self.say = say
        self.released = False
        self.turns = 0  # how many times ours made room (reported in the notes)

    def before_peer(self, peer: Any) -> None:
        """Make room for `peer` when it needs more memory than is available with ours loaded."""
        from ..runtime.loader import available_memory

        need = getattr(peer, "memory_bytes", 0)
        if not need or self.released or not self.sessions:
            return
        free = available_memory()
        if free is None or free >= need:
            return
        for s in self.sessions:
            s.release()
        gc.collect()
        self.released, self.turns = True, self.turns + 1
        after = available_memory()
        self.say(f"  released our sessions for {peer.name}: it needs about {need / 2**30:.1f} GiB,"
                 f" {free / 2**30:.1f} GiB was available ({(after or 0) / 2**30:.1f} GiB now)")

    def before_ours(self) -> None:
        """Our sessions back in memory (the peers that took turns first stop what they hold)."""
        if not self.released:
            return
        for p in self.peers:
            if getattr(p, "memory_bytes", 0) and p.stop is not None:
                p.stop()
        for s in self.sessions:
            s.reopen()
        self.released = False
