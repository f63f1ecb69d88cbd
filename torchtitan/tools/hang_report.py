"""Who a hung job waited for, read from the dumps its ranks' hang watchdogs wrote.

``python -m torchtitan.tools.hang_report DUMP_FOLDER`` (or its ``comm_traces/``); the
launcher prints the same lines when ranks end by the watchdog. Each rank's
``rank<r>_flight_recorder.json`` lists the collectives it issued, per process group with a
sequence number, and which of them had not completed; ``rank<r>_stacks.txt`` has its threads'
stacks. Read together:

- a rank waiting in collective N of a group that another member never reached names the one
  behind, and where that one was: in another collective (followed on), or outside any, at the
  innermost frame of its main thread;
- members waiting at the same N in different collectives ran different code;
- members all waiting in the same collective: it does not complete (the network);
- no rank inside a collective: the step's own work outlived the timeout.

torch's ``torch.distributed.flight_recorder`` analyses NCCL's pickled dumps; gloo's dumps carry
no group membership, which the watchdog adds (``titan.groups``). No torch import here: the
launcher reads this before reporting a failure.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

FR_FILE = re.compile(r"rank(\d+)_flight_recorder\.json$")


@dataclass(frozen=True)
class Pending:
    """A collective a rank had issued and not seen complete."""

    rank: int
    group: str
    seq: int
    op: str
    sizes: str
    backend: str = "gloo"


@dataclass
class RankDump:
    rank: int
    entries: list[dict]
    groups: dict[str, list[int]]
    group_desc: dict[str, str]
    stacks: Path | None
    step: int | None
    # (backend, group) -> the last collective issued there
    enqueued: dict[tuple[str, str], int] = field(default_factory=dict)

    def max_seq(self, backend: str, group: str) -> int:
        """The last collective this rank issued on ``group`` through ``backend`` (each counts
        its own): the recorder's own count where the dump has it (its ring of entries may
        have dropped the oldest)."""
        key = (backend, group)
        listed = (e.get("collective_seq_id", 0) for e in self.entries if _key(e) == key)
        return max(max(listed, default=0), self.enqueued.get(key, 0))

    def pending(self) -> list[Pending]:
        """The first unfinished collective of each group (what the rank is stuck on there).
        Point-to-point entries are left out: gloo records none, NCCL's follow their own
        numbering per pair."""
        first: dict[tuple[str, str], Pending] = {}
        for e in self.entries:
            if e.get("is_p2p") or e.get("retired") or e.get("state") == "completed":
                continue
            key, seq = _key(e), e.get("collective_seq_id", 0)
            if key not in first or seq < first[key].seq:
                sizes = f"{e.get('input_sizes')} {','.join(e.get('input_dtypes') or [])}"
                op = e.get("profiling_name", "?")
                first[key] = Pending(self.rank, key[1], seq, op, sizes, key[0])
        return sorted(first.values(), key=lambda p: (p.backend, p.group, p.seq))


def _group(entry: dict) -> str:
    group = entry.get("process_group") or ["?"]
    return str(group[0])


def _key(entry: dict) -> tuple[str, str]:
    """(backend, group): gloo and NCCL number one group's collectives apart."""
    return str(entry.get("profiling_name", "?")).split(":")[0], _group(entry)


def load(folder: str | Path, *, run: str | None = None, attempt: int | None = None) -> dict:
    """``rank -> RankDump`` of the watchdog dumps in ``folder`` (or ``folder/comm_traces``):
    those of ``run`` and ``attempt``, by default the newest dump's (a dump folder keeps the
    files of earlier runs' ranks that this one did not overwrite)."""
    folder = Path(folder)
    if not any(folder.glob("rank*_flight_recorder.json")) and (folder / "comm_traces").is_dir():
        folder = folder / "comm_traces"
    raws = {}
    for path in sorted(folder.glob("rank*_flight_recorder.json")):
        try:
            raws[int(FR_FILE.search(path.name).group(1))] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    if raws and run is None and attempt is None:
        newest = max(raws.values(), key=lambda raw: raw.get("titan", {}).get("time", 0))
        run, attempt = newest.get("titan", {}).get("run"), newest.get("titan", {}).get("attempt")
    dumps = {}
    for rank, raw in sorted(raws.items()):
        titan = raw.get("titan", {})
        if (titan.get("run"), titan.get("attempt")) != (run, attempt):
            continue
        stacks = folder / f"rank{rank}_stacks.txt"
        groups = {g: [int(r) for r in ranks] for g, ranks in titan.get("groups", {}).items()}
        desc = {str(g): str(c.get("desc", "")) for g, c in (raw.get("pg_config") or {}).items()}
        names: dict[str, str] = {}  # pg_status is keyed by a group's local id
        for e in raw.get("entries") or []:
            if len(e.get("process_group") or []) > 1:
                desc.setdefault(str(e["process_group"][0]), str(e["process_group"][1]))
            if "pg_id" in e:
                names[str(e["pg_id"])] = _group(e)
        enqueued = {}
        for backend, key in (("gloo", "pg_status"), ("nccl", "nccl_pg_status")):
            for pg_id, status in (raw.get(key) or {}).items():
                try:
                    count = int(status["last_enqueued_collective"])
                    enqueued[(backend, names[str(pg_id)])] = count
                except (KeyError, TypeError, ValueError):
                    continue
        dumps[rank] = RankDump(
            rank=rank,
            entries=list(raw.get("entries") or []),
            groups=groups,
            group_desc=desc,
            stacks=stacks if stacks.exists() else None,
            step=titan.get("step"),
            enqueued=enqueued,
        )
    return dumps


