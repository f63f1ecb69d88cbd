"""Sample text from a trained model: greedy, or temperature and top-k, seeded.

    python -m torchtitan.generate CHECKPOINT --prompt "def parse(" [--max_new_tokens 60]
        [--temperature 0.8 --top_k 50 --seed 0] [--module llama3 --flavor debugmodel]
    torchrun --nproc_per_node 2 -m torchtitan.generate CHECKPOINT --tp 2 --prompt "def "

``CHECKPOINT`` is a run's ``step-N`` folder (the family and flavor come from the config saved
with it), a run's dump folder (its newest complete checkpoint), or a Hugging Face folder (the
flavor whose shapes match). One process, or tensor parallel over torchrun's ranks, on the GPU
when there is one. The loop runs the whole
sequence through the model for every new token (no KV cache): meant for looking at what a
model learned, not for serving.
"""

import argparse
import os
import sys
import tomllib
import warnings
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from torchtitan.config.errors import ConfigError

# One process on purpose: DCP's note that it reads without a process group is noise here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
# A small model's greedy text repeats one token; a mildly sampled one shows what it learned.
SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.7, 50
DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1] / "tests/assets/tokenizer"


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_tokens: Collection[int] = (),
    max_seq_len: int | None = None,
) -> list[int]:
    """The new token ids after ``prompt``: greedy at ``temperature`` 0, else sampled from the
    softmax of ``logits / temperature`` over the ``top_k`` most likely tokens (0: all), with a
    generator seeded by ``seed`` (the same ids for the same seed). Stops at ``stop_tokens``; the
    context is cut to the last ``max_seq_len`` tokens (the model's RoPE table)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = tokens if max_seq_len is None else tokens[:, -max_seq_len:]
        logits = model(context)[0, -1].float()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        new.append(token)
        if token in stop_tokens:
            break
        tokens = torch.cat([tokens, tokens.new_tensor([[token]])], dim=1)
    return new


def print_sample(trainer, validation) -> None:
    """After training: a continuation of ``validation.sample_prompt`` by the trained model
    (sampled at ``SAMPLE_TEMPERATURE``, seeded), logged by rank 0. Every rank runs the same
    forward passes (data-parallel ranks gather their parameters together); layouts that split
    the sequence, the vocabulary or the model (TP, CP, PP) are skipped with a notice."""
    from torchtitan.tools.logging import logger

    dims = trainer.parallel_dims
    if dims.tp_enabled or dims.cp_enabled or dims.pp_enabled or trainer.tokenizer is None:
        saved = trainer.config.checkpoint.enable
        after = "on the last checkpoint" if saved else "on a checkpoint (--checkpoint.enable)"
        logger.info(
            "--validation.sample_prompt: no sample under tensor, context or pipeline "
            f"parallelism; run python -m torchtitan.generate {after}"
        )
        return
    (model,) = trainer.model_parts
    tokenizer = trainer.tokenizer
    prompt, stops = prompt_ids(tokenizer, validation.sample_prompt, trainer.chat_template)
    model.eval()
    with trainer.runner.autocast:
        new = generate(
            model, prompt, max_new_tokens=validation.sample_tokens,
            temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K, seed=0, stop_tokens=stops,
            max_seq_len=trainer.model_args.max_seq_len,
        )  # fmt: skip
    model.train()
    shown = tokenizer.decode(prompt) if trainer.chat_template else validation.sample_prompt
    text = (shown + tokenizer.decode(new)).replace("\n", "\n    ")
    logger.info(
        f"Sample ({len(new)} tokens at temperature {SAMPLE_TEMPERATURE}, top-k {SAMPLE_TOP_K}, "
        f"seed 0):\n    {text}"
    )


def prompt_ids(tokenizer, text: str, chat_template=None) -> tuple[list[int], set[int]]:
    """The ids that prompt the model with ``text``, and the tokens that end its answer: eos,
    and under a chat template (``ChatTemplate``), ``text`` is a user turn and the answer also
    ends at the template's end-of-turn token."""
    if chat_template is None:
        return tokenizer.encode(text, add_bos=True), {tokenizer.eos_id}
    ids, end_of_turn = chat_template.prompt(tokenizer, text)
    return ids, {tokenizer.eos_id} | ({end_of_turn} if end_of_turn is not None else set())


def model_folder(path: Path) -> Path:
    """A ``step-N`` checkpoint or an HF folder as given, a dump folder's newest step."""
    from torchtitan.components import checkpoint_hf
    from torchtitan.components.checkpoint_files import complete_checkpoints

    if checkpoint_hf.is_hf_folder(path) or (path / ".metadata").is_file():  # (DCP's)
        return path
    found = complete_checkpoints(path / "checkpoint")
    if not found:
        raise ConfigError(
            f"{path}: not a step-N checkpoint, a dump folder with checkpoints (pass "
            "--checkpoint.enable when training) or a Hugging Face folder"
        )
    return found[-1]


