"""Resolving user paths the same way everywhere."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str | Path) -> Path:
    """An absolute or working-directory-relative path if it exists, else one relative to the
    repository root (so bundled assets such as ``tests/assets/...`` work from any directory)."""
    path = Path(path).expanduser()
    if path.is_absolute() or path.exists():
        return path
    from_root = REPO_ROOT / path
    return from_root if from_root.exists() or any(from_root.parent.glob(from_root.name)) else path
