"""Model families, one package each, found by name through their ``model_spec``.

A model is a Python package (``torchtitan.models.<name>`` or any importable module path) that
defines ``model_spec = ModelSpec(...)`` (``torchtitan.models.spec``) without importing torch at
package import time. Users add a model by writing such a package; nothing in the core needs
to change (``docs/extending.md``).
"""

from torchtitan.models.spec import (
    ModelArgs,
    ModelSpec,
    ParallelizeContext,
    get_model_spec,
    import_model_module,
    lazy,
)

__all__ = [
    "ModelArgs",
    "ModelSpec",
    "ParallelizeContext",
    "get_model_spec",
    "import_model_module",
    "lazy",
]
