"""Train the project's small byte-level BPE tokenizer and write it as a Llama 3 `tokenizer.model`.

Text is split with the Llama 3 pre-tokenizer regex, the pieces are counted, and then the most
frequent adjacent token pair is merged, repeatedly, until the vocabulary is full. The output lists
one token per line as ``<base64 of the token bytes> <rank>``: ranks 0..255 are the single bytes
(rank == byte value) and rank 256 + i is the i-th merge, so tiktoken, which merges the adjacent
pair of lowest rank first, replays the training merges. The 256 Llama 3 special tokens are not in
the file; `torchtitan.components.tokenizer` appends them after the base ranks.

Usage:
    python scripts/train_tokenizer.py [--vocab_size 2048] [--corpus ...] [--out_dir ...]
"""

from __future__ import annotations

import argparse
import base64
import heapq
import json
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import regex

REPO_ROOT = Path(__file__).resolve().parents[1]
# Scripts run as `python scripts/<name>.py`, which puts scripts/ (not the repo root) on sys.path.
sys.path.insert(0, str(REPO_ROOT))

from torchtitan.components.tokenizer import (  # noqa: E402
    LLAMA3_NUM_RESERVED_SPECIAL_TOKENS,
    LLAMA3_SPLIT_PATTERN,
    Llama3Tokenizer,
)

DEFAULT_CORPUS = REPO_ROOT / "tests" / "assets" / "corpus" / "train.jsonl"
DEFAULT_OUT_DIR = REPO_ROOT / "tests" / "assets" / "tokenizer"
NUM_BYTES = 256

Pair = tuple[int, int]


def read_jsonl_texts(path: Path) -> list[str]:
    """The "text" field of every line of a JSON-lines file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def count_pretokens(texts: Iterable[str]) -> Counter[bytes]:
    """How often each Llama 3 pre-token (as UTF-8 bytes) occurs in `texts`."""
    split = regex.compile(LLAMA3_SPLIT_PATTERN)
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(split.findall(text))
    return Counter({piece.encode("utf-8"): n for piece, n in counts.items()})


class _PairCounts:
    """Weighted counts of adjacent token pairs over the unique words, kept up to date as words
    change, with a lazy max-heap to find the most frequent pair.

    Ties go to the pair whose (left bytes, right bytes) sorts first, which makes training
    deterministic and independent of dict order.
    """

    def __init__(self, vocab: list[bytes]):
        self._vocab = vocab
        self.counts: Counter[Pair] = Counter()
        self.words_with: dict[Pair, set[int]] = {}
        self._heap: list[tuple[int, bytes, bytes, Pair]] = []

    def add_word(self, index: int, word: list[int], freq: int) -> None:
        for pair in zip(word, word[1:], strict=False):
            self.counts[pair] += freq
            self.words_with.setdefault(pair, set()).add(index)

    def update(self, pair: Pair, delta: int, index: int) -> None:
        self.counts[pair] += delta
        if delta > 0:
            self.words_with.setdefault(pair, set()).add(index)
        self._push(pair)

    def build_heap(self) -> None:
        for pair in self.counts:
            self._push(pair)

    def _push(self, pair: Pair) -> None:
        count = self.counts[pair]
        if count > 0:
            left, right = pair
            heapq.heappush(self._heap, (-count, self._vocab[left], self._vocab[right], pair))

    def pop_best(self) -> Pair | None:
        """The most frequent pair (removed from the counts), or None when no pair is left."""
        while self._heap:
            neg_count, _, _, pair = heapq.heappop(self._heap)
            if self.counts.get(pair, 0) == -neg_count:  # otherwise the entry is stale
                del self.counts[pair]
                return pair
        return None


def _merge_word(word: list[int], pair: Pair, new_id: int) -> list[int]:
    left, right = pair
    merged: list[int] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
            merged.append(new_id)
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged


def train_bpe(word_counts: Counter[bytes], num_base_tokens: int) -> list[bytes]:
    """Byte-level BPE: the token bytes of ranks 0..num_base_tokens-1 (fewer if the words run out
    of pairs). Ranks 0..255 are the single bytes; each later rank is the next merge."""
    if num_base_tokens < NUM_BYTES:
        raise ValueError(f"need at least {NUM_BYTES} base tokens, got {num_base_tokens}")
    vocab = [bytes([b]) for b in range(NUM_BYTES)]
    token_ids = {token: i for i, token in enumerate(vocab)}
    ordered = sorted(word_counts.items())
    words = [list(word) for word, _ in ordered]
    freqs = [freq for _, freq in ordered]

    pairs = _PairCounts(vocab)
    for index, (word, freq) in enumerate(zip(words, freqs, strict=True)):
        pairs.add_word(index, word, freq)
    pairs.build_heap()

    while len(vocab) < num_base_tokens:
        best = pairs.pop_best()
        if best is None:
            break
        merged_bytes = vocab[best[0]] + vocab[best[1]]
        # Two different pairs can spell the same bytes ("ab"+"c", "a"+"bc"); such a pair reuses
        # the existing rank, exactly as tiktoken would merge it, instead of adding a duplicate.
        new_id = token_ids.get(merged_bytes)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged_bytes)
            token_ids[merged_bytes] = new_id
        for index in sorted(pairs.words_with.pop(best, ())):
            old = words[index]
            new = _merge_word(old, best, new_id)
            if len(new) == len(old):
                continue  # stale index: the pair left this word in an earlier merge
            freq = freqs[index]
            diff = Counter(zip(new, new[1:], strict=False))
            diff.subtract(Counter(zip(old, old[1:], strict=False)))
            for pair, delta in diff.items():
                if delta and pair != best:
                    pairs.update(pair, delta * freq, index)
            words[index] = new
    return vocab


def write_tokenizer_model(vocab: list[bytes], path: Path) -> None:
    """Write `vocab` in the Llama 3 `tokenizer.model` format: base64 token and rank per line."""
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for rank, token in enumerate(vocab):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def tokens_per_byte(tokenizer: Llama3Tokenizer, texts: list[str]) -> float:
    num_tokens = sum(len(tokenizer.encode(text)) for text in texts)
    return num_tokens / sum(len(text.encode("utf-8")) for text in texts)


def _repo_relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.name


def _readme(
    vocab_size: int, num_base: int, corpus: Path, validation: Path, tokens_per_byte: float
) -> str:
    num_merges = num_base - NUM_BYTES
    first_special = num_base
    return f"""# Bundled test tokenizer

