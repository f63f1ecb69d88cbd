"""The launcher's lines about a failure (``launcher.py``), from what torchrun saw of the ranks
(``failures``: exit codes and times, by rank) and what they recorded (``failure_records.py``):
the causes named before the ranks that only followed them, a hidden rank's traceback, a
preemption, who waited for whom in a hang.

No torch import here.
"""

import os
from pathlib import Path

from torchtitan.failure_records import (
    HANG_EXIT_CODE,
    LOST_PEER_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    read_records,
)
from torchtitan.tools import hang_report
from torchtitan.tools.hang_report import ranks_text

_SIGTERM = 15
_CRASH_GROUPS_SHOWN = 3  # different exceptions named in one line; the rest by their ranks


def hang_lines(folder: str | Path, world_size: int | None) -> list[str]:
    """Who the ranks waited for, when the hang watchdog ended some (their records in
    ``folder``): ``[launcher] the hang: ...`` lines; the records are then removed, so that a
    restarted attempt's hang is read alone. (Its caller keeps an error here from hiding the
    failure it reports on.)"""
    records = read_records(folder, "hung-rank")
    for path in Path(folder).glob("hung-rank*.json"):
        path.unlink(missing_ok=True)
    if not records:
        return []
    attempt = max(r.get("attempt", 0) for r in records)
    run = os.environ.get("TITAN_RUN_ID")
    dumps: dict = {}
    for traces in sorted({r["traces"] for r in records}):
        dumps |= hang_report.load(traces, run=run, attempt=attempt)
    return [f"[launcher] the hang: {line}" for line in hang_report.diagnose(dumps, world_size)]


def preemption_line(record: dict) -> str:
    saved = record["checkpoint"]
    where = f"saved {saved}" if saved else "nothing saved (checkpointing is off)"
    return (
        f"preempted by {record['signal']} after step {record['step']}: {where}; "
        f"exit code {PREEMPTED_EXIT_CODE}, the same command resumes"
    )


def hidden_traceback(crashed: list[dict], failures: dict, shown: set[int] | None) -> list[str]:
    """The traceback of the crash that started it, prefixed by its rank, when it happened on
    this node and ``LOG_RANK`` hid that rank's console; else nothing (it is above, or on its
    own node's console)."""
    started = _crash_split(crashed, failures)[0]
    if not started or "copied_by" in started[0] or shown is None:
        return []
    first = started[0]
    if first.get("local_rank") in shown:
        return []
    return [f"[rank{first['rank']}]: {line}" for line in first.get("traceback", "").splitlines()]


def _follows(failure, earliest: int) -> bool:
    """Whether a failure without a record only followed the first ones torchrun saw: it lost a
    peer, torchrun stopped it, or it ended later (``timestamp`` in whole seconds)."""
    return failure.timestamp > earliest or failure.exitcode in (LOST_PEER_EXIT_CODE, -_SIGTERM)


def unrecorded_causes(failures: dict, crashed: list[dict]) -> dict:
    """The failures without a record (a kill, the watchdog, a lost peer's exit code) that did
    not only follow the first ones torchrun saw, by rank."""
    earliest = min(f.timestamp for f in failures.values()) if failures else 0
    told = {c["rank"] for c in crashed}
    return {r: f for r, f in failures.items() if r not in told and not _follows(f, earliest)}


def _crash_split(crashed: list[dict], failures: dict) -> tuple[list[dict], list[dict]]:
    """The recorded exceptions that started it, and those that followed. A rank that raised
    is a cause even when torchrun saw it end after the ranks that lost it (killed while it
    exited); but an exception raised a second or more after the first one, or after a failure
    without a record (a kill), is a consequence: a rank that raised because its peer died."""
    if not crashed:
        return [], []
    unrecorded = unrecorded_causes(failures, crashed).values()
    limit = min([crashed[0]["time"] + 1, *(f.timestamp + 1 for f in unrecorded)])
    started = [c for c in crashed if c["time"] < limit]
    return started, [c for c in crashed if c not in started]


