"""Names of modules and parameters as the model defines them, whatever wraps them."""

WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
"""The name parts activation checkpointing, compile and FSDP1-style wrappers insert."""


def clean_name(name: str) -> str:
    """A module or parameter name without the wrappers' parts (activation checkpointing,
    compile), wherever they stand: the name a state dict uses."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)
