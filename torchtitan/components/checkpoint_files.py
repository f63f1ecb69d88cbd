"""What is on disk: complete checkpoint folders, their verification against the manifest, and
what a checkpoint holds (state names, per-rank entries, model tensors, the config that wrote it).

DCP pickles its ``.metadata`` file; ``SafeFileSystemReader`` reads it back with an unpickler
that can only create DCP's own metadata classes, ``torch.Size``, dtypes, layouts, memory
formats and paths, so a crafted checkpoint cannot run code while it is inspected or loaded.
"""

import errno
import functools
import io
import json
import os
import pickle
import re
import shutil
import sys
import tomllib
import zlib
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from torchtitan.config.errors import ConfigError
from torchtitan.distributed import local_tensor

MANIFEST = "manifest.json"
CONFIG_FILE = "config.toml"
"""The resolved config of the run that wrote the checkpoint, next to its shards."""
STEP_DIR = re.compile(r"^step-(\d+)$")
FROZEN_SOURCE = "frozen_source.json"
"""In a LoRA step without the frozen weights (``--lora.save_adapters_only``): where they come
from, and a fingerprint of that folder when the step was saved."""


def complete_checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoint folders, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def verify(path: Path, *, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """``None`` if ``path`` is a complete checkpoint, else what is wrong with it: a missing or
    unreadable manifest, a missing file, a size that differs, or (``checksums``, which reads
    the files) bytes that changed since the save. ``share=(i, n)``: read only every n-th
    file from the i-th (the ranks split the reading; combine their verdicts)."""
    if not path.is_dir():
        return f"{path} does not exist"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path / MANIFEST} is missing or unreadable (incomplete checkpoint)"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, expected {size} (truncated)"
    if checksums:
        index, count = share
        for name, expected in sorted(manifest.get("crc32", {}).items())[index::count]:
            if file_crc32(path / name) != expected:
                return f"{path / name} changed since it was saved (its crc32 differs): corrupt"
    return None


def file_crc32(path: Path | str) -> int:
    """CRC-32 of a file's bytes, read in 16 MiB pieces (zlib: about 1 GB/s per core)."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            crc = zlib.crc32(piece, crc)
    return crc


def _is_weight_file(name: str) -> bool:
    return name.endswith((".safetensors", ".distcp")) or name in (".metadata", "config.json")


def weights_fingerprint(folder: Path) -> dict[str, list[int]]:
    """File name -> [size, CRC-32 of its first and last MiB], for the weight files of
    ``folder`` (an HF folder's safetensors and ``config.json``, a DCP step's shards and
    ``.metadata``): quick for a folder of any size, and unlike sizes alone it tells apart other
    weights of the same shapes."""
    prints = {}
    files = [p for p in folder.iterdir() if p.is_file() and _is_weight_file(p.name)]
    for path in sorted(files):
        size = path.stat().st_size
        with path.open("rb") as f:
            crc = zlib.crc32(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                crc = zlib.crc32(f.read(), crc)
        prints[path.name] = [size, crc]
    return prints


def frozen_source_changed(step: Path, source: Path) -> str | None:
    """``None`` if ``source`` (the frozen weights of an adapters-only LoRA ``step``) has the
    fingerprint the step recorded (or it recorded none), else what differs."""
    try:
        recorded = json.loads((step / FROZEN_SOURCE).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return None
    if not source.is_dir():
        return (
            f"{source}, where the frozen weights of {step} come from (its "
            "--checkpoint.initial_load_path, relative to the working directory), does not exist"
        )
    current = weights_fingerprint(source)
    for name in sorted(recorded.keys() | current.keys()):
        if recorded.get(name) != current.get(name):
            what = "is gone" if name not in current else "changed"
            what = "is new" if name not in recorded else what
            return (
                f"the frozen weights {step} was trained on changed since it was saved: "
                f"{source / name} {what}; restore that folder"
            )
    return None


CHECKSUM_SUFFIX = ".crc32"
"""A sidecar the writing rank leaves next to each file it wrote: that file's CRC-32, taken
while the bytes are still in the page cache; rank 0 moves them into the manifest."""


def record_checksum(path: Path | str) -> None:
    Path(f"{path}{CHECKSUM_SUFFIX}").write_text(str(file_crc32(path)))


def manifest_entries(folder: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Sizes and CRC-32s of the files of a written checkpoint folder (sidecars consumed,
    missing ones computed), for its manifest."""
    sizes, crcs = {}, {}
    for p in sorted(folder.iterdir()):
        if not p.is_file() or p.name.endswith(CHECKSUM_SUFFIX):
            continue
        sizes[p.name] = p.stat().st_size
        sidecar = p.with_name(p.name + CHECKSUM_SUFFIX)
        crcs[p.name] = int(sidecar.read_text()) if sidecar.is_file() else file_crc32(p)
    for sidecar in folder.glob(f"*{CHECKSUM_SUFFIX}"):
        sidecar.unlink()
    return sizes, crcs


