"""Averaging the weights of several checkpoints into one (``scripts/average_checkpoints.py``).

Llama 3's final weights average the checkpoints of its last annealing steps; averaging the
last few checkpoints of a run is a cheap way to smooth out the noise of the last updates. The
result is a weights-only checkpoint folder like a seed checkpoint: it starts a run
(``--checkpoint.initial_load_path``, in any layout), converts to Hugging Face
(``scripts/convert_hf.py to_hf``) and samples (``python -m torchtitan.generate``). Its
``config.toml`` (and chat template) are the newest source's; ``averaged_from.json`` names the
sources. One process, no process group: each source is read a chunk of tensors at a time, and
the average is summed in float64 and written in the sources' dtype.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.chat_template import TEMPLATE_FILE
from torchtitan.components.checkpoint_files import (
    CONFIG_FILE,
    FROZEN_SOURCE,
    MANIFEST,
    complete_checkpoints,
    manifest_entries,
    manifest_step,
    read_full_model,
    saved_state_keys,
    saved_tensor_metadata,
    verify,
    write_durably,
)
from torchtitan.components.checkpoint_writer import CheckpointWriter
from torchtitan.config.errors import ConfigError

PROVENANCE = "averaged_from.json"
SIDECARS = (CONFIG_FILE, TEMPLATE_FILE, FROZEN_SOURCE)
"""What the newest source's folder holds besides its weights and is copied along."""


def sources(paths: list[Path], last: int | None) -> list[Path]:
    """The step folders to average: ``paths`` themselves, or with ``last`` the newest ``last``
    complete checkpoints of the one checkpoint folder given. ``ConfigError`` names what does
    not fit."""
    if last is not None:
        if len(paths) != 1 or not paths[0].is_dir():
            raise ConfigError("--last K takes one checkpoint folder (holding step-N folders)")
        found = complete_checkpoints(paths[0])
        if len(found) < last:
            raise ConfigError(
                f"--last {last}: {paths[0]} holds {len(found)} complete checkpoint(s)"
                + (f" ({', '.join(p.name for p in found)})" if found else "")
            )
        paths = found[-last:]
    if len(paths) < 2:
        raise ConfigError("averaging needs two checkpoints or more (or --last K with K >= 2)")
    return paths


def check_sources(paths: list[Path]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model tensors every source holds alike (name -> shape, dtype), after verifying each
    source (size and CRC-32 of every file); ``ConfigError`` names the first that differs."""
    model: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
    for path in paths:
        if (problem := verify(path)) is not None:
            raise ConfigError(f"{path}: {problem}")
        if "model" not in saved_state_keys(path):
            raise ConfigError(f"{path} holds no model weights")
        found = {
            fqn.removeprefix("model."): (tuple(meta.size), meta.properties.dtype)
            for fqn, meta in saved_tensor_metadata(path).items()
            if fqn.startswith("model.")
        }
        if model is None:
            model, first = found, path
            continue
        for name in sorted(model.keys() | found.keys()):
            if model.get(name) != found.get(name):
                raise ConfigError(
                    f"{path} and {first} are not the same model: {name} "
                    f"is {_describe(found.get(name))} there, {_describe(model.get(name))} in "
                    f"{first.name}"
                )
    assert model is not None
    return model


def _describe(entry: tuple[tuple[int, ...], torch.dtype] | None) -> str:
    return (
        "missing" if entry is None else f"{list(entry[0])} {str(entry[1]).removeprefix('torch.')}"
    )


def average(paths: list[Path], out: Path, *, chunk_bytes: int = 1 << 30) -> int:
    """Write the mean of ``paths``' model weights to the new folder ``out``; return the step it
    is labelled with (the newest source's). Refuses an ``out`` that exists (nothing is
    overwritten). Floating-point tensors are averaged; others (counters) are the newest's."""
    if out.exists():
        raise ConfigError(f"{out} exists: averaging writes a new folder; pick another --out")
    model = check_sources(paths)
    newest = max(paths, key=manifest_step)
    averaged: dict[str, torch.Tensor] = {}
    for names in _chunks(model, chunk_bytes):
        sums = {n: torch.zeros(model[n][0], dtype=torch.float64) for n in names}
        for path in paths:
            part = read_full_model(path, names)
            for name, tensor in part.items():
                if tensor.is_floating_point():
                    sums[name] += tensor.to(torch.float64)
                elif path == newest:
                    averaged[name] = tensor
        for name, total in sums.items():
            if model[name][1].is_floating_point:
                averaged[name] = (total / len(paths)).to(model[name][1])
    step = manifest_step(newest)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dcp.save({"model": averaged}, storage_writer=CheckpointWriter(str(tmp)), no_dist=True)
    for name in SIDECARS:
        if (newest / name).is_file():
            shutil.copyfile(newest / name, tmp / name)
    provenance = {"sources": [str(p) for p in paths], "steps": [manifest_step(p) for p in paths]}
    write_durably(tmp / PROVENANCE, json.dumps(provenance, indent=1))
    files, crcs = manifest_entries(tmp)
    write_durably(tmp / MANIFEST, json.dumps({"step": step, "files": files, "crc32": crcs}))
    os.replace(tmp, out)
    return step


def _chunks(model: dict[str, tuple[tuple[int, ...], torch.dtype]], limit: int) -> list[list[str]]:
    """The tensor names in groups of about ``limit`` bytes of float64 sums (one tensor alone
    when it is larger)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, (shape, _) in model.items():
        nbytes = 8 * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups
