"""Tokenize a dataset once into token shards that training memory-maps
(``--training.dataset tokens --training.dataset_path OUT``; docs/data.md#pre-tokenized-data).

Reads any dataset training reads (a registered name, ``files`` with a path, a local C4 copy),
frames every document with the tokenizer's bos and eos as the training loader does, and writes
``OUT/tokens-NNNNN.bin`` shards of whole documents plus ``OUT/meta.json``. Documents keep
their order whatever ``--workers`` is (the output is byte-identical). Nothing existing is
overwritten; the folder is written as ``OUT.partial`` and renamed when complete (a failed or
interrupted run removes its ``OUT.partial``; a killed one leaves it, and the next run says so).

    python scripts/pretokenize.py --out /tmp/python_docs_tokens
    python scripts/pretokenize.py --dataset files --dataset_path 'data/*.jsonl' \\
        --tokenizer assets/hf/Llama-3.1-8B --out data_tokens --workers 8
    python scripts/pretokenize.py --verify data_tokens     # every shard's CRC-32
"""

import argparse
import collections
import multiprocessing
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy

from torchtitan.components.data_sources import DATASETS, open_dataset
from torchtitan.components.token_shards import (
    ShardWriter,
    TokenFolder,
    open_folder,
    tokenizer_fingerprint,
)
from torchtitan.components.token_shards import verify as verify_folder
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.config.errors import ConfigError
from torchtitan.tools.paths import resolve_path

_ROWS = 256  # documents per task handed to a worker


def _load(tokenizer_path: str) -> None:
    global _TOKENIZER
    _TOKENIZER = build_tokenizer(resolve_path(tokenizer_path))


def _encode(texts: list[str]) -> tuple[numpy.ndarray, list[int]]:
    """The documents' ids back to back, each framed by bos and eos (as ``TextDataset``), and
    each one's length."""
    ids: list[int] = []
    lengths = []
    for text in texts:
        before = len(ids)
        ids.extend(_TOKENIZER.encode(text, add_bos=True, add_eos=True))
        lengths.append(len(ids) - before)
    return numpy.asarray(ids, dtype=numpy.int64), lengths


def _texts(data: Any, text_key: str, name: str) -> Any:
    """Lists of ``_ROWS`` documents' texts, in the data's order; a row without text refused."""
    for batch in data.iter(batch_size=_ROWS):
        texts = batch[text_key]
        for text in texts:
            if not isinstance(text, str):
                raise ConfigError(
                    f"dataset {name}: a row has {type(text).__name__} as {text_key!r}, not text"
                )
        yield texts


def pretokenize(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer_path: str,
    out: Path,
    workers: int = 1,
    shard_tokens: int = 1 << 28,
    max_tokens: int | None = None,
) -> None:
    """Write ``out`` (see the module docstring); ``max_tokens``: stop at the first document
    boundary at or past that many tokens (to take a part of a large stream)."""
    tokenizer = build_tokenizer(resolve_path(tokenizer_path))
    data, text_key = open_dataset(dataset, dataset_path, data_format="text")
    writer = ShardWriter(out, vocab_size=tokenizer.vocab_size, shard_tokens=shard_tokens)
    started = time.monotonic()
    try:
        folder = _write(writer, data, text_key, tokenizer, tokenizer_path=tokenizer_path,
                        dataset=dataset, dataset_path=dataset_path, workers=workers,
                        max_tokens=max_tokens)  # fmt: skip
    except BaseException:  # this run's own unfinished folder, Ctrl-C included
        shutil.rmtree(writer.partial, ignore_errors=True)
        raise
    seconds = time.monotonic() - started
    print(
        f"wrote {folder.tokens:,} tokens of {folder.documents:,} documents in "
        f"{len(folder.shards)} shard(s) of {folder.dtype} to {out} in {seconds:.1f} s "
        f"({folder.tokens / seconds:,.0f} tokens/s)"
    )


