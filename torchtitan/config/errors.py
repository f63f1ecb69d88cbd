"""The error type for input a user can fix (config, degrees, paths)."""


class ConfigError(ValueError):
    """Bad user input; the message names the flag and the fix, and is shown without traceback."""
