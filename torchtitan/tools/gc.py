"""Python garbage collection at fixed steps instead of at random moments."""

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_every(freq: int) -> Iterator:
    """Disable automatic GC during training and collect every ``freq`` steps instead, so
    collection pauses happen on all ranks at the same step rather than at random."""
    if freq <= 0:
        yield lambda step: None
        return
    gc.disable()
    gc.collect(1)

    def tick(step: int) -> None:
        if step > 1 and step % freq == 0:
            gc.collect(1)

    try:
        yield tick
    finally:
        gc.enable()
