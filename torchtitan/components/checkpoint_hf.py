"""Hugging Face checkpoint folders (``config.json`` + safetensors shards + their index) in and
out of a parallelized model, one tensor at a time.

Import (:func:`load_hf_`): every rank memory-maps the shards (``safetensors.safe_open``) and,
for each of its parameters, reads the one HF tensor it needs, converts it to our layout
(the model family's state-dict adapter) and keeps its own shard of it (``distribute_tensor``
without communication). No rank ever holds more than one full tensor beyond its shards, and no
collective runs: any parallel layout, any number of ranks.

Export (:func:`save_hf`): every parameter's full tensor is gathered where it lives (its
DTensor mesh); the first rank of each pipeline stage writes that stage's tensors as shards of
at most ``max_shard_bytes``; rank 0 writes ``model.safetensors.index.json`` and ``config.json``.

LoRA: an import fills the frozen weights (the adapters keep their initialisation); an export
folds each adapter into its layer's weight (``W + alpha / r * B A``), a plain HF model.

DCP's own Hugging Face reader/writer (torch >= 2.8) is not used: it maps tensors by name only,
and Llama's rotary layout needs a permutation of whole query/key matrices on the way.
"""

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.components import lora
from torchtitan.components.checkpoint_files import (
    free_name,
    frozen_source_changed,
    persistent_buffers,
    read_full_model,
)
from torchtitan.components.hf_config import (
    CONFIG,
    INDEX,
    SINGLE,
    FusedPart,
    is_hf_folder,
    read_config,
)
from torchtitan.components.hf_quantization import quantization
from torchtitan.components.peft_export import PeftAdapters, peft_problem, write_peft
from torchtitan.components.tokenizer_export import save_hf_tokenizer
from torchtitan.config.errors import ConfigError
from torchtitan.distributed import local_tensor
from torchtitan.tools.logging import logger
from torchtitan.tools.module_names import clean_name
from torchtitan.tools.paths import resolve_path

MAX_SHARD_BYTES = 5 * 2**30


@dataclasses.dataclass
class HFIO:
    """A run's Hugging Face import and export (what the checkpoint manager calls)."""

    model_parts: Sequence[nn.Module]
    adapter: Any
    writer: bool
    """This rank writes its pipeline stage's tensors (the stage's first rank)."""
    pipelined: bool
    tokenizer: Any = None
    """The run's tokenizer: its bos/eos ids go in ``config.json``, its files next to it."""
    chat_template: str | None = None
    """The chat template the run fine-tuned with, written next to the tokenizer."""

    def load(self, folder: str | os.PathLike) -> None:
        load_hf_(self.model_parts, self.adapter, folder)

    def save(
        self,
        folder: str | os.PathLike,
        dtype: torch.dtype,
        *,
        peft_folder: str | os.PathLike | None = None,
        base_model: str | None = None,
    ) -> None:
        """Export to ``folder`` (and LoRA adapters to ``peft_folder``, see ``save_hf``); one
        there already (another run's) is moved aside first, to ``<folder>.replaced``, as
        checkpoints are."""
        for path in (Path(folder), peft_folder and Path(peft_folder)):
            if path and _rank() == 0 and path.exists():
                aside = free_name(path.with_name(path.name + ".replaced"))
                os.replace(path, aside)
                logger.warning(f"{path} existed (not written by this run): moved to {aside}")
        _barrier()
        save_hf(
            self.model_parts, self.adapter, folder, dtype=dtype, writer=self.writer,
            pipelined=self.pipelined, tokenizer=self.tokenizer, chat_template=self.chat_template,
            peft_folder=peft_folder, base_model=base_model,
        )  # fmt: skip


