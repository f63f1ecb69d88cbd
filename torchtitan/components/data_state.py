"""Whether a text dataset can continue a saved dataloader state: the refusals (one line each:
another format, a mix's state, another shuffle seed, a shuffled one saved under another name)
and the warnings where it continues but may not read what the saved run would have (another
dataset name, another number of documents). Used by ``dataloader.TextDataset``."""

from typing import Any

from torch.utils.data import get_worker_info

from torchtitan.components.token_windows import check_seed
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger

_EXCLUDE = "--checkpoint.exclude_from_loading dataloader"
_warned: set[str] = set()  # each warning once per process (one state per dataloader worker)


def check_text_state(
    state: dict[str, Any],
    *,
    name: str,
    data_format: str,
    shuffle_seed: int | None,
    documents: int | None,
    sharded: bool,
) -> None:
    """Refuse ``state`` where the dataset ``name`` (``data_format``, ``shuffle_seed``,
    ``documents`` in all, None for a stream; ``sharded``: each data-parallel rank reads its
    own block of them) cannot continue it; warn where it continues on what may be other data."""
    if "mix" in state:
        mix = [f"{label}:{w:g}" for label, w in zip(state["mix"], state["weights"], strict=True)]
        raise ConfigError(
            f"dataloader state was saved reading --training.dataset_mix {' '.join(mix)}, "
            f"this run reads {name} alone (--training.dataset); resume with a mix (one that "
            f"names {name} continues it where it was) or pass {_EXCLUDE}"
        )
    saved = state.get("format", "text")
    if saved == "tokens":
        raise ConfigError(
            f"dataloader state of {state.get('dataset')} was saved reading pre-tokenized "
            f"windows, this run reads documents of {name}; the position does not carry over: "
            f"pass {_EXCLUDE}"
        )
    if saved != data_format:
        raise ConfigError(
            f"dataloader state was saved reading --training.data_format {saved}, this run "
            f"reads {data_format}; resume with {saved} or pass {_EXCLUDE}"
        )
    seed = state.get("shuffle_seed")
    check_seed(name, seed, shuffle_seed)
    named = state.get("dataset", name)
    if seed is not None and named != name:
        raise ConfigError(
            f"dataloader state was saved reading {named}, this run names it {name}: the "
            "shuffled order is drawn from the name as written, so the saved position would be "
            f"in another order; write it as before ({named}) or pass {_EXCLUDE}"
        )
    if get_worker_info() is not None:  # the training process has warned
        return
    at = f"document {state.get('sample_idx', 0)} of epoch {state.get('epoch', 0)}"
    if named != name:  # a file moved, or other data
        _warn(
            f"dataloader state was saved reading {named}, this run reads {name}: it continues "
            f"at {at}; if that is other data, pass {_EXCLUDE} to read it from its beginning"
        )
    counted = state.get("documents")
    if counted is not None and documents is not None and counted != documents:
        moved = sharded or shuffle_seed is not None
        where = (
            "each rank's block of documents (or the shuffled order) moved with it, so documents "
            "may be skipped or read twice"
            if moved
            else f"it continues at {at}"
        )
        _warn(
            f"dataset {name} had {counted} documents when the dataloader state was saved and "
            f"has {documents} now: {where}; pass {_EXCLUDE} to read it from its beginning"
        )


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
