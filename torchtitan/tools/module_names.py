"""Names of modules and parameters as the model defines them, whatever wraps them."""

WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""What activation checkpointing, compile and FSDP1-style wrappers insert into names."""


def clean_name(name: str) -> str:
    """A module or parameter name without the wrappers' parts (activation checkpointing,
    compile): the name a state dict uses."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name
