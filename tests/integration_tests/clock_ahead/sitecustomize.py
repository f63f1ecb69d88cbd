"""On ``PYTHONPATH``, every Python process started with it reads a wall clock
``TITAN_TEST_CLOCK_AHEAD_S`` seconds ahead (``time.time``): a node whose clock is not in step
with the others'. Monotonic clocks and ``datetime`` are left alone (torchrun's rendezvous
compares ``datetime`` heartbeats across nodes)."""

import os
import time

_AHEAD_S = float(os.environ.get("TITAN_TEST_CLOCK_AHEAD_S", "0"))
_wall = time.time
time.time = lambda: _wall() + _AHEAD_S
