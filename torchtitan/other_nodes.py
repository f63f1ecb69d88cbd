"""What a node's launcher tells the other nodes' launchers, and reads from them, through the
c10d rendezvous's store (``job_store.py``), by torchrun's worker group of this node: why its
ranks failed in an attempt, whether that ends the job, and, when another node came back to
meet again or ended the job while this node's ranks still run (waiting, under NCCL, for ranks
that are gone), what happened there.

An attempt is where its ranks meet (``MASTER_ADDR:MASTER_PORT``, the same on every node) and
the name the launchers agreed on for it (``job_store.attempt_name``). No torch import here.
"""

import os
import socket
import time

from torchtitan import failure_report, job_store
from torchtitan.failure_records import ATTEMPT_START_ENV, format_refusal

_LOOK_AGAIN_S = 0.2  # between looks for another node's failure record (failure_elsewhere)


def why_another_restarted(worker_group) -> tuple[str, bool]:
    """Why another node came back to meet, and whether a rank of this attempt failed: what
    that node's agent, or a rank there that raised, published in the rendezvous's store (under
    NCCL this node's ranks may still be waiting in a collective for the dead rank, and say
    nothing)."""
    other = "another node restarted its ranks"
    failure = _failure_there(worker_group)
    if failure is None:
        return other, False
    return f"{other}: {failure_report.elsewhere(failure)}", True


def failure_elsewhere(worker_group, wait_s: float) -> dict | None:
    """Another node's failure in this attempt, when this node's ranks only lost theirs (a rank
    killed there leaves no record a rank here could copy; its agent's is in the rendezvous's
    store), waiting about ``wait_s`` for it: that node's agent usually sees its ranks fail when
    this one sees its own lose them (not when its other ranks are slow to stop: torchrun stops
    them before it reports). None after a network fault, or at once without the store (the
    static rendezvous)."""
    if not os.environ.get(job_store.JOB_STORE_ENV):
        return None
    deadline = time.monotonic() + wait_s
    while (failure := _failure_there(worker_group)) is None and time.monotonic() < deadline:
        time.sleep(_LOOK_AGAIN_S)
    return failure


def _failure_there(worker_group) -> dict | None:
    """Why another node's ranks failed in this attempt: its agent's record, or a crash a rank
    there published (``{"crashes": [crash]}``)."""
    rendezvous = os.environ.get(job_store.JOB_STORE_ENV)
    if not rendezvous:
        return None
    run, master = worker_group.spec.rdzv_handler.get_run_id(), attempt(worker_group)
    failure = _this_attempts(job_store.failure_of_attempt(rendezvous, run, master))
    if failure is None or failure["node"] == worker_group.group_rank:
        crash = _this_attempts(job_store.crash_of_attempt(rendezvous, run, master))
        here = {w.global_rank for w in worker_group.workers}
        failure = None if crash is None or crash["rank"] in here else {"crashes": [crash]}
    return failure


def attempt(worker_group) -> str:
    """Where the attempt's ranks meet (``MASTER_ADDR:MASTER_PORT``), and its name where the
    launcher got one (``job_store.attempt_name``): the same on every node."""
    master = f"{worker_group.master_addr}:{worker_group.master_port}"
    name = os.environ.get(job_store.ATTEMPT_ENV)
    return f"{master}/{name}" if name else master


def publish_failure(worker_group, failures, crashed, refused, *, final: bool) -> bool:
    """Say in the rendezvous's store why this node's ranks failed in this attempt, and with
    ``final`` that this ends the job (the launcher's ``_stop_if_the_job_ended``): its
    ``refused`` records' first, or ``crashed`` records and torchrun's ``failures``, when the
    cause is this node's (not only ranks that lost another node's). Returns whether it did."""
    rendezvous = os.environ.get(job_store.JOB_STORE_ENV)
    told = crashed or failure_report.unrecorded_causes(failures, crashed)
    if not rendezvous or not (refused or told):
        return False
    record = {
        "node": worker_group.group_rank,
        "host": socket.gethostname(),
        "master": attempt(worker_group),
        "causes": format_refusal(refused[0])
        if refused
        else failure_report.causes(failures, crashed),
        "crashes": [{k: v for k, v in c.items() if k != "traceback"} for c in crashed],
        "time": time.time(),
    }
    if refused:
        record["refusal"] = refused[0]
    run = worker_group.spec.rdzv_handler.get_run_id()
    job_store.publish_failure(rendezvous, run, record, final=final)
    return True


def end_of_attempt(worker_group) -> dict | None:
    """Another node's end of the job in this attempt, from the rendezvous's store, if any."""
    rendezvous = os.environ.get(job_store.JOB_STORE_ENV)
    if not rendezvous:
        return None
    end = _this_attempts(
        job_store.end_of_job(rendezvous, worker_group.spec.rdzv_handler.get_run_id())
    )
    if end is None or end["node"] == worker_group.group_rank:
        return None
    return end if end["master"] == attempt(worker_group) else None


def _this_attempts(record: dict | None) -> dict | None:
    """``record``, read under this attempt's keys: an attempt can meet where an earlier one did
    (a port chosen again, or ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0`` with restarts on), and
    the first record is kept. Its name in the keys tells them apart; without one (its store
    did not answer when the launcher asked), a record older than this attempt's start here
    (``ATTEMPT_START_ENV``, less a second: clocks of nodes differ) is an earlier one's."""
    if record is None or os.environ.get(job_store.ATTEMPT_ENV):
        return record
    started = float(os.environ.get(ATTEMPT_START_ENV, "0"))
    return record if record["time"] >= started - 1 else None
