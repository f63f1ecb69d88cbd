"""Several datasets in one training stream (``--training.dataset_mix``).

Each dataset keeps its own reader (shard, position, epochs, packing buffer), and the stream
takes its next window from the dataset furthest below its share: after ``n`` windows each
dataset has given ``weight x n`` of them to within about one window (within one for two
datasets), in a fixed order that depends on nothing but the weights. Mixing whole windows (not documents) makes the shares shares of
tokens, whatever the datasets' document lengths. The state is every reader's state and the
window counts, so a resume continues exactly; a resume with another mix keeps the place of the
datasets both mixes name and starts the counts over.
"""

import math
from collections.abc import Iterator, Sequence
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger


def mix_order(weights: Sequence[float], windows: Sequence[int]) -> int:
    """The dataset the next window comes from: the one furthest below ``weights`` (summing
    to 1) given the ``windows`` each has given; ties go to the first."""
    total = sum(windows) + 1
    return max(range(len(weights)), key=lambda i: (weights[i] * total - windows[i], -i))


class MixedDataset(IterableDataset, Stateful):
    """Interleaves the windows of ``sources`` (endless ``TextDataset``-like readers, one per
    entry of ``labels``) in the shares ``weights`` (normalised here)."""

    def __init__(self, sources: Sequence[Any], labels: Sequence[str], weights: Sequence[float]):
        total = sum(weights)
        self.sources = list(sources)
        self.labels = list(labels)
        self.weights = [w / total for w in weights]
        self.name = "+".join(self.labels)
        self._windows = [0] * len(self.sources)
        shares = ", ".join(
            f"{label} {100 * w:.1f}%" for label, w in zip(self.labels, self.weights, strict=True)
        )
        logger.info(f"Dataset mix (shares of the windows): {shares}")

    def __iter__(self) -> Iterator[Any]:
        readers = [iter(source) for source in self.sources]
        while True:
            i = mix_order(self.weights, self._windows)
            window = next(readers[i])
            self._windows[i] += 1
            yield window

    @property
    def windows(self) -> dict[str, int]:
        """How many windows each dataset has given since the counts (re)started."""
        return dict(zip(self.labels, self._windows, strict=True))

    def state_dict(self) -> dict[str, Any]:
        return {
            "mix": list(self.labels),
            "weights": list(self.weights),
            "windows": list(self._windows),
            "sources": [source.state_dict() for source in self.sources],
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse (one line) a saved state this mix cannot continue: one dataset's that the
        mix does not name, or reader states of another format or window length (each judged
        by the reader of its name; those of datasets the mix drops are not loaded)."""
        if "mix" in state:
            for label, source_state in zip(state["mix"], state["sources"], strict=True):
                if label in self.labels:
                    self.sources[self.labels.index(label)].check_state(source_state)
            return
        saved = self._single_source(state)
        if saved is None:
            raise ConfigError(
                f"dataloader state was saved reading {state.get('dataset', 'one dataset')} alone "
                f"(--training.dataset), which --training.dataset_mix does not name "
                f"({', '.join(self.labels)}); add it to the mix or pass "
                "--checkpoint.exclude_from_loading dataloader"
            )
        self.sources[saved].check_state(state)

    def _single_source(self, state: dict[str, Any]) -> int | None:
        """Which of this mix's datasets one dataset's saved state is (a state older than the
        names in states is the only dataset of a mix of one)."""
        if "dataset" not in state:
            return 0 if len(self.labels) == 1 else None
        return self.labels.index(state["dataset"]) if state["dataset"] in self.labels else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        if "mix" not in state:  # one dataset's state, which this mix names
            i = self._single_source(state)
            self.sources[i].load_state_dict(state)
            if len(self.labels) > 1:
                logger.warning(
                    f"Resumed {self.labels[i]} where the checkpoint's run left it; the other "
                    "datasets of the mix start at their beginning"
                )
            return
        saved = dict(zip(state["mix"], state["sources"], strict=True))
        for label, source in zip(self.labels, self.sources, strict=True):
            if label in saved:
                source.load_state_dict(saved[label])
        same_weights = all(
            math.isclose(a, b, rel_tol=1e-9)
            for a, b in zip(state["weights"], self.weights, strict=False)
        )
        if state["mix"] == self.labels and same_weights:
            self._windows = list(state["windows"])
            return
        kept = [label for label in self.labels if label in saved]
        new = [label for label in self.labels if label not in saved]
        was = ", ".join(
            f"{label} {100 * w:.1f}%"
            for label, w in zip(state["mix"], state["weights"], strict=True)
        )
        logger.warning(
            f"The dataset mix differs from the checkpoint's ({was}): "
            + (f"{', '.join(kept)} continue where they were; " if kept else "")
            + (f"{', '.join(new)} start at their beginning; " if new else "")
            + "the new shares count from here"
        )