def _write(
    writer: ShardWriter,
    data: Any,
    text_key: str,
    tokenizer: Any,
    *,
    tokenizer_path: str,
    dataset: str,
    dataset_path: str | None,
    workers: int,
    max_tokens: int | None,
) -> TokenFolder:
    """Tokenize ``data``'s documents into ``writer`` and close it (``pretokenize``)."""
    out = writer.folder
    started = last = time.monotonic()
    pending: collections.deque = collections.deque()
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(workers, _load, (tokenizer_path,)) if workers > 1 else None
    if pool is None:
        _load(tokenizer_path)

    def write(encoded: tuple[numpy.ndarray, list[int]]) -> bool:
        nonlocal last
        ids, lengths = encoded
        if max_tokens is not None:  # only the documents up to the one that reaches it
            ends = numpy.cumsum(lengths)
            keep = int(numpy.searchsorted(ends, max_tokens - writer.tokens, side="left")) + 1
            ids, lengths = ids[: int(ends[min(keep, len(ends)) - 1])], lengths[:keep]
        writer.add(ids, lengths)
        if time.monotonic() - last > 10:
            last = time.monotonic()
            rate = writer.tokens / (last - started)
            print(f"{writer.documents:,} documents, {writer.tokens:,} tokens ({rate:,.0f}/s)")
        return max_tokens is not None and writer.tokens >= max_tokens

    try:
        done = False
        for texts in _texts(data, text_key, dataset):
            if pool is None:
                done = write(_encode(texts))
            else:  # at most 2 tasks a worker in flight: a stream is not read ahead whole
                pending.append(pool.apply_async(_encode, (texts,)))
                if len(pending) >= 2 * workers:
                    done = write(pending.popleft().get())
            if done:
                break
        while pending and not done:
            done = write(pending.popleft().get())
    finally:
        if pool is not None:
            pool.terminate()
    if writer.documents == 0:
        raise ConfigError(f"dataset {dataset} has no documents; nothing written to {out}")
    return writer.close(
        tokenizer={
            "path": tokenizer_path,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
            "fingerprint": tokenizer_fingerprint(tokenizer),
        },
        source={"dataset": dataset, "path": dataset_path, "max_tokens": max_tokens},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="the folder to write (must not exist)")
    parser.add_argument("--verify", type=Path, help="check a written folder's CRC-32s instead")
    parser.add_argument("--dataset", default="python_docs", help="a --training.dataset name")
    parser.add_argument("--dataset_path", default=None, help="as --training.dataset_path")
    parser.add_argument(
        "--tokenizer", default="tests/assets/tokenizer", help="as --model.tokenizer_path"
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument(
        "--shard_tokens", type=int, default=1 << 28,
        help="start a new shard once one holds this many tokens (default 2^28: 512 MiB of uint16)",
    )  # fmt: skip
    parser.add_argument(
        "--max_tokens", type=int, default=None,
        help="stop at the first document boundary at or past this many tokens",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.verify is not None:
            folder = open_folder(args.verify, given=f"--verify {args.verify}")
            bad = verify_folder(folder)
            for line in bad:
                print(f"error: {line}", file=sys.stderr)
            if not bad:
                print(
                    f"{args.verify}: {len(folder.shards)} shard(s), {folder.tokens:,} tokens, sound"
                )
            return 1 if bad else 0
        if args.out is None:
            parser.error("give --out (or --verify)")
        if args.workers < 1:
            raise ConfigError(f"--workers {args.workers} must be at least 1")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ConfigError(f"--max_tokens {args.max_tokens} must be positive")
        if args.dataset == "tokens":
            raise ConfigError(
                "--dataset tokens is pre-tokenized already; give the documents it was made from"
            )
        kind = DATASETS[args.dataset].data_format if args.dataset in DATASETS else "text"
        if kind != "text":
            raise ConfigError(
                f"--dataset {args.dataset} holds {kind} rows; pre-tokenized data is text "
                "documents (fine-tuning samples are read from their rows in training)"
            )
        pretokenize(
            dataset=args.dataset, dataset_path=args.dataset_path, tokenizer_path=args.tokenizer,
            out=args.out, workers=args.workers, shard_tokens=args.shard_tokens,
            max_tokens=args.max_tokens,
        )  # fmt: skip
    except (ConfigError, FileNotFoundError) as e:
        # Training's flags named as this script spells them.
        message = str(e)
        for flag, here in (
            ("--training.dataset_path", "--dataset_path"),
            ("--training.dataset ", "--dataset "),
            ("--model.tokenizer_path", "--tokenizer"),
        ):
            message = message.replace(flag, here)
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