def members(dumps: dict[int, RankDump], group: str) -> list[int]:
    """The group's global ranks: from a dump that names them, else every rank whose dump has
    an entry of the group (a member that never used it cannot be told apart then)."""
    for dump in dumps.values():
        if dump.groups.get(group):
            return sorted(dump.groups[group])
    return sorted(r for r, d in dumps.items() if any(_group(e) == group for e in d.entries))


_LIBRARY = re.compile(r"site-packages/|/lib/python3")


def main_frames(stacks: Path | None) -> list[tuple[str, str, str]] | None:
    """The main thread's frames (innermost first) in a watchdog's stack dump: the thread its
    ``# main thread 0x...`` line names, else the one whose outermost frame starts a program."""
    if stacks is None:
        return None
    try:
        text = stacks.read_text()
    except OSError:
        return None
    named = re.search(r"# main thread (0x[0-9a-f]+)", text)
    threads = [t for t in re.split(r"\n\s*\n", text) if "File " in t]
    frames_of = [(t, re.findall(r'File "([^"]+)", line (\d+) in (\S+)', t)) for t in threads]
    for thread, frames in frames_of:
        if named and re.search(rf"^(?:Current thread|Thread) {named.group(1)}\b", thread, re.M):
            return frames
    starts = ("<module>", "_run_module_as_main", "_run_code")
    return next((f for _, f in frames_of if f and f[-1][2] in starts), None)


_WAITS = re.compile(r"wait|recv|send|p2p|barrier")


def in_communication(stacks: Path | None) -> bool:
    """Whether the main thread was waiting on communication the flight recorder may not list
    (gloo records no point-to-point): its innermost frame in ``distributed_c10d``, or a wait,
    send or receive of the pipeline schedules (not DTensor or FSDP compute)."""
    frames = main_frames(stacks)
    if not frames:
        return False
    path, _, func = frames[0]
    if path.endswith("torch/distributed/distributed_c10d.py"):
        return True
    return "torch/distributed/pipelining/" in path and bool(_WAITS.search(func))


def where(stacks: Path | None) -> str:
    """The innermost frame of the main thread in a watchdog's stack dump, and the innermost
    of torchtitan's or the user's code where that is inside a library."""
    if stacks is None:
        return "no stack dump"
    frames = main_frames(stacks)
    if not frames:
        return "no main thread in its stack dump"

    def show(frame: tuple[str, str, str]) -> str:
        path, line, func = frame
        for marker in ("site-packages/", "/lib/python3"):
            if marker in path:
                path = path.split(marker, 1)[1]
                break
        else:
            path = _relative(path)
        return f"{path}:{line} in {func}"

    inner = frames[0]
    own = next((f for f in frames if not _LIBRARY.search(f[0])), None)
    if own is None or own == inner:
        return show(inner)
    return f"{show(inner)}, from {show(own)}"


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def ranks_text(ranks) -> str:
    """``rank 3`` / ``ranks 0, 2``."""
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _name(dumps: dict[int, RankDump], group: str) -> str:
    desc = next((d.group_desc.get(group) for d in dumps.values() if d.group_desc.get(group)), "")
    return f"group {group}{f' ({desc})' if desc else ''}"


_SYMMETRIC = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast")


def _same_call(op: str) -> bool:
    """Whether every member passes the same shapes to ``op`` (not so for a rooted scatter or
    gather, nor for an all-to-all's uneven splits): only their kind must agree otherwise."""
    name = op.split(":")[-1].lstrip("_")
    return name.startswith(_SYMMETRIC) and "to_all" not in name


