"""``python -m torchtitan.launcher [torchrun flags] -m torchtitan.train ...``: torchrun, with
refusals reported as one line.

A rank that refuses its input (exit code 2) or stops on a non-finite step (3) writes its one
line to a file in a folder this launcher makes (``TITAN_FAILURE_DIR``) instead of the console.
When the job fails, the launcher prints the line of the rank that failed first, prefixed by the
rank, whatever ``LOG_RANK`` shows, and exits with that rank's code. torchrun's own report (a
``ChildFailedError`` traceback naming only an exit code) is printed only for failures that are
not refusals: crashes, kills and unexpected exceptions, whose traceback is what a user needs.
``run_train.sh`` and ``multinode_trainer.slurm`` start ranks through it.

The rank side is :func:`refuse`. This module imports torch only inside :func:`main`.
"""

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

FAILURE_DIR_ENV = "TITAN_FAILURE_DIR"


def refuse(code: int, message: str) -> bool:
    """Record this rank's reason to stop (``code`` 2: bad input, 3: non-finite step) for the
    launcher. Returns whether a launcher will print it (else log it yourself)."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return False
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "code": code, "message": message, "time": time.time()}
    path = Path(folder) / f"rank{rank}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(record))
    partial.replace(path)  # the launcher never reads half a record
    return True


def refusals(folder: str | Path) -> list[dict]:
    """Every rank's record in ``folder``, earliest first (empty if no rank refused)."""
    records = []
    for path in Path(folder).glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: (r["time"], r["rank"]))


def format_refusal(record: dict, *, also: Sequence[int] = ()) -> str:
    """``[rank1] error: <message>``, naming the other ranks that refused alike."""
    plural = "s" if len(also) > 1 else ""
    others = f" (rank{plural} {', '.join(map(str, also))} too)" if also else ""
    return f"[rank{record['rank']}] error: {record['message']}{others}"


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # torchrun's own log lines (OMP_NUM_THREADS defaults, closing signals, "failed (exitcode:
    # 2)") are noise to a user; a failure is reported below, in full when it is a crash.
    for name in ("torch.distributed.run", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # torchrun copies the ranks' lines to these streams (TailLog); drop what means nothing.
    sys.stdout, sys.stderr = _Dropping(sys.stdout), _Dropping(sys.stderr)
    folder = tempfile.mkdtemp(prefix="titan-failures-")
    os.environ[FAILURE_DIR_ENV] = folder
    os.environ["TITAN_LAUNCHER"] = "1"  # torchrun prefixes the ranks' lines itself
    os.environ.setdefault("TITAN_RUN_ID", time.strftime("%Y%m%d-%H%M%S"))  # one log folder
    os.environ.setdefault("TITAN_TERMINAL", "1" if sys.stderr.isatty() else "0")
    try:
        torchrun.run(torchrun.parse_args(list(sys.argv[1:] if argv is None else argv)))
        return 0
    except ChildFailedError as e:
        records = refusals(folder)
        if not records:
            print(e.format_msg(), file=sys.stderr)
            return 1
        first, others = records[0], records[1:]
        same = sorted(r["rank"] for r in others if r["message"] == first["message"])
        print(format_refusal(first, also=same), file=sys.stderr)
        return int(first["code"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Dropping:
    """A text stream that passes every line except torch's C++ profiler markers (``USDT:
    ... profiler_start``), which kineto prints on every profiled step."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        # torchrun writes one line per call, after its "[rank0]:" prefix.
        if "USDT:" in text and "profiler_" in text:
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


if __name__ == "__main__":
    sys.stdout.flush()
    sys.exit(main())
