"""Python's cycle collector and the long-lived heap. A process that imported torch and built an
engine holds a large heap that never becomes garbage (modules, the model, the tokenizer), and
every collection of the oldest generation walks all of it again: about 0.2 s on a CPU, each
time. `gc.freeze` moves what is alive into a generation no collection scans; reference counting
still frees what it can, only cycles among frozen objects are never collected. So a process
freezes once its start-up is done (the server, as vLLM's engine does), and a phase that must
start from a clean heap (a rehearsal, a graph capture) freezes for its own length."""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_heap() -> None:
    """Collect the garbage there is, then keep every object alive now out of every later
    collection: for the end of a long-running process's start-up. Unfrozen at exit, so that
    the interpreter's last collections finalize it (extensions such as Triton's count what
    they see alive at exit as leaked)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside, collections scan only what was made since entry (collected first); after, the
    heap is scanned as before. A heap frozen already (`freeze_heap`) stays frozen, with what
    was alive on entry: `gc` cannot unfreeze part of it."""
    outer = gc.get_freeze_count() > 0
    freeze_heap()
    try:
        yield
    finally:
        if not outer:
            gc.unfreeze()