@torch.no_grad()
def load_model(
    path: Path, module: str | None, flavor: str | None, device: torch.device, tp: int = 1
):
    """The model of ``path`` (a ``step-N`` folder, a dump folder or an HF folder), its
    flavor's args and its tokenizer path: the one the run used, an HF folder's own, else the
    bundled one. ``tp > 1``: the model's tensor-parallel plan over this torchrun's ranks
    (without sequence and loss parallelism: every rank gets the whole logits and samples the
    same token)."""
    from torchtitan.components import checkpoint_hf, hf_config
    from torchtitan.components.checkpoint_files import (
        CONFIG_FILE,
        persistent_buffers,
    )
    from torchtitan.components.tokenizer import find_tokenizer_file
    from torchtitan.models.spec import get_model_spec
    from torchtitan.tools.paths import resolve_path

    tokenizer = DEFAULT_TOKENIZER
    path = model_folder(path)
    seq_len = None  # the training's: the RoPE table (DeepSeek-V3 scales beyond its original)
    run: dict = {}
    if (path / CONFIG_FILE).is_file():
        run = tomllib.loads((path / CONFIG_FILE).read_text())
        saved = run.get("model", {})
        module, flavor = module or saved.get("name"), flavor or saved.get("flavor")
        tokenizer = resolve_path(saved.get("tokenizer_path", tokenizer))
        seq_len = run.get("training", {}).get("seq_len")
    if module is None and checkpoint_hf.is_hf_folder(path):
        module = hf_config.hf_family(path)
    spec = get_model_spec(module or "llama3")
    if checkpoint_hf.is_hf_folder(path):
        flavor = flavor or hf_config.matching_flavor(spec, path)
        seq_len = seq_len or checkpoint_hf.read_config(path).get("max_position_embeddings")
        if find_tokenizer_file(path) is not None:  # exported with its tokenizer
            tokenizer = path
    if flavor is None:
        raise ConfigError(f"{path} has no {CONFIG_FILE}: pass --module and --flavor")
    args = spec.flavors[flavor] if seq_len is None else spec.args_for(flavor, seq_len=seq_len)
    with torch.device("meta"):
        model = spec.build_model(args)
    if tp > 1:
        model = _tensor_parallel(model, spec, flavor, tp, device)
    model.to_empty(device=device)
    model.init_weights()
    if checkpoint_hf.is_hf_folder(path):
        checkpoint_hf.load_hf_([model], spec.state_dict_adapter(args), path)
    else:
        # LoRA adapters folded into their layers: the plain model computes the adapted one.
        state = checkpoint_hf.read_model_state(path, run, spec, args)
        for name, param in model.named_parameters():
            if name not in state:
                raise ConfigError(f"{path} has no {name}: not a checkpoint of {flavor}")
            param.copy_(_placed_like(param, state[name].to(device, param.dtype)))
        for name, buffer in persistent_buffers(model):  # e.g. an MoE routing bias: it routes
            if name in state:
                buffer.copy_(state[name].to(device, buffer.dtype))
    # One line, not one per tensor-parallel rank.
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"Loaded {spec.name} {flavor} from {path}", file=sys.stderr)
    return model.eval(), args, tokenizer


def _tensor_parallel(model: nn.Module, spec, flavor: str, tp: int, device: torch.device):
    """``model`` (on meta) parallelized by its family's plan, TP only."""
    from torchtitan.config.manager import parse_args
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.spec import ParallelizeContext

    config = parse_args(
        ["--module", spec.name, "--model.flavor", flavor, "--parallelism.tensor_parallel_degree",
         str(tp), "--parallelism.no_enable_sequence_parallel",
         "--parallelism.disable_loss_parallel"],
        console_outputs=False,
    )  # fmt: skip
    world = dist_utils.init_distributed(device=device, init_timeout_seconds=300, trace_buf_size=0)
    if world != tp:
        raise ConfigError(
            f"--tp {tp} needs {tp} ranks (torchrun --nproc_per_node {tp}), not {world}"
        )
    dims = ParallelDims.from_config(config.parallelism, world)
    dims.build_mesh(device.type)
    return spec.parallelize(model, ParallelizeContext.from_config(config, dims))


def _placed_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` as ``param`` is placed (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max_new_tokens", type=int, default=60)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="0: every token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--module", default=None)
    parser.add_argument("--flavor", default=None)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--seq_len", type=int, default=2048, help="longest context fed back")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (torchrun)")
    parser.add_argument(
        "--chat", action="store_true", help="the prompt is a user turn of the chat template"
    )
    parser.add_argument(
        "--chat_template", default=None, help="Jinja file (default: the tokenizer folder's)"
    )
    a = parser.parse_args(argv)
    from torchtitan.components.chat_template import TEMPLATE_FILE
    from torchtitan.components.sft_data import load_chat_template
    from torchtitan.components.tokenizer import build_tokenizer
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools.logging import quiet_known_torch_notices

    device = dist_utils.local_device()
    quiet_known_torch_notices(cuda=device.type == "cuda")
    try:
        model, args, tokenizer_path = load_model(a.checkpoint, a.module, a.flavor, device, a.tp)
        tokenizer = build_tokenizer(a.tokenizer or tokenizer_path)
        template = None
        if a.chat or a.chat_template:
            # A fine-tuning run's steps hold the template it trained with.
            saved = model_folder(a.checkpoint) / TEMPLATE_FILE
            override = a.chat_template or (str(saved) if saved.is_file() else None)
            where = str(a.tokenizer or tokenizer_path)
            template = load_chat_template(tokenizer, tokenizer_path=where, override=override)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt, stops = prompt_ids(tokenizer, a.prompt, template)
    new = generate(
        model, prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
        top_k=a.top_k, seed=a.seed, stop_tokens=stops,
        max_seq_len=min(a.seq_len, args.max_seq_len),
    )  # fmt: skip
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        shown = tokenizer.decode(prompt) if template is not None else a.prompt
        print(shown + tokenizer.decode(new))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch's CPU build sometimes aborts at interpreter exit after a clean shutdown
    # (TORCH_ON_CPU.md, "Exit crash"); everything is flushed, so skip it.
    os._exit(code)
