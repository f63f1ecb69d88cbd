"""Write the bundled fine-tuning conversations, ``tests/assets/chat/{train,validation}.jsonl``.

Made offline from the bundled corpus (Python's documentation): each row is ``{"messages":
[...]}`` with questions about the documented functions and modules (answered with the first
sentence of their documentation) and two tasks a small model learns in a few hundred steps:
repeating a list of words and reversing it. Some conversations open with a system message, some
have two question-answer turns. Deterministic: the same corpus gives the same files.

    python scripts/make_chat_demo.py
"""

import json
import random
import re
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests/assets/corpus/train.jsonl"
OUT = ROOT / "tests/assets/chat"
SYSTEM = "You answer questions about Python's standard library in one sentence."
HEADING = re.compile(r"^(#{1,2}) (?:Module )?([A-Za-z_][\w.]*)\n\n(.+?)(?:\n\n|\Z)", re.M | re.S)
SENTENCE = re.compile(r"^(.+?[.!?])(?:\s|$)", re.S)


def facts() -> list[tuple[str, str]]:
    """(question, answer) pairs: the first sentence under each documented name."""
    pairs = []
    for line in CORPUS.read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        for level, name, paragraph in HEADING.findall(text):
            first = SENTENCE.match(" ".join(paragraph.split()))
            if first is None or not 10 <= len(first.group(1)) <= 160:
                continue
            if level == "#":
                question = f"What is the {name} module for?"
            else:
                question = f"What does {name} do?"
            pairs.append((question, first.group(1)))
    return pairs


def words() -> list[str]:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    text = "\n".join(json.loads(line)["text"] for line in lines)
    return sorted({w for w in re.findall(r"\b[a-z]{3,9}\b", text)})


def task(rng: random.Random, vocabulary: list[str]) -> tuple[str, str]:
    chosen = rng.sample(vocabulary, rng.randint(3, 7))
    if rng.random() < 0.5:
        return f"Repeat these words: {' '.join(chosen)}", " ".join(chosen)
    return f"Reverse these words: {' '.join(chosen)}", " ".join(reversed(chosen))


def conversations(pairs: list, vocabulary: list[str], count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
        for _ in range(2 if rng.random() < 0.25 else 1):
            question, answer = rng.choice(pairs) if rng.random() < 0.5 else task(rng, vocabulary)
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        rows.append({"messages": messages})
    return rows


def main() -> None:
    pairs = facts()
    # Held-out questions: about one name in ten, picked by a hash of the question.
    held_out = [p for p in pairs if zlib.crc32(p[0].encode()) % 10 == 0]
    train = [p for p in pairs if zlib.crc32(p[0].encode()) % 10 != 0]
    vocabulary = words()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, chosen, count, seed in (
        ("train", train, 3000, 0),
        ("validation", held_out, 200, 1),
    ):
        rows = conversations(chosen, vocabulary, count, seed)
        with open(OUT / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{OUT / name}.jsonl: {len(rows)} conversations")


if __name__ == "__main__":
    main()