A small byte-level BPE tokenizer in the Llama 3 `tokenizer.model` format, trained by this project
on the bundled corpus, `{_repo_relative(corpus)}`.
`torchtitan.components.tokenizer.build_tokenizer` loads it exactly like the real Llama 3 file, so
tests and CPU runs need no download.

## How it was made

    python scripts/train_tokenizer.py --vocab_size {vocab_size}

Text is split with the Llama 3 pre-tokenizer regex, the pre-tokens are counted, and the most
frequent adjacent pair is merged greedily (ties: smallest pair of byte strings first) until the
vocabulary is full. Training is deterministic.

## Vocabulary layout ({vocab_size} ids)

- `tokenizer.model`: one line per token, `<base64 of the token bytes> <rank>`, {num_base} lines;
  the format `tiktoken.load.load_tiktoken_bpe` reads.
  - ranks 0..255: the single bytes, rank == byte value;
  - ranks 256..{num_base - 1}: the {num_merges} merges in training order.
- ids {first_special}..{vocab_size - 1}: the {LLAMA3_NUM_RESERVED_SPECIAL_TOKENS} Llama 3 special tokens, not stored in
  the file but appended by the tokenizer class: `<|begin_of_text|>` (bos) = {first_special},
  `<|end_of_text|>` (eos) = {first_special + 1}, `<|finetune_right_pad_id|>` (pad) = {first_special + 4}.

Compression on `{_repo_relative(validation)}`: {tokens_per_byte:.3f} tokens per byte of UTF-8 text.

## Licence

Made by this project from the bundled corpus, which is text from Python's documentation under the
PSF License Version 2 (see `tests/assets/corpus/README.md`); the tokenizer is distributed under
the same terms.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vocab_size",
        type=int,
        default=2048,
        help="total vocabulary, including the 256 Llama 3 special tokens",
    )
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="training JSON lines")
    parser.add_argument(
        "--validation",
        type=Path,
        default=None,
        help="JSON lines to measure compression on (default: validation.jsonl next to --corpus)",
    )
    parser.add_argument(
        "--out_dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help="directory for tokenizer.model and README.md",
    )
    args = parser.parse_args(argv)
    num_base = args.vocab_size - LLAMA3_NUM_RESERVED_SPECIAL_TOKENS
    if num_base < NUM_BYTES:
        parser.error(
            f"--vocab_size={args.vocab_size} is too small: it must hold {NUM_BYTES} byte tokens "
            f"and {LLAMA3_NUM_RESERVED_SPECIAL_TOKENS} special tokens, so at least "
            f"{NUM_BYTES + LLAMA3_NUM_RESERVED_SPECIAL_TOKENS}"
        )
    if not args.corpus.is_file():
        parser.error(f"--corpus={args.corpus} not found; build it with scripts/build_corpus.py")

    start = time.perf_counter()
    word_counts = count_pretokens(read_jsonl_texts(args.corpus))
    counted = time.perf_counter()
    vocab = train_bpe(word_counts, num_base)
    trained = time.perf_counter()
    if len(vocab) < num_base:
        sys.exit(
            f"the corpus ran out of pairs after {len(vocab)} tokens; lower --vocab_size to "
            f"{len(vocab) + LLAMA3_NUM_RESERVED_SPECIAL_TOKENS} or use a bigger --corpus"
        )

    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_path = args.out_dir / "tokenizer.model"
    write_tokenizer_model(vocab, model_path)
    tokenizer = Llama3Tokenizer(model_path)
    validation = args.validation or args.corpus.with_name("validation.jsonl")
    if not validation.is_file():
        validation = args.corpus
    tpb = tokens_per_byte(tokenizer, read_jsonl_texts(validation))
    readme = _readme(args.vocab_size, num_base, args.corpus, validation, tpb)
    (args.out_dir / "README.md").write_text(readme, encoding="utf-8")
    print(
        f"{len(word_counts)} unique pre-tokens counted in {counted - start:.1f}s, "
        f"{num_base - NUM_BYTES} merges in {trained - counted:.1f}s; wrote {model_path} "
        f"(vocab_size {tokenizer.vocab_size}, {tpb:.3f} tokens/byte on {validation.name})"
    )


if __name__ == "__main__":
    main()
