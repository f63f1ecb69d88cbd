"""Test-session settings shared by every test directory."""

import os

import torch

# Files that take longest start first: under pytest-xdist (`make test`: two files at once) the
# numerics launches (about 10 minutes) then run beside everything else instead of last, alone.
SLOW_FIRST = ("integration_tests/test_parallel_numerics.py",)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: one intra-op thread each (and for the processes they start
    # without their own setting). Two OpenMP teams of 2 threads on 2 cores made in-process
    # training tests 5-25x slower (a 6 s test took 157 s).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, s in enumerate(SLOW_FIRST) if path.endswith(s)), len(SLOW_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order
