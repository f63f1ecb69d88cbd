"""The error type for input a user can fix (config, degrees, paths), and its wording helpers."""

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """Bad user input; the message names the flag and the fix, and is shown without traceback."""


def did_you_mean(name: str, candidates: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean <prefix><closest>?)`` for a misspelt name, or an empty string."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""