def manifest_step(path: Path) -> int:
    """The step a complete (verified) checkpoint folder was saved at, as its manifest says
    (whatever the folder is called: a fork may read a renamed copy)."""
    return int(json.loads((path / MANIFEST).read_text())["step"])


def saved_state_keys(path: Path) -> set[str]:
    """Top-level state names in a checkpoint (``model``, ``optimizer``, ...)."""
    return {fqn.split(".", 1)[0] for fqn in _metadata(path)}


def weights_only_message(folder: Path, path: Path) -> str:
    """Why the model-only checkpoint ``path`` cannot be resumed, and what can be."""
    full = [p.name for p in complete_checkpoints(folder) if saved_state_keys(p) != {"model"}]
    earlier = (
        f"resume from {full[-1]} with --checkpoint.load_step {full[-1].removeprefix('step-')}"
        if full
        else "no earlier checkpoint here holds optimizer state"
    )
    if (path / FROZEN_SOURCE).is_file():  # LoRA adapters without the frozen weights
        return (
            f"checkpoint {path} holds only LoRA adapters (a final save with "
            "--checkpoint.last_save_model_only and --lora.save_adapters_only), so training "
            f"cannot resume from it: {earlier}; torchtitan.generate and scripts/convert_hf.py "
            "to_hf take it as it is (they add the frozen weights it records)"
        )
    return (
        f"checkpoint {path} holds only model weights (a final save with "
        "--checkpoint.last_save_model_only), so training cannot resume from it: "
        f"{earlier}; or start a new run from these weights with "
        f"--checkpoint.initial_load_path {path} and another --job.dump_folder"
    )


def saved_ranks(path: Path, key: str) -> int:
    return sum(1 for fqn in _metadata(path) if fqn.startswith(f"{key}.rank_"))


def saved_replicas(path: Path) -> tuple[int, bool]:
    """The semi-synchronous replicas whose own weights the checkpoint holds (0: none), and
    whether it holds DiLoCo's outer momentum."""
    replica = re.compile(r"semi_sync\.replica(\d+)\.")
    names = _metadata(path)
    momentum = any(fqn.startswith("semi_sync.momentum.") for fqn in names)
    return len({m.group(1) for fqn in names if (m := replica.match(fqn))}), momentum


def saved_tensor_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's tensor entries (global size, dtype) by fully qualified name."""
    return {k: v for k, v in _metadata(path).items() if isinstance(v, TensorStorageMetadata)}


