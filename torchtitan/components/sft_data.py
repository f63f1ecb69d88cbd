"""Supervised fine-tuning data: conversations (``--training.data_format chat``, rows with
``messages``: a list of ``{"role", "content"}``) and prompt/completion pairs
(``prompt_completion``, rows with ``prompt`` and ``completion`` text), trained on the answers.

Each row becomes one sample: a conversation is rendered by the chat template and tokenized as
``transformers`` tokenizes it (the template's special-token strings are special tokens), and
only the assistant turns' tokens are labels; a prompt/completion pair is ``bos + prompt +
completion + eos``, labels on the completion and eos. ``--training.train_on_prompt`` labels
every token. Labels of untrained tokens are ``IGNORE_INDEX``, so the loss is the mean over the
answers' tokens of the global batch.

Under ``--model.attn_mask block_causal`` samples are packed into windows of ``seq_len``
tokens (in order, or first-fit over ``--training.packing_bins`` open windows), each window row carrying ``document_ids`` (one per sample, another for the
padding at its end), so every sample attends only to itself: it trains as if alone. Under
``causal`` each window holds one sample (packing would let samples see each other). A sample
longer than a window is left out (truncating it would train on a cut answer), and so is one
with nothing to train on; each pass reports how many.
"""

import bisect
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchtitan.components.chat_template import (
    ChatTemplate,
    TemplateError,
    find_template,
)
from torchtitan.components.data_sources import FIELDS, HFDataset
from torchtitan.components.dataloader import TextDataset, Tokenizer
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger


class SFTDataset(TextDataset):
    """Samples of one data-parallel shard, packed into ``seq_len`` windows (``pack``) or one
    per window. Yields ``({"input": LongTensor[seq_len]} (+ ``document_ids`` int32 when
    packed), labels: LongTensor[seq_len])``; resumes exactly (the window being filled is part
    of the state)."""

    def __init__(
        self,
        data: HFDataset,
        *,
        data_format: str,
        template: ChatTemplate | None = None,
        train_on_prompt: bool = False,
        pack: bool = True,
        packing_bins: int = 1,
        **reading: Any,
    ):
        """``packing_bins``: windows open at once, filled first-fit (1: in data order).
        ``reading``: ``TextDataset``'s (name, tokenizer, seq_len, dp_rank, dp_world_size,
        infinite)."""
        super().__init__(data, **reading)
        tokenizer = self._tokenizer
        if data_format == "chat" and template is None:
            raise ValueError("data_format 'chat' needs a chat template")
        self._format = data_format
        self._template = template
        self._train_on_prompt = train_on_prompt
        self._pack = pack
        self._pad_id = getattr(tokenizer, "pad_id", None)
        if self._pad_id is None:
            self._pad_id = tokenizer.eos_id
        self._bins = packing_bins
        self._open: list[list[tuple[list[int], list[int]]]] = []  # windows being filled
        self._ready: list[list[tuple[list[int], list[int]]]] = []  # complete, not yet yielded
        self._counts = _PassCounts()

    # ---- samples -----------------------------------------------------------------------------

    def _windows(self, document: dict[str, Any]) -> Iterator[tuple[dict, torch.Tensor]]:
        # Whatever this method yields has left the state first (a checkpoint can be taken at
        # any yield): windows completed by this sample wait in ``_ready``, which is state
        # (a resumed state's are yielded before the next document is read).
        inputs, labels = self._sample(document)
        self._counts.samples += 1
        if all(label == IGNORE_INDEX for label in labels):
            self._counts.untrained += 1
            return
        if len(inputs) > self._seq_len:
            self._counts.too_long += 1
            return
        self._counts.used += 1
        if not self._pack:
            self._ready.append([(inputs, labels)])
        else:
            self._place((inputs, labels))
        yield from self._flush_ready()

    def _place(self, sample: tuple[list[int], list[int]]) -> None:
        """First fit: into the first open window with room; else a new window, after the
        fullest open one leaves when ``packing_bins`` are open. A full window leaves at once.
        (One bin: windows fill in data order.)"""
        size = len(sample[0])
        window = next((w for w in self._open if _filled(w) + size <= self._seq_len), None)
        if window is None:
            if len(self._open) >= self._bins:
                fullest = max(range(len(self._open)), key=lambda i: (_filled(self._open[i]), -i))
                self._ready.append(self._open.pop(fullest))
            window = []
            self._open.append(window)
        window.append(sample)
        if _filled(window) == self._seq_len:
            self._open = [w for w in self._open if w is not window]
            self._ready.append(window)

    def _flush_ready(self) -> Iterator[tuple[dict, torch.Tensor]]:
        while self._ready:
            yield self._row(self._ready.pop(0))

    def _carried_windows(self) -> Iterator[tuple[dict, torch.Tensor]]:
        return self._flush_ready()

    def _sample(self, row: dict[str, Any]) -> tuple[list[int], list[int]]:
        """One row's inputs and labels (each ``len(tokens) - 1``)."""
        if self._format == "chat":
            tokens, trained = self._conversation(row)
        else:
            prompt, completion = (self._text(row, key) for key in FIELDS[self._format])
            first = self._tokenizer.encode(prompt, add_bos=True)
            second = self._tokenizer.encode(completion, add_eos=True)
            tokens = first + second
            trained = [self._train_on_prompt] * len(first) + [True] * len(second)
        labels = [
            t if keep else IGNORE_INDEX for t, keep in zip(tokens[1:], trained[1:], strict=True)
        ]
        return tokens[:-1], labels

    def _conversation(self, row: dict[str, Any]) -> tuple[list[int], list[bool]]:
        messages = row.get("messages")
        problem = _message_problem(messages)
        if problem is not None:
            raise ConfigError(
                f"dataset {self.name}: a row of {self._where} {problem} ({str(row)[:80]}); "
                "--training.data_format chat reads rows with 'messages': a list of "
                "{'role': ..., 'content': text}"
            )
        messages = [{**m} for m in messages]  # (a template must not see the dataset's objects)
        try:
            text, spans, unlocated = self._template.assistant_spans(messages)
        except TemplateError as e:
            raise ConfigError(
                f"dataset {self.name}: the chat template {self._template.where} cannot render "
                f"a row of {self._where} ({e}): {str(row)[:80]}; fix the row or pass another "
                "--training.chat_template"
            ) from None
        self._counts.unlocated += unlocated
        tokens, covered = self._tokenizer.encode_template(text)
        if self._train_on_prompt:
            return tokens, [True] * len(tokens)
        # A token trains if any of its characters is the answer's (a template that opens the
        # answer after "assistant: " has the space in the answer's first token).
        opens = [start for start, _ in spans]
        trained = []
        for start, end in covered:
            i = bisect.bisect_right(opens, end - 1) - 1
            trained.append(i >= 0 and start < spans[i][1] and end > spans[i][0])
        return tokens, trained

    def _text(self, row: dict[str, Any], key: str) -> str:
        value = row.get(key)
        if not isinstance(value, str):
            what = f"no {key!r} field" if value is None else f"a {type(value).__name__} as {key!r}"
            raise ConfigError(
                f"dataset {self.name}: a row of {self._where} has {what} ({str(row)[:80]}); "
                f"--training.data_format {self._format} reads rows with text fields "
                + " and ".join(repr(k) for k in FIELDS[self._format])
            )
        return value

    # ---- windows -----------------------------------------------------------------------------

    def _row(self, samples: list[tuple[list[int], list[int]]]) -> tuple[dict, torch.Tensor]:
        """One window: ``samples`` one after another, then padding (no labels)."""
        pad = self._seq_len - sum(len(inputs) for inputs, _ in samples)
        self._counts.windows += 1
        self._counts.padding += pad
        tokens = [t for inputs, _ in samples for t in inputs] + [self._pad_id] * pad
        labels = [t for _, labels in samples for t in labels] + [IGNORE_INDEX] * pad
        row = {"input": torch.tensor(tokens, dtype=torch.long)}
        if self._pack:
            documents = [i for i, (inputs, _) in enumerate(samples) for _ in inputs]
            documents += [len(samples)] * pad
            row["document_ids"] = torch.tensor(documents, dtype=torch.int32)
        return row, torch.tensor(labels, dtype=torch.long)

    def _last_windows(self) -> Iterator[tuple[dict, torch.Tensor]]:
        self._ready.extend(self._open)
        self._open = []
        yield from self._flush_ready()

    def _check_pass(self, documents: int, *, started_at_first: bool) -> None:
        counts, self._counts = self._counts, _PassCounts()
        seq_len = f"{self._flag}.seq_len {self._seq_len}"
        if counts.samples and not counts.used and started_at_first:
            fix = f"raise {self._flag}.seq_len" if counts.too_long else "check the data"
            if self._worker_note():
                fix += f" or use fewer {self._flag.replace('validation', 'training')}.num_workers"
            raise ConfigError(
                f"dataset {self.name}: none of the {counts.samples} samples of {self._where}"
                f"{self._worker_note()} can train: {counts.reasons(seq_len)}; {fix}"
            )
        if counts.too_long or counts.untrained or counts.unlocated:
            logger.warning(
                f"Dataset {self.name}, {self._where}: {counts.reasons(seq_len)} "
                f"(of {counts.samples} samples this pass)"
            )
        if counts.windows and started_at_first and self._epoch & (self._epoch - 1) == 0:
            logger.info(
                f"Dataset {self.name}, {self._where}: {counts.used} samples in "
                f"{counts.windows} windows this pass, "
                f"{counts.padding / (counts.windows * self._seq_len):.0%} of their tokens padding"
            )

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "seq_len": self._seq_len,
            "pack": self._pack,
            "open": [[list(pair) for pair in window] for window in self._open],
            "ready": [[list(pair) for pair in window] for window in self._ready],
        }

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        saved = (state["seq_len"], state["pack"])
        if saved != (self._seq_len, self._pack):

            def how(seq_len, pack):
                mask = "block_causal" if pack else "causal"
                return f"--training.seq_len {seq_len} and --model.attn_mask {mask}"

            raise ConfigError(
                f"dataloader state holds fine-tuning windows cut for {how(*saved)}, this run "
                f"has {how(self._seq_len, self._pack)}; resume with those or pass "
                "--checkpoint.exclude_from_loading dataloader"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "open" in state:
            windows = state["open"]
        else:  # a state from before first-fit packing: one window being filled
            windows = [state["pending"]] if state["pending"] else []
        self._open = [[(list(i), list(lab)) for i, lab in window] for window in windows]
        self._ready = [[(list(i), list(lab)) for i, lab in window] for window in state["ready"]]
        while len(self._open) > self._bins:  # resumed with fewer bins: the fullest leave
            fullest = max(range(len(self._open)), key=lambda i: (_filled(self._open[i]), -i))
            self._ready.append(self._open.pop(fullest))


def _filled(window: list[tuple[list[int], list[int]]]) -> int:
    return sum(len(inputs) for inputs, _ in window)


class _PassCounts:
    """What one pass did with its samples."""

    def __init__(self) -> None:
        self.samples = self.used = self.too_long = self.untrained = self.unlocated = 0
        self.windows = self.padding = 0

    def reasons(self, seq_len: str) -> str:
        parts = []
        if self.too_long:
            parts.append(f"{self.too_long} longer than {seq_len} left out")
        if self.untrained:
            parts.append(f"{self.untrained} with no answer tokens to train on left out")
        if self.unlocated:
            parts.append(
                f"{self.unlocated} assistant turns not trained on: the chat template renders "
                "the conversation before them differently from the whole one"
            )
        return "; ".join(parts) or "none left out"


def _message_problem(messages: Any) -> str | None:
    """What is wrong with a row's ``messages``, or ``None``."""
    if messages is None:
        return "has no 'messages' field"
    if not isinstance(messages, list) or not messages:
        return f"has {type(messages).__name__} 'messages', not a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"has a message {i} without a 'role'"
        if not isinstance(m.get("content"), str):
            return f"has a message {i} whose 'content' is not text"
    return None


def load_chat_template(
    tokenizer: Tokenizer, *, tokenizer_path: str, override: str | None
) -> ChatTemplate:
    """The run's chat template (``--training.chat_template``, else the tokenizer folder's),
    compiled, its ``bos_token`` / ``eos_token`` / ``pad_token`` spelled as ``tokenizer``'s."""
    names = {"eos_token": tokenizer.eos_id}
    if getattr(tokenizer, "has_bos", True):  # (Qwen's has none: its eos frames documents)
        names["bos_token"] = tokenizer.bos_id
    if getattr(tokenizer, "pad_id", None) is not None:
        names["pad_token"] = tokenizer.pad_id
    special = {name: tokenizer.token_name(i) for name, i in names.items()}
    template = find_template(tokenizer_path, override, special)
    logger.info(f"Chat template: {template.where}")
    return template


def sft_datasets(
    data_format: str,
    *,
    template: ChatTemplate | None,
    train_on_prompt: bool,
    pack: bool,
    packing_bins: int = 1,
) -> Callable[..., SFTDataset] | None:
    """What ``build_dataloader`` makes its dataset with for ``--training.data_format``
    (``None``: text, its default)."""
    if data_format == "text":
        return None
    if not pack:
        logger.info(
            "Fine-tuning samples: one per window (--model.attn_mask causal would let packed "
            "samples see each other; block_causal packs them)"
        )
    return functools.partial(
        SFTDataset,
        data_format=data_format,
        template=template,
        train_on_prompt=train_on_prompt,
        pack=pack,
        packing_bins=packing_bins,
    )
