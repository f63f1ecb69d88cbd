"""The data path's cost: documents read as text (tokenized while training) against the same
documents pre-tokenized (``--training.dataset tokens``, memory-mapped windows).

    python benchmarks/bench_data.py                      # the bundled corpus, 8 x 2048 windows
    python benchmarks/bench_data.py --seq_len 8192 --batches 100 --tokenizer assets/hf/Llama-3.1-8B

Prints, for each path, the loader's tokens/s over ``--batches`` batches (one process, no
workers: what one rank's main process spends), and a rank's start-up to its first batch in a
fresh process (imports, opening the data, the first batch; median of 3), and how fast
``scripts/pretokenize.py`` writes the corpus with 1 and 2 workers. Nothing else should run
beside it.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_START = """
import sys, time, json
start = time.perf_counter()
from torchtitan import train  # what a rank imports
from torchtitan.components.dataloader import build_dataloader
from torchtitan.components.tokenizer import build_tokenizer
imported = time.perf_counter()
loader = build_dataloader(dataset=sys.argv[1], dataset_path=sys.argv[2] or None,
    tokenizer=build_tokenizer(sys.argv[3]), seq_len=int(sys.argv[4]), local_batch_size=8,
    dp_rank=0, dp_world_size=1)
next(iter(loader))
print(json.dumps({"import_s": imported - start, "first_batch_s": time.perf_counter() - start,
                  "datasets_imported": "datasets" in sys.modules}))
"""


def throughput(dataset: str, path: str | None, tokenizer: str, seq_len: int, batches: int) -> float:
    from torchtitan.components.dataloader import build_dataloader
    from torchtitan.components.tokenizer import build_tokenizer
    from torchtitan.tools.logging import logger

    logger.setLevel("ERROR")  # the re-loop warnings of a small corpus
    loader = build_dataloader(
        dataset=dataset, dataset_path=path, tokenizer=build_tokenizer(tokenizer),
        seq_len=seq_len, local_batch_size=8, dp_rank=0, dp_world_size=1,
    )  # fmt: skip
    it = iter(loader)
    next(it)  # opened and started
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * 8 * seq_len / (time.perf_counter() - start)


def start_up(dataset: str, path: str | None, tokenizer: str, seq_len: int) -> dict:
    runs = []
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", _START, dataset, path or "", tokenizer, str(seq_len)],
            cwd=REPO, capture_output=True, text=True, check=True,
        )  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        "import_s": statistics.median(r["import_s"] for r in runs),
        "first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
        "datasets_imported": runs[0]["datasets_imported"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="python_docs")
    parser.add_argument("--dataset_path", default=None)
    parser.add_argument("--tokenizer", default="tests/assets/tokenizer")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        written = {}
        for workers in (1, 2):
            out = work / f"tokens_{workers}"
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "scripts/pretokenize.py", "--out", str(out), "--dataset",
                 args.dataset, "--tokenizer", args.tokenizer, "--workers", str(workers)]
                + (["--dataset_path", args.dataset_path] if args.dataset_path else []),
                cwd=REPO, check=True, capture_output=True,
            )  # fmt: skip
            written[workers] = time.perf_counter() - start
        tokens = json.loads((work / "tokens_1" / "meta.json").read_text())["tokens"]
        print(
            f"pretokenize.py: {tokens:,} tokens in {written[1]:.1f} s with 1 worker, "
            f"{written[2]:.1f} s with 2 (whole process, start-up included)"
        )
        rows = {
            "text": (args.dataset, args.dataset_path),
            "tokens": ("tokens", str(work / "tokens_1")),
        }
        print(f"\n{'path':8} {'tokens/s':>12} {'import s':>9} {'to 1st batch s':>15}  datasets")
        for name, (dataset, path) in rows.items():
            rate = throughput(dataset, path, args.tokenizer, args.seq_len, args.batches)
            started = start_up(dataset, path, args.tokenizer, args.seq_len)
            print(
                f"{name:8} {rate:12,.0f} {started['import_s']:9.2f} "
                f"{started['first_batch_s']:15.2f}  "
                f"{'imported' if started['datasets_imported'] else 'not imported'}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
