"""How checkpoint files are staged and written: host buffers reused across async saves, files
dropped from the page cache once synced, and background saves at the lowest CPU priority."""

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from torchtitan.components.checkpoint_files import record_checksum
from torchtitan.tools.logging import logger


def stager_for(async_mode: str, device_type: str) -> DefaultStager | None:
    """How a background save copies the state to host memory before writing it.

    ``None`` for synchronous saves. Otherwise a ``DefaultStager`` kept for the whole run, so the
    host buffers the first save allocates are reused by every later one (allocating them again
    each time, DCP's default, made every save pay the first one's page faults: 1.5 s instead of
    0.2 s for 1.25 GB on a 2-core CPU host). ``async`` copies on the training thread;
    ``async_with_pinned_mem`` on a GPU copies into pinned buffers with non-blocking copies while
    the next step computes (``wait_for_staging`` joins them before the optimizer step).
    """
    if async_mode == "disabled":
        return None
    pinned = async_mode == "async_with_pinned_mem"
    if pinned and device_type != "cuda":
        logger.warning(
            "--checkpoint.async_mode async_with_pinned_mem needs a GPU (pinned host memory); "
            "using plain async"
        )
        pinned = False
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned,
            use_shared_memory=False,
            use_async_staging=pinned,
            use_non_blocking_copy=pinned,
        )
    )
    return reusable(stager)


def reusable(stager: DefaultStager) -> DefaultStager:
    """``stager``, able to stage more than once on every torch we support.

    torch 2.11 closes the inner state-dict stager after every stage: its buffers are freed (no
    reuse) and its copier table emptied, so the next stage fails with ``KeyError: <class
    'type'>``. This keeps it open until :func:`close_stager` (torch 2.13 does not close it per
    stage: no change there)."""
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None:
        stager._titan_close_inner = inner.close
        inner.close = lambda: None
    return stager


def close_stager(stager: DefaultStager | None) -> None:
    """Close a stager from :func:`stager_for`, its host buffers included."""
    if stager is None:
        return
    stager.close()
    getattr(stager, "_titan_close_inner", lambda: None)()


class UncachedFileSystem(FileSystem):
    """Local files that leave the page cache once written and synced.

    A checkpoint is written once and read back rarely, so its pages only push the dataset and
    everything else out of the cache. On the 2-core CPU host we measure on, letting them
    accumulate also made writing cost 4-5 s of kernel CPU per GB instead of 0.4-1 s.
    """

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            yield stream
        if "w" in mode and not str(path).endswith(".tmp"):  # DCP renames .tmp files: skip
            record_checksum(path)  # read back from the page cache, before dropping it
        if "w" in mode and hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)  # only clean pages can be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer with the page-cache drop above; ``background`` (async saves) runs the
    whole save (planning and writing) at the lowest CPU priority.

    Where the host's cores also compute the training step (CPU training, or a GPU host with few
    cores per rank), the save would otherwise take CPU time from the step; at nice 19 it uses
    the cycles training leaves idle. (Niced only while writing, with the planning at normal
    priority, the step after a save was slower on a 2-core host: 1.27x against 1.09x.) Linux
    sets the priority per thread, and DCP calls ``set_up_storage_writer`` on the thread that
    runs the save; elsewhere this is a no-op.
    """

    def __init__(self, path: str, *, background: bool = False):
        super().__init__(path)
        self.fs = UncachedFileSystem()
        self.background = background

    def set_up_storage_writer(self, *args: Any, **kwargs: Any) -> None:
        if self.background:
            lower_priority()
        super().set_up_storage_writer(*args, **kwargs)


def lower_priority() -> None:
    """Run the calling thread at nice 19 (Linux sets priorities per thread)."""
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
