"""Convert weights between our checkpoints (DCP) and Hugging Face folders, in one process.

    # any saved step (not only the last) to a folder transformers loads
    python scripts/convert_hf.py to_hf outputs/checkpoint/step-10 outputs/hf-step-10 \
        [--dtype bfloat16]
    # an HF folder to a weights-only DCP checkpoint (step-0, like a seed checkpoint)
    python scripts/convert_hf.py from_hf HF_FOLDER outputs/from_hf [--module qwen3]
    # a tiktoken tokenizer.model to tokenizer.json + tokenizer_config.json (the same ids)
    python scripts/convert_hf.py tokenizer tests/assets/tokenizer tests/assets/tokenizer_hf

The model family and flavor of a step come from the ``config.toml`` saved with it (else pass
``--module`` and ``--flavor``); for an HF folder the flavor is the one whose shapes match its
``config.json`` (or ``--flavor``). A training run reads HF folders directly too:
``--checkpoint.initial_load_path HF_FOLDER``.

``to_hf`` writes the tokenizer the step's run used (its ``config.toml``; ``--tokenizer`` to pick
another) into the folder as ``tokenizer.json``, so ``transformers.AutoTokenizer`` loads it too;
``from_hf`` records an HF folder's tokenizer as the checkpoint's ``--model.tokenizer_path``.
"""

import argparse
import json
import sys
import tomllib
import warnings
from pathlib import Path

import torch

from torchtitan.components import checkpoint_hf, hf_config
from torchtitan.components.chat_template import TEMPLATE_FILE
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpoint_files import CONFIG_FILE
from torchtitan.components.checkpoint_states import ModelState
from torchtitan.components.tokenizer import (
    Llama3Tokenizer,
    build_tokenizer,
    find_tokenizer_file,
)
from torchtitan.components.tokenizer_export import save_hf_tokenizer
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Checkpoint
from torchtitan.models.spec import get_model_spec
from torchtitan.tools.paths import resolve_path

# One process on purpose: DCP's note that it saves without a process group is noise here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _model(spec, flavor: str, seq_len: int | None = None) -> torch.nn.Module:
    """The flavor's model, initialised; ``seq_len``: the training's (it sizes the RoPE table,
    and DeepSeek-V3 scales its rotary embedding beyond its original length)."""
    args = spec.flavors[flavor]
    if seq_len is not None:
        args = spec.args_for(flavor, seq_len=seq_len)
    with torch.device("meta"):
        model = spec.build_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def to_hf(
    step: Path, out: Path, module: str | None, flavor: str | None, dtype: str,
    tokenizer_path: Path | None = None,
) -> None:  # fmt: skip
    if out.exists() and any(out.iterdir()):  # before the minutes a large model takes to load
        raise ConfigError(f"{out} exists and is not empty: choose another folder or remove it")
    saved, seq_len, run = {}, None, {}
    if (step / CONFIG_FILE).is_file():
        run = tomllib.loads((step / CONFIG_FILE).read_text())
        saved, seq_len = run["model"], run.get("training", {}).get("seq_len")
        module, flavor = module or saved["name"], flavor or saved["flavor"]
    if module is None or flavor is None:
        raise ConfigError(f"{step} has no {CONFIG_FILE}: pass --module and --flavor")
    spec = get_model_spec(module)
    model = _model(spec, flavor, seq_len)
    # LoRA adapters folded into their layers' weights: the HF model is a plain one.
    args = spec.flavors[flavor] if seq_len is None else spec.args_for(flavor, seq_len=seq_len)
    state = checkpoint_hf.read_model_state(step, run, spec, args)
    wanted = model.state_dict().keys()
    missing, extra = sorted(wanted - state.keys()), sorted(state.keys() - wanted)
    if missing or extra:
        raise ConfigError(
            f"{step} is not a checkpoint of {module} {flavor}: "
            + (f"no {missing[0]} ({len(missing)} missing)" if missing else "")
            + (", " if missing and extra else "")
            + (f"{extra[0]} is not in the model ({len(extra)} such)" if extra else "")
            + "; pass the --module and --flavor it was trained with"
        )
    model.load_state_dict(state)
    if tokenizer_path is None and "tokenizer_path" in saved:
        tokenizer_path = resolve_path(saved["tokenizer_path"])
    tokenizer = None
    if tokenizer_path is not None:
        tokenizer = build_tokenizer(tokenizer_path)
        vocab = spec.flavors[flavor].vocab_size
        if tokenizer.vocab_size > vocab:
            raise ConfigError(
                f"--tokenizer {tokenizer_path} has {tokenizer.vocab_size} tokens, more than "
                f"{flavor}'s vocabulary of {vocab}: pass the model's own tokenizer"
            )
    # A fine-tuning run's steps hold its chat template: the export carries it.
    template = step / TEMPLATE_FILE
    checkpoint_hf.save_hf(
        [model], spec.state_dict_adapter(args), out, dtype=DTYPES[dtype],
        writer=True, pipelined=False, tokenizer=tokenizer,
        chat_template=template.read_text() if template.is_file() else None,
    )  # fmt: skip
    if tokenizer is None:
        print(f"{module} {flavor} weights written to {out}; no tokenizer: {step} records none "
              "(pass --tokenizer PATH to add one)")  # fmt: skip
    else:
        print(f"{module} {flavor} weights and the tokenizer {tokenizer_path} written to {out}")