def model_mismatch(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    *,
    partial: bool = False,
    unread: Callable[[str], bool] | None = None,
) -> str | None:
    """``None`` if the checkpoint's model tensors have exactly these names and global shapes,
    else the differences (counted, with one example each). ``partial``: ``shapes`` is a part
    of the model, so tensors of the checkpoint that it lacks are fine; ``unread(name)``: the
    checkpoint's tensors of this kind are not read (they come from elsewhere), so extra ones
    are fine too."""
    saved = {
        fqn.removeprefix("model."): tuple(meta.size)
        for fqn, meta in _metadata(path).items()
        if fqn.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    resized = sorted(k for k in shapes.keys() & saved.keys() if saved[k] != shapes[k])
    missing = sorted(shapes.keys() - saved.keys())
    # DCP would load a smaller model from a bigger checkpoint without a word.
    unexpected = [] if partial else sorted(saved.keys() - shapes.keys())
    unexpected = [k for k in unexpected if unread is None or not unread(k)]
    problems = []
    if resized:
        k = resized[0]
        problems.append(
            f"{len(resized)} tensor(s) differ in shape, e.g. {k} is {list(saved[k])} there "
            f"and {list(shapes[k])} here"
        )
    if missing:
        problems.append(f"{len(missing)} tensor(s) of this model are not in it, e.g. {missing[0]}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} of its tensors are not in this model, e.g. {unexpected[0]}"
        )
    return "; ".join(problems) or None


def saved_config(path: Path) -> dict[str, Any] | None:
    """The resolved config saved with a checkpoint (older checkpoints have none)."""
    try:
        return tomllib.loads((path / CONFIG_FILE).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None


def write_durably(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _metadata(path: Path) -> dict[str, Any]:
    """The checkpoint's tensor and value entries. At scale ``.metadata`` is large and a load
    inspects it several times, so it is unpickled once per file version."""
    stat = (Path(path) / ".metadata").stat()
    return _read_metadata(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read_metadata(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    return SafeFileSystemReader(path).read_metadata().state_dict_metadata


# Modules whose own classes DCP metadata is made of (any class defined there), and single
# names elsewhere that rebuild plain values.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_NAMES = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and module in sys.modules:
            value = getattr(sys.modules[module], name, None)
            if module in _METADATA_MODULES and isinstance(value, type):
                if value.__module__ == module:
                    return value
            if name in _METADATA_NAMES.get(module, ()):
                return value
            if module == "torch" and isinstance(value, _TORCH_VALUES):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with the metadata read by an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with path.open("rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise ConfigError(f"{path} is not DCP checkpoint metadata: {e}") from None
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"{path} is not DCP checkpoint metadata: {type(metadata)} inside")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _errors_in(error: BaseException) -> list[BaseException]:
    """The error, its causes and contexts, and DCP's per-rank failures."""
    seen, todo, found = set(), [error], []
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append(e)
        # DCP's failures are (exception, traceback summary) pairs, one per rank.
        failures = [
            f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()
        ]
        todo += [e.__cause__, e.__context__, *failures]
    return found


def is_disk_full(error: BaseException) -> bool:
    return any(
        getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)
        for e in _errors_in(error)
    )


def is_os_error(error: BaseException) -> bool:
    """A file-system refusal (OSError anywhere in it, or torch's failed-write message)."""
    return any(isinstance(e, OSError) or "file write failed" in str(e) for e in _errors_in(error))


def free_bytes(folder: Path) -> int | None:
    for path in (folder, *folder.parents):
        if path.exists():
            return shutil.disk_usage(path).free
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor values with ``weights_only=False``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_no_dist() -> bool:
    """DCP's ``no_dist``: this process reads and writes the whole state alone."""
    return not torch.distributed.is_initialized()


def safe_load(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` of ``state`` from the checkpoint ``path``, its metadata read by an
    allow-list unpickler and its non-tensor values with ``weights_only=True``."""
    dcp.load(
        state,
        storage_reader=SafeFileSystemReader(str(path)),
        planner=SafeLoadPlanner(),
        no_dist=dcp_no_dist(),
    )


def free_name(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... : the first that does not exist."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def read_full_model(
    path: Path, names: Collection[str] | None = None, *, state: str = "model"
) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint (or those of ``names``), whole, as host tensors (one
    process's view); ``state``: another state's tensors instead (``semi_sync``), by their names
    within it."""
    prefix = f"{state}."
    with local_tensor.host_only():
        tensors = {
            fqn.removeprefix(prefix): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            for fqn, meta in saved_tensor_metadata(path).items()
            if fqn.startswith(prefix) and (names is None or fqn.removeprefix(prefix) in names)
        }
        dcp.load(
            {state: tensors},
            storage_reader=SafeFileSystemReader(str(path)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    return tensors


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers of ``module`` that its state dict (and so a checkpoint) holds, by name."""
    return [
        (f"{prefix}.{name}" if prefix else name, buffer)
        for prefix, sub in module.named_modules()
        for name, buffer in sub.named_buffers(recurse=False)
        if buffer is not None and name not in sub._non_persistent_buffers_set
    ]


_MISSING = re.compile(r"Missing key in checkpoint state_dict: (optimizer\.[\w.]*\w)")


def missing_optimizer_key(error: BaseException) -> str | None:
    """The optimizer state key a failed load missed, when that is every rank's failure (a
    ``CheckpointException`` holds each rank's); else ``None``."""
    failures = getattr(error, "failures", None)
    errors = list(failures.values()) if isinstance(failures, dict) and failures else [error]
    keys = set()
    for e in errors:
        found = _MISSING.search(str(e))
        if found is None:
            return None
        keys.add(found.group(1))
    return sorted(keys)[0]


def other_optimizer_message(path: Path, missing: str) -> str:
    """Why a checkpoint's optimizer state does not load (``missing``: a key it lacks)."""
    saved = None
    try:
        with open(path / CONFIG_FILE, "rb") as f:
            saved = tomllib.load(f).get("optimizer", {}).get("name", "AdamW")
    except (OSError, tomllib.TOMLDecodeError):
        pass
    by = f", saved by --optimizer.name {saved}" if saved else ""
    return (
        f"checkpoint {path} has no {missing} for this run's optimizer (another optimizer's "
        f"state{by}); resume with the optimizer that saved it, or pass "
        "--checkpoint.exclude_from_loading optimizer to start this optimizer's state from zero"
    )
