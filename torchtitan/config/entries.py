"""Entries of the config's list fields that carry their own small syntax, parsed:
``--training.dataset_mix NAME[=PATH]:WEIGHT`` and ``--optimizer.param_groups
REGEX:key=value,...``. Torch-free, as the rest of the config."""

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class MixEntry:
    """One entry of ``--training.dataset_mix``."""

    name: str
    path: str | None
    weight: float

    @property
    def label(self) -> str:
        """What messages and checkpoints call it: ``NAME`` or ``NAME=PATH``."""
        return self.name if self.path is None else f"{self.name}={self.path}"

    @property
    def written(self) -> str:
        """The entry as ``--training.dataset_mix`` takes it."""
        return f"{self.label}:{self.weight:g}"

    @classmethod
    def parse(cls, entry: str) -> "MixEntry":
        source, colon, weight = entry.rpartition(":")
        name, equals, path = source.partition("=")
        if not colon or not name or (equals and not path):
            raise ValueError(f"{entry!r} is not NAME:WEIGHT or NAME=PATH:WEIGHT")
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"{entry!r}: the weight {weight!r} is not a number") from None
        if not 0 < value < math.inf:
            raise ValueError(f"{entry!r}: the weight must be > 0 and finite")
        return cls(name, path or None, value)


@dataclass(frozen=True)
class ParamGroup:
    """One entry of ``--optimizer.param_groups``."""

    pattern: str
    lr_scale: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float

    @classmethod
    def parse(cls, entry: str, **defaults: float) -> "ParamGroup":
        """``entry`` with the settings it does not give from ``defaults`` (``weight_decay``,
        ``beta1``, ``beta2``, ``eps``: the section's); ``ValueError`` names what is wrong."""
        pattern, colon, settings = entry.rpartition(":")
        if not colon or not pattern:
            raise ValueError(f"{entry!r} is not REGEX:key=value[,key=value...]")
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as e:
            raise ValueError(f"{entry!r}: the regex does not compile ({e})") from None
        values = {"lr_scale": 1.0} | defaults
        given: set[str] = set()
        for item in settings.split(","):
            key, equals, value = (part.strip() for part in item.partition("="))
            if key not in values or not equals:
                raise ValueError(
                    f"{entry!r}: {item.strip()!r} is not key=value with a key of "
                    f"{', '.join(values)}"
                )
            if key in given:
                raise ValueError(f"{entry!r}: {key} is given twice")
            given.add(key)
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"{entry!r}: {key}={value} is not a number") from None
        group = cls(pattern, **values)
        for ok, rule in (
            (0 <= group.lr_scale < math.inf, "lr_scale must be >= 0 and finite"),
            (0 <= group.weight_decay < math.inf, "weight_decay must be >= 0 and finite"),
            (0 <= group.beta1 < 1 and 0 <= group.beta2 < 1, "beta1 and beta2 must be in [0, 1)"),
            (0 < group.eps < math.inf, "eps must be > 0 and finite"),
        ):
            if not ok:
                raise ValueError(f"{entry!r}: {rule}")
        return group