def from_hf(folder: Path, out: Path, module: str, flavor: str | None) -> None:
    spec = get_model_spec(module)
    flavor = flavor or hf_config.matching_flavor(spec, folder)
    seq_len = checkpoint_hf.read_config(folder).get("max_position_embeddings")
    model = _model(spec, flavor, seq_len)
    # The folder's own tokenizer, where it has one, is what the checkpoint was trained with.
    tokenizer = find_tokenizer_file(folder)
    tokenizer_line = (
        ""
        if tokenizer is None
        else f"tokenizer_path = {json.dumps(str(folder.resolve()), ensure_ascii=False)}\n"
    )
    checkpoint_hf.load_hf_([model], spec.state_dict_adapter(model.args), folder)
    manager = CheckpointManager(
        Checkpoint(enable=True, folder=out.name), dump_folder=str(out.parent),
        states={"model": ModelState([model])}, device_type="cpu",
        run_config=f'[model]\nname = "{module}"\nflavor = "{flavor}"\n' + tokenizer_line,
    )  # fmt: skip
    manager.save(0, model_only=True)
    print(f"{module} {flavor} weights written to {out / 'step-0'}")


def tokenizer_to_hf(source: Path, out: Path, model_max_length: int) -> None:
    tokenizer = build_tokenizer(source)
    if not isinstance(tokenizer, Llama3Tokenizer):
        raise ConfigError(f"{source}: already a Hugging Face tokenizer ({tokenizer.path})")
    out.mkdir(parents=True, exist_ok=True)
    for path in save_hf_tokenizer(tokenizer, out, model_max_length):
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("direction", choices=["to_hf", "from_hf", "tokenizer"])
    parser.add_argument(
        "source", type=Path, help="a step-N folder (to_hf), an HF folder or a tokenizer.model"
    )
    parser.add_argument(
        "out", type=Path, help="the HF folder (to_hf, tokenizer) or a checkpoint folder"
    )
    parser.add_argument(
        "--module", default=None,
        help="model family (from_hf: found from config.json's model_type, else llama3)",
    )  # fmt: skip
    parser.add_argument("--flavor", default=None)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument(
        "--tokenizer", type=Path, default=None,
        help="to_hf: the tokenizer to write (default: the one the step's run used)",
    )  # fmt: skip
    parser.add_argument(
        "--model_max_length", type=int, default=131072,
        help="tokenizer: the longest sequence tokenizer_config.json states",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not args.source.exists():
        what = {"to_hf": "a step-N checkpoint folder", "from_hf": "a Hugging Face model folder"}
        print(
            f"error: {args.source} does not exist (the source: "
            f"{what.get(args.direction, 'a tokenizer file or folder')})",
            file=sys.stderr,
        )
        return 2
    try:
        if args.direction == "to_hf":
            to_hf(args.source, args.out, args.module, args.flavor, args.dtype, args.tokenizer)
        elif args.direction == "tokenizer":
            tokenizer_to_hf(args.source, args.out, args.model_max_length)
        else:
            module = args.module or hf_config.hf_family(args.source) or "llama3"
            from_hf(args.source, args.out, module, args.flavor)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
