"""Compute `fn(item)` ahead of the consumer in a background thread.

Used by `MeshEmbedding.prefetch` to overlap host preprocessing with the
device step. The queue is bounded; an error in the thread is re-raised in
the consumer's loop; a consumer that stops early unblocks and ends the thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator


def background_map(
    fn: Callable, items: Iterable, buffer_size: int = 2, name: str = "embedmesh-prefetch"
) -> Iterator:
    """Yield `fn(item)` for each item, computed up to `buffer_size` items ahead."""
    q: queue.Queue = queue.Queue(maxsize=max(1, buffer_size))
    stop = threading.Event()
    done = object()

    def work():
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put(("ok", fn(item)))
            q.put(("ok", done))
        except BaseException as e:  # re-raised in the consumer
            q.put(("error", e))

    thread = threading.Thread(target=work, daemon=True, name=name)
    thread.start()
    try:
        while True:
            kind, value = q.get()
            if kind == "error":
                raise value
            if value is done:
                return
            yield value
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.05)