def causes(failures: dict, crashed: list[dict] | None = None, there: dict | None = None) -> str:
    """The ranks' failures, those that started it first: ``rank 1 was killed by SIGKILL (then
    rank 0 lost contact and stopped)``; a recorded exception as ``rank 1 raised ValueError:
    ...`` (also another node's, copied here by a rank that lost it). Then come the ranks that
    followed (:func:`_follows`, :func:`_crash_split`). When every failure is of that kind and
    none is recorded, the cause is another node's failure ``there`` (its agent's record,
    :func:`elsewhere`), or, without one (a network fault), they are all listed."""
    crashed = crashed or []
    started, after = _crash_split(crashed, failures)
    told = {c["rank"] for c in crashed}
    first = unrecorded_causes(failures, crashed)
    lead = []
    if not first and not started:
        if there is not None:
            lead = [elsewhere(there)]
        else:
            first = {r: f for r, f in failures.items() if r not in told}
    rest = [r for r in failures if r not in first and r not in told]
    lost = [r for r in rest if failures[r].exitcode == LOST_PEER_EXIT_CODE]
    stopped = [r for r in rest if r not in lost]
    then = [f"{ranks_text(lost)} lost contact and stopped"] if lost else []
    then += [f"{ranks_text(stopped)} stopped by torchrun"] if stopped else []
    then += [f"{ranks_text([c['rank']])} failed too ({c['error'].split(':')[0]})" for c in after]
    parts = lead + crash_causes(started) + [_cause(rank, f) for rank, f in sorted(first.items())]
    return "; ".join(parts) + (f" (then {'; '.join(then)})" if then else "")


def crash_causes(crashed: list[dict]) -> list[str]:
    """``rank 1 raised ValueError: ... (traceback in <log>)``, ranks that raised alike named
    together; another node's with its host. Past three different errors (eight ranks out of
    memory, each by its own count of bytes), the rest are only counted."""
    groups: dict[tuple, list[dict]] = {}
    for record in crashed:
        where = record["host"] if "copied_by" in record else None
        groups.setdefault((record["error"], where), []).append(record)
    parts, shown = [], list(groups.items())[:_CRASH_GROUPS_SHOWN]
    for (error, where), records in shown:
        first, ranks = records[0], [r["rank"] for r in records]
        on = f", on {where}," if where else ""
        whose = "" if len(ranks) == 1 else f"rank {first['rank']}'s "
        there = " there" if where else ""
        tail = f" ({whose}traceback in {first['log']}{there})" if first.get("log") else ""
        parts.append(f"{ranks_text(ranks)}{on} raised {error}{tail}")
    if rest := [r["rank"] for _, records in list(groups.items())[len(shown) :] for r in records]:
        parts.append(f"{ranks_text(rest)} raised too (see their log files)")
    return parts


def _cause(rank: int, failure) -> str:
    """``rank 1 was killed by SIGKILL`` / ``rank 0 exited with code 124 (the hang watchdog)``."""
    if failure.exitcode < 0:
        return f"rank {rank} was killed by {failure.signal_name()}"
    known = {
        HANG_EXIT_CODE: " (the hang watchdog)",
        1: " (an exception; its traceback is in its output)",
        LOST_PEER_EXIT_CODE: " (a collective lost another rank)",
    }
    return f"rank {rank} exited with code {failure.exitcode}{known.get(failure.exitcode, '')}"


def elsewhere(record: dict) -> str:
    """Another node's failure, from what its agent published (``other_nodes.publish_failure``):
    its crashes as a rank here names them when it copies one (``rank 0, on node-a, raised
    ...``), else its own line with its host (``on node-a, rank 1 was killed by SIGKILL``)."""
    if record["crashes"]:
        return causes({}, [crash | {"copied_by": None} for crash in record["crashes"]])
    return f"on {record['host']}, {record['causes']}"