class _Shards:
    """The tensors of an HF folder by name, read lazily from memory-mapped files; quantized
    ones (``hf_quantization``) come back dequantized to float32 under their plain names."""

    def __init__(self, folder: Path):
        self.folder = folder
        if (folder / INDEX).is_file():
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        else:
            with safe_open(folder / SINGLE, "pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE)
        self.quantization = quantization(read_config(folder), str(folder))
        self._all: dict[str, str] = weight_map
        self.files: list[str] = self.quantization.names(list(weight_map))
        self._open: dict[str, Any] = {}

    def _raw(self, name: str) -> torch.Tensor:
        file = self._all[name]
        if file not in self._open:
            self._open[file] = safe_open(self.folder / file, "pt")
        return self._open[file].get_tensor(name)

    def get(self, name: str) -> torch.Tensor:
        return self.quantization.read(name, self._raw, self._all.keys())


def read_tensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder, by name (small models: it loads them all)."""
    shards = _Shards(Path(folder))
    return {name: shards.get(name) for name in shards.files}


@torch.no_grad()
def load_hf_(model_parts: Sequence[nn.Module], adapter, folder: str | os.PathLike) -> None:
    """Fill every parameter of ``model_parts`` from the HF folder (shapes checked against the
    flavor first: a mismatch is a one-line ``ConfigError``)."""
    folder = Path(folder)
    where = str(folder)
    config = read_config(folder)
    adapter.check_hf_config(config, where)
    shards = _Shards(folder)
    if shards.quantization.description:
        logger.info(f"{where}: {shards.quantization.description}")
    available = set(shards.files)
    tied = getattr(adapter.args, "tie_word_embeddings", False)
    embedding, head = "model.embed_tokens.weight", "lm_head.weight"
    if tied and head in available and not torch.equal(shards.get(head), shards.get(embedding)):
        raise ConfigError(
            f"{where}: the HF model's output projection (lm_head) differs from its embedding, "
            "which this --model.flavor ties; pick an untied flavor"
        )
    for part in model_parts:
        full_state = {}
        for name, tensor in _mapped_tensors(part, adapter):
            if lora.is_adapter_name(name):  # the HF model is the frozen one: they keep their init
                continue
            ours = clean_name(name)
            sources = adapter.source_names(ours, available)
            missing = [s for s in sources if s not in available]
            if missing:
                raise ConfigError(f"{where}: no tensor {missing[0]} (for our {ours}) in the folder")
            full = adapter.from_hf(ours, {s: shards.get(s) for s in sources}).to(tensor.dtype)
            if tuple(full.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"{where}: {sources[0]} gives shape {tuple(full.shape)}, our {ours} "
                    f"{tuple(tensor.shape)}"
                )
            if local_tensor.is_simulating():
                full_state[ours] = full  # every simulated rank cuts its shards below
            elif isinstance(tensor, DTensor):
                mine = distribute_tensor(
                    full, tensor.device_mesh, tensor.placements, src_data_rank=None
                )
                tensor.to_local().copy_(mine.to_local())
            else:
                tensor.copy_(full)
        if full_state:
            adapters = {
                clean_name(n) for n, _ in part.named_parameters() if lora.is_adapter_name(n)
            }
            local_tensor.copy_full_state_(part, full_state, leave_out=adapters)
    logger.info(f"Loaded {len(available)} tensors of the Hugging Face model {folder}")


@torch.no_grad()
def save_hf(
    model_parts: Sequence[nn.Module],
    adapter,
    folder: str | os.PathLike,
    *,
    dtype: torch.dtype,
    writer: bool,
    pipelined: bool,
    tokenizer: Any = None,
    chat_template: str | None = None,
    peft_folder: str | os.PathLike | None = None,
    base_model: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write the model as an HF folder. Every rank calls it (the gathers are collectives);
    ``writer``: this rank writes its pipeline stage's tensors (the first rank of the stage).
    ``tokenizer`` (a run's, or ``None``): its bos/eos ids go in ``config.json`` and rank 0
    writes it as ``tokenizer.json`` + ``tokenizer_config.json`` (``save_hf_tokenizer``). LoRA
    adapters are folded into their layers; with ``peft_folder`` they are also written there
    in PEFT's format, for the HF model ``base_model`` (``peft_export``)."""
    folder = Path(folder)
    # What the HF model cannot express is refused on every rank before any write or collective.
    model_type = adapter.hf_config(tied=False, dtype=dtype, bos_id=None, eos_id=None).get(
        "model_type"
    )
    lost = [name for part in model_parts for name in _state_without_a_place(part, adapter)]
    occupied = folder.exists() and any(folder.iterdir())
    gathered = _gather([lost, occupied])  # before any rank creates the folder
    if any(o for _, o in gathered):  # every rank raises: none waits in a collective below
        raise ConfigError(
            f"{folder} exists and is not empty: an export never writes over files (old shards "
            "would mix with new ones); choose another folder or remove it"
        )
    lost = sorted({name for rank_lost, _ in gathered for name in rank_lost})
    if lost:
        more = f" (and {len(lost) - 1} more like it)" if len(lost) > 1 else ""
        raise ConfigError(
            f"{lost[0]}{more} is not zero and {adapter.architecture} has no place for it: the "
            f"exported model would compute differently, so nothing was written to {folder}. "
            "An MoE routing bias moves with --moe.load_balance_coeff > 0 and stays as a "
            "checkpoint holds it: export runs trained with --moe.load_balance_coeff 0 from "
            "the start (--moe.aux_loss_coeff balances instead)"
        )
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, list[FusedPart]] = {}
    embedding = output = None
    peft = PeftAdapters(model_type) if peft_folder is not None else None
    for part in model_parts:
        for name, param in _mapped_tensors(part, adapter):
            if lora.is_adapter_name(name):  # folded into their layer's weight
                continue
            full = _full(param)
            owner = part.get_submodule(name.rpartition(".")[0])
            ours = clean_name(name)
            if lora.is_adapted(owner) and name.endswith(".weight"):
                a, b = _full(owner.lora_a), _full(owner.lora_b)
                if peft is not None and writer:
                    peft.add(adapter, ours, a, b, owner.lora_scale)
                full = lora.merged_weight(full, a, b, owner.lora_scale)
            if ours == "tok_embeddings.weight":
                embedding = full
            elif ours == "output.weight":
                output = full
            if writer:
                for hf, t in adapter.to_hf(ours, full).items():
                    # Routing tensors the HF model keeps in float32: a bias step of 1e-3
                    # is under bf16's spacing near 0.5 and would change the experts chosen.
                    fp32 = hf.endswith(getattr(adapter, "keep_in_fp32", ()))
                    out = torch.float32 if fp32 else dtype
                    if isinstance(t, FusedPart):  # assembled once every part is here
                        parts.setdefault(hf, []).append(t)
                        if len(parts[hf]) == t.count:
                            tensors[hf] = _fuse(parts.pop(hf), out)
                    else:
                        tensors[hf] = t.to(out).contiguous()
    adapters = _peft_parts(peft) if peft is not None else []
    # Tied when our output is the embedding (a tied flavor, or untouched since a tied import);
    # stages of a pipeline hold them apart: exported untied.
    tied = not pipelined and (
        output is None or (embedding is not None and torch.equal(output, embedding))
    )
    if tied:
        tensors.pop("lm_head.weight", None)
    chunks = _chunks(tensors, max_shard_bytes) if writer else []
    counts = _gather([len(chunks)])
    total = sum(c[0] for c in counts)
    first = sum(c[0] for c in counts[: _rank()])
    if writer or _rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    _barrier()
    weight_map: dict[str, str] = {}
    for k, chunk in enumerate(chunks):
        file = f"model-{first + k + 1:05d}-of-{total:05d}.safetensors"
        save_file(chunk, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(chunk, file)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    gathered = _gather([weight_map, size])
    if _rank() == 0:
        merged = {k: v for m, _ in gathered for k, v in m.items()}
        size = sum(n for _, n in gathered)
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(merged.items()))}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        bos_id, eos_id = (None, None) if tokenizer is None else (tokenizer.bos_id, tokenizer.eos_id)
        config = adapter.hf_config(tied=tied, dtype=dtype, bos_id=bos_id, eos_id=eos_id)
        (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            try:
                save_hf_tokenizer(
                    tokenizer,
                    folder,
                    config.get("max_position_embeddings", 0),
                    chat_template=chat_template,
                )
            except (OSError, ValueError) as e:  # the weights stand; the other ranks wait below
                logger.warning(f"Tokenizer not written to {folder}: {e}")
        logger.info(f"Hugging Face model written to {folder} ({total} shard(s), {size:,} bytes)")
        if adapters:
            try:
                written = write_peft(
                    Path(peft_folder), adapters, dtype=dtype, base_model=base_model
                )
                logger.info(
                    f"LoRA adapters written to {peft_folder} in PEFT's format ({written:,} bytes)"
                )
            except OSError as e:  # the merged export stands; the other ranks wait below
                logger.warning(f"LoRA adapters not written to {peft_folder}: {e}")
    _barrier()


def _peft_parts(peft: PeftAdapters) -> list[PeftAdapters]:
    """Every rank's PEFT adapters on rank 0 (others: ``[]``), if they have a PEFT form
    together; else a warning from rank 0 and ``[]`` everywhere. Every rank calls it."""
    summaries = _gather([peft.without_tensors()])  # small: every rank decides alike
    problem = peft_problem([s for (s,) in summaries])
    if problem is not None:
        if _rank() == 0:
            logger.warning(
                f"LoRA adapters not written in PEFT's format: {problem}; the merged HF export "
                "is (an MoE model's attention adapters alone have one: --lora.target_modules "
                "naming its attention layers)"
            )
        return []
    if not any(s.settings for (s,) in summaries):
        return []  # no adapters at all
    if not dist.is_initialized():
        return [peft]
    # The tensors to rank 0 only: every rank gathering everything would hold world-size
    # copies of every adapter.
    out: list | None = [None] * dist.get_world_size() if _rank() == 0 else None
    dist.gather_object(peft, out, dst=0)
    return list(out) if out is not None else []


def read_model_state(step: Path, run: dict[str, Any], spec, args) -> dict[str, torch.Tensor]:
    """The whole model of a ``step-N`` folder (``run``: its saved config) as one process sees
    it, LoRA adapters folded into their layers' weights. A LoRA run's adapters-only step
    (``--lora.save_adapters_only``) is completed first with the frozen weights of the run's
    ``--checkpoint.initial_load_path`` (an HF folder or a ``step-N``)."""
    state = read_full_model(step)
    settings = run.get("lora") or {}
    if settings.get("save_adapters_only") and any(lora.is_adapter_name(k) for k in state):
        source = (run.get("checkpoint") or {}).get("initial_load_path")
        if not source or not resolve_path(source).exists():
            raise ConfigError(
                f"{step} holds LoRA adapters without the frozen weights, which its run read from "
                f"--checkpoint.initial_load_path {source}: that path is not here"
            )
        source = resolve_path(source)
        if (changed := frozen_source_changed(step, source)) is not None:
            raise ConfigError(changed)
        logger.info(f"Frozen weights of {step} from {source}")
        if is_hf_folder(source):
            with torch.device("meta"):
                model = spec.build_model(args)
            model.to_empty(device="cpu")
            model.init_weights()
            load_hf_([model], spec.state_dict_adapter(args), source)
            base = model.state_dict()
        else:
            base = read_full_model(source)
        state = {k: v for k, v in base.items() if not lora.is_adapter_name(k)} | state
    return lora.merge_state_dict(state, lora.scale_of(settings))


def _fuse(parts: list[FusedPart], dtype: torch.dtype) -> torch.Tensor:
    """The HF tensor the ``parts`` make, in ``dtype``."""
    first = parts[0]
    shape = list(first.tensor.shape)
    shape[first.dim] *= first.count
    fused = first.tensor.new_empty(shape, dtype=dtype)
    for part in parts:
        part.place(fused)
    return fused


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered on every rank of its mesh for a DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def _mapped_tensors(part: nn.Module, adapter) -> list[tuple[str, torch.Tensor]]:
    """The parameters of ``part``, and the buffers the adapter maps (e.g. MoE expert biases),
    by name."""
    buffers = []
    for name, buffer in part.named_buffers():
        try:
            adapter.hf_names(clean_name(name))
        except KeyError:
            continue
        buffers.append((name, buffer))
    return [*part.named_parameters(), *buffers]


def _state_without_a_place(part: nn.Module, adapter) -> list[str]:
    """Our names of the saved buffers of ``part`` that the adapter does not map and that are
    not all zero (an export would drop state that changes the model's outputs: a learned MoE
    routing bias where the HF model has none). Zero ones are the HF model's implicit value."""
    lost = []
    for name, buffer in persistent_buffers(part):
        try:
            adapter.hf_names(clean_name(name))
        except KeyError:
            if bool(buffer.detach().ne(0).any()):
                lost.append(clean_name(name))
    return lost


def _chunks(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of at most ``limit`` bytes (a larger tensor alone)."""
    chunks: list[dict[str, torch.Tensor]] = []
    size = limit
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if size + nbytes > limit:
            chunks.append({})
            size = 0
        chunks[-1][name] = t
        size += nbytes
    return chunks


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(value: list) -> list[list]:
    """Every rank's ``value`` in rank order."""
    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def build_hfio(
    spec, model_args, model_parts, tokenizer, parallel_dims, chat_template: str | None = None
) -> HFIO | None:
    """The run's :class:`HFIO`, or ``None`` where the model family has no adapter."""
    if spec.state_dict_adapter is None:
        return None
    writer = True
    if parallel_dims.meshes_built and not local_tensor.is_simulating():
        coordinate = parallel_dims.mesh("world").get_coordinate()  # (pp, dp_r, dp_s, cp, tp)
        writer = not any(coordinate[1:])
    return HFIO(
        model_parts=model_parts,
        adapter=spec.state_dict_adapter(model_args),
        writer=writer,
        pipelined=parallel_dims.pp_enabled,
        tokenizer=tokenizer,
        chat_template=chat_template,
    )
