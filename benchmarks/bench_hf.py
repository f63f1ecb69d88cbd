"""Hugging Face export and import time, one process on this CPU (fp32 weights).

    python benchmarks/bench_hf.py [--flavors debugmodel debug_100m]

For each Llama 3 flavor: write the model as an HF folder (``checkpoint_hf.save_hf``), read it
back into a fresh model (``load_hf_``), and load it with ``transformers`` when installed.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from torchtitan.components import checkpoint_hf
from torchtitan.models.llama3.args import flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.tools.logging import quiet_known_torch_notices


def _model(args) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def main() -> None:
    quiet_known_torch_notices(cuda=torch.cuda.is_available())
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flavors", nargs="+", default=["debugmodel", "debug_100m"])
    args = parser.parse_args()
    print(
        f"{'flavor':<12}{'params':>14}{'bytes':>16}{'export s':>10}{'import s':>10}{'HF load s':>11}"
    )
    for flavor in args.flavors:
        margs = flavors[flavor]
        adapter = Llama3StateDictAdapter(margs)
        model = _model(margs)
        n = sum(p.numel() for p in model.parameters())
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "hf"
            start = time.perf_counter()
            checkpoint_hf.save_hf(
                [model], adapter, folder, dtype=torch.float32, writer=True, pipelined=False
            )
            export = time.perf_counter() - start
            size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            fresh = _model(margs)
            start = time.perf_counter()
            checkpoint_hf.load_hf_([fresh], adapter, folder)
            load = time.perf_counter() - start
            hf_load = float("nan")
            try:
                import transformers

                transformers.utils.logging.disable_progress_bar()
                start = time.perf_counter()
                transformers.LlamaForCausalLM.from_pretrained(folder)
                hf_load = time.perf_counter() - start
            except ImportError:
                pass
        print(f"{flavor:<12}{n:>14,}{size:>16,}{export:>10.2f}{load:>10.2f}{hf_load:>11.2f}")


if __name__ == "__main__":
    main()