def diagnose(dumps: dict[int, RankDump], world_size: int | None = None) -> list[str]:
    """Lines saying who waited for whom (see the module's docstring), where the waiting ends
    first: a rank outside any communication that others wait for, or a disagreement."""
    if not dumps:
        return ["no flight-recorder dumps to read"]
    lines: list[str] = []
    roots: list[str] = []  # where the waiting ends
    pending = [p for d in dumps.values() for p in d.pending()]
    behind_ranks: set[int] = set()
    for backend, group in sorted({(p.backend, p.group) for p in pending}):
        here = [p for p in pending if (p.backend, p.group) == (backend, group)]
        seq = min(p.seq for p in here)
        at = [p for p in here if p.seq == seq]
        group_ranks = members(dumps, group)
        behind = [r for r in group_ranks if r in dumps and dumps[r].max_seq(backend, group) < seq]
        kinds = {(p.op, p.sizes) if _same_call(p.op) else p.op for p in at}
        missing = [r for r in group_ranks if r not in dumps]
        name = _name(dumps, group)
        waited = (
            f"{ranks_text(p.rank for p in at)} waited in {at[0].op} (collective {seq} of {name})"
        )
        if len(kinds) > 1:
            what = "; ".join(f"rank {p.rank} {p.op} {p.sizes}" for p in at)
            roots.append(
                f"the ranks disagree on collective {seq} of {name}: {what}; they ran different "
                "code (a branch on rank-local data, or different shapes)"
            )
        elif behind:
            behind_ranks.update(behind)
            lines.append(f"{waited}, which {ranks_text(behind)} never reached")
        elif missing:
            lines.append(f"{waited} with {ranks_text(missing)}, which left no dump here")
        elif {p.rank for p in at} >= set(group_ranks):
            lines.append(
                f"every rank of {name} waited in {at[0].op} (collective {seq}): it did not "
                "complete although all of them reached it (the network, or a rank that died)"
            )
        else:
            lines.append(f"{waited}, which the other members had finished (dumps taken apart)")
    stuck = {p.rank for p in pending}
    # Ranks the recorder shows in no collective: in communication it does not list (gloo's
    # pipeline sends and receives), or outside any; the latter are where waiting ends.
    unlisted = [r for r in sorted(dumps) if r not in stuck]
    talking = [r for r in unlisted if in_communication(dumps[r].stacks)]
    for rank in unlisted:
        if rank in talking:
            if not pending or rank in behind_ranks:
                lines.append(
                    f"rank {rank} waited in communication the flight recorder does not list "
                    f"(a pipeline send or receive), at {where(dumps[rank].stacks)}"
                )
        elif rank in behind_ranks or (not pending and talking):
            roots.append(f"rank {rank} was outside any communication, at {_at(dumps[rank])}")
    missing_dumps = sorted(set(range(world_size)) - set(dumps)) if world_size else []
    if not pending and not talking:
        if missing_dumps:
            roots.append(
                "no rank that left a dump was inside a collective; the rank holding them up "
                "may be one that left none"
            )
        else:
            roots.append(
                "no rank was inside a collective or other communication: the step's own work "
                "(data, compute) outlived --comm.train_timeout_seconds; raise it, or see "
                "where each rank was: "
                + "; ".join(f"rank {r} at {_at(d)}" for r, d in sorted(dumps.items()))
            )
    lines = roots + lines
    if missing_dumps:
        lines.append(
            f"{ranks_text(missing_dumps)} left no dump (stopped before their watchdog fired, or "
            "wrote it to another machine's dump folder)"
        )
    return lines


def _at(dump: RankDump) -> str:
    return where(dump.stacks) + (f" ({dump.stacks})" if dump.stacks else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan.tools.hang_report",
        description="Who a hung job waited for, from its ranks' hang-watchdog dumps.",
    )
    parser.add_argument("folder", help="the run's --job.dump_folder, or its comm_traces/")
    parser.add_argument("--world_size", type=int, default=None, help="ranks the job had")
    args = parser.parse_args(argv)
    dumps = load(args.folder)
    if not dumps:
        print(f"error: no rank*_flight_recorder.json in {args.folder}", file=sys.stderr)
        return 2
    steps = {d.step for d in dumps.values()}
    print(f"{len(dumps)} rank dumps, step {', '.join(str(s) for s in sorted(steps, key=str))}")
    for line in diagnose(dumps, args.world_size):
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
