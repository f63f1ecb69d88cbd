"""The preemption handler in one process, and the launcher's side of preemption and restarts
(the real launches are in ``tests/integration_tests/test_fault_tolerance.py``)."""

import os
import signal

import pytest

from torchtitan import failure_records, failure_report
from torchtitan.components import preemption


def test_a_signal_is_only_noted_and_asks_to_stop_at_the_next_check():
    before = signal.getsignal(signal.SIGUSR1)
    watch = preemption.PreemptionWatch(agree=False)
    try:
        assert watch.requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process without the handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.requested() == signal.SIGUSR1  # the first signal names the stop
    finally:
        watch.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_the_launcher_and_the_ranks_agree_on_the_exit_code_and_records(tmp_path, monkeypatch):
    assert failure_records.PREEMPTED_EXIT_CODE == preemption.EXIT_CODE == 75
    assert not failure_records.note_preempted("SIGTERM", 7, None)  # no launcher: the rank exits 75
    monkeypatch.setenv(failure_records.FAILURE_DIR_ENV, str(tmp_path))
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        assert failure_records.note_preempted("SIGUSR1", 7, "ckpt/step-7")
    record = failure_records.preempted(tmp_path)
    assert record == {"rank": 0, "signal": "SIGUSR1", "step": 7, "checkpoint": "ckpt/step-7"}
    assert failure_report.preemption_line(record).startswith(
        "preempted by SIGUSR1 after step 7: saved"
    )
    assert failure_records.refusals(tmp_path) == []  # a preemption is not a refusal


def test_a_preempted_message_says_what_was_saved():
    saved = preemption.Preempted(signal.SIGTERM, 12, "out/checkpoint/step-12")
    assert "saved out/checkpoint/step-12" in saved.message()
    assert "nothing was saved" in preemption.Preempted(signal.SIGUSR1, 3, None).message()


def test_a_preempted_run_that_saved_nothing_says_why(monkeypatch):
    from types import SimpleNamespace

    def checkpointer(**config):
        return SimpleNamespace(
            config=SimpleNamespace(**{"enable": True, "load_only": False} | config)
        )

    monkeypatch.setattr(preemption, "can_save", lambda *_: False)
    assert (
        "(checkpointing is off (--checkpoint.enable))"
        in preemption.stop(signal.SIGTERM, 4, None).message()
    )
    assert (
        "(--checkpoint.load_only)"
        in preemption.stop(signal.SIGTERM, 4, checkpointer(load_only=True)).message()
    )
    monkeypatch.setattr(preemption.local_tensor, "is_simulating", lambda: True)
    message = preemption.stop(signal.SIGTERM, 4, checkpointer()).message()
    assert "nothing was saved (COMM_MODE=local_tensor never saves checkpoints)" in message


class _Failure:
    """What torchrun's ``ProcessFailure`` offers the launcher."""

    def __init__(self, exitcode: int, timestamp: int = 100):
        self.exitcode, self.timestamp = exitcode, timestamp

    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name


@pytest.mark.parametrize(
    "codes, line",
    [
        ({1: -9, 0: 4}, "rank 1 was killed by SIGKILL (then rank 0 lost contact and stopped)"),
        (
            {0: 4, 1: 1, 2: -15, 3: 4},
            "rank 1 exited with code 1 (an exception; its traceback is in its output) "
            "(then ranks 0, 3 lost contact and stopped; rank 2 stopped by torchrun)",
        ),
        ({0: 124, 1: -15}, "rank 0 exited with code 124 (the hang watchdog) (then rank 1 stopped"),
        # Nothing but consequences (a network fault): every rank is listed as it ended.
        ({0: 4, 1: 4}, "rank 0 exited with code 4 (a collective lost another rank); rank 1 "),
        ({0: -15, 1: -15}, "rank 0 was killed by SIGTERM; rank 1 was killed by SIGTERM"),
    ],
)
def test_the_launcher_names_the_failure_that_started_it_first(codes, line):
    assert failure_report.causes({r: _Failure(c) for r, c in codes.items()}).startswith(line)


def test_a_rank_that_ended_after_the_first_failures_follows_them_whatever_its_code():
    """Under NCCL a rank hung on the dead one ends when torchrun kills it (SIGKILL, after
    SIGTERM's grace) or its own watchdog aborts it: later than the failure it follows."""
    failures = {0: _Failure(-9, timestamp=131), 1: _Failure(1, timestamp=100)}
    assert failure_report.causes(failures) == (
        "rank 1 exited with code 1 (an exception; its traceback is in its output) "
        "(then rank 0 stopped by torchrun)"
    )
    failures[2] = _Failure(-6, timestamp=140)  # NCCL's watchdog: SIGABRT
    assert failure_report.causes(failures).endswith("(then ranks 0, 2 stopped by torchrun)")
