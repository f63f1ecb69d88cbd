"""Average the model weights of several checkpoints into a new weights-only checkpoint folder.

    # the newest 3 complete checkpoints of a run
    python scripts/average_checkpoints.py outputs/checkpoint --last 3 --out outputs/averaged
    # given steps
    python scripts/average_checkpoints.py outputs/checkpoint/step-80 outputs/checkpoint/step-100 \
        --out outputs/averaged

The result starts a run (``--checkpoint.initial_load_path outputs/averaged``, any layout),
converts to Hugging Face (``scripts/convert_hf.py to_hf outputs/averaged HF_OUT``) and samples
(``python -m torchtitan.generate outputs/averaged``). Every source is verified
first (sizes and CRC-32s) and must hold the same tensors; ``--out`` must not exist. See
``torchtitan/components/checkpoint_average.py`` and docs/checkpoint.md.
"""

import argparse
import sys
import warnings
from pathlib import Path

from torchtitan.components import checkpoint_average
from torchtitan.config.errors import ConfigError

# One process on purpose: DCP's note that it reads and writes without a process group is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sources", type=Path, nargs="+", help="step-N folders, or one folder of them with --last"
    )
    parser.add_argument("--last", type=int, default=None, help="the newest K complete checkpoints")
    parser.add_argument("--out", type=Path, required=True, help="the new folder (must not exist)")
    args = parser.parse_args(argv)
    try:
        for path in args.sources:
            if not path.exists():
                raise ConfigError(f"{path} does not exist")
        paths = checkpoint_average.sources(args.sources, args.last)
        step = checkpoint_average.average(paths, args.out)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = ", ".join(p.name for p in paths)
    print(f"Averaged {len(paths)} checkpoints ({names}) into {args.out} (labelled step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
