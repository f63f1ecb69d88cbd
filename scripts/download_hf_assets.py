"""Download a model's tokenizer and weights from the Hugging Face hub (needs network and, for
the gated meta-llama repos, an access token with the licence accepted on the repo's page).

Usage:
    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer \\
        [--local_dir assets/hf/Llama-3.1-8B] [--hf_token hf_...]
    python scripts/download_hf_assets.py --repo_id deepseek-ai/DeepSeek-V3 --assets tokenizer
    python scripts/download_hf_assets.py --repo_id Qwen/Qwen3-30B-A3B --assets tokenizer weights

Llama 3 repos ship the tiktoken ranks file (`original/tokenizer.model`) and `tokenizer.json`;
DeepSeek repos ship only `tokenizer.json` (+ `tokenizer_config.json`, which names bos and eos).
torchtitan reads either (`--model.tokenizer_path` the folder: the ranks file wins where both are).
`weights` fetches `config.json` and the safetensors weights (every shard the index names): an
HF model folder for `--checkpoint.initial_load_path` (or `scripts/convert_hf.py from_hf`).

The token may also come from the HF_TOKEN environment variable. At the end the script prints the
flags that point training at the downloaded files. Tests never run this against the hub; they
use the small tokenizer bundled in tests/assets/tokenizer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Files per asset kind, each optional on its own; at least one of a kind's REQUIRED_ONE_OF must
# come. `original/tokenizer.model` is Llama 3's tiktoken ranks file, `tokenizer.json` the
# Hugging Face tokenizer every model repo has (torchtitan reads both).
ASSET_FILES: dict[str, tuple[str, ...]] = {
    "tokenizer": (
        "original/tokenizer.model",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",  # (newer repos keep the chat template apart)
    ),
    # An HF model folder (config.json, safetensors weights): --checkpoint.initial_load_path
    # reads it. A sharded model's shards are the ones its index names.
    "weights": ("config.json", "model.safetensors.index.json", "model.safetensors"),
}
REQUIRED_ONE_OF: dict[str, tuple[str, ...]] = {
    "tokenizer": ("original/tokenizer.model", "tokenizer.json"),
    "weights": ("model.safetensors.index.json", "model.safetensors"),
}
INDEX = "model.safetensors.index.json"


class DownloadError(RuntimeError):
    """A download failed for a reason the user can fix; the message says how."""


def _download_file(repo_id: str, filename: str, local_dir: Path, token: str | None) -> Path | None:
    """Download one file into `local_dir`; None if the repo has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(hf_hub_download(repo_id, filename, local_dir=local_dir, token=token))
    except GatedRepoError:
        hint = (
            "your token has no access: accept the licence on the repo's page and retry"
            if token
            else "pass --hf_token or set HF_TOKEN to a token whose account accepted its licence"
        )
        raise DownloadError(f"--repo_id={repo_id} is gated; {hint}") from None
    except RepositoryNotFoundError:
        raise DownloadError(
            f"--repo_id={repo_id} not found (or private and the token cannot see it); check the "
            "name, e.g. meta-llama/Llama-3.1-8B, and --hf_token / HF_TOKEN"
        ) from None
    except LocalEntryNotFoundError:
        # Raised when the hub cannot be reached and the file is not in the local cache.
        raise DownloadError(
            f"could not reach the Hugging Face hub to fetch {repo_id}/{filename}; check the "
            "network (HF_HUB_OFFLINE must be unset), or copy the tokenizer files by hand and "
            "pass their folder as --model.tokenizer_path"
        ) from None
    except EntryNotFoundError:
        return None
    except HfHubHTTPError as e:
        raise DownloadError(f"downloading {repo_id}/{filename} failed: {e}") from None


def _check_hub_reachable() -> None:
    """Fail at once where the hub's host name does not resolve (no network, no DNS): the hub
    client would retry each file five times, about 23 s, before saying so. Skipped behind a
    proxy, which resolves names itself."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # the hub client serves what it has, or says what it lacks
        return
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        raise DownloadError(
            f"could not reach the Hugging Face hub ({host}: {e.strerror or e}); check the "
            "network, or copy the files by hand and pass their folder as --model.tokenizer_path "
            "(tokenizer) or --checkpoint.initial_load_path (weights)"
        ) from None


def download_assets(
    repo_id: str, assets: list[str], local_dir: Path, token: str | None
) -> list[Path]:
    """Download the files of each asset kind in `assets` into `local_dir`, keeping the hub's
    layout (so the Llama 3 ranks file lands in `<local_dir>/original/tokenizer.model`)."""
    downloaded: list[Path] = []
    for asset in assets:
        found = []
        for filename in ASSET_FILES[asset]:
            path = _download_file(repo_id, filename, local_dir, token)
            if path is None:
                print(f"  {filename}: not in {repo_id}, skipped")
            else:
                print(f"  {filename} -> {path}")
                downloaded.append(path)
                found.append(filename)
        if not set(found) & set(REQUIRED_ONE_OF[asset]):
            raise DownloadError(
                f"--repo_id={repo_id} has no {' or '.join(REQUIRED_ONE_OF[asset])}; use a model "
                "repo, e.g. meta-llama/Llama-3.1-8B or deepseek-ai/DeepSeek-V3"
            )
        if asset == "weights":
            if "config.json" not in found:
                raise DownloadError(f"--repo_id={repo_id} has weights but no config.json")
            if INDEX in found:
                downloaded += _download_shards(repo_id, local_dir, token)
    return downloaded


def _download_shards(repo_id: str, local_dir: Path, token: str | None) -> list[Path]:
    """Every shard file the downloaded index names (its ``weight_map`` values)."""
    import json

    weight_map = json.loads((local_dir / INDEX).read_text())["weight_map"]
    paths = []
    for filename in sorted(set(weight_map.values())):
        path = _download_file(repo_id, filename, local_dir, token)
        if path is None:
            raise DownloadError(f"{repo_id}: {INDEX} names {filename}, which the repo lacks")
        print(f"  {filename} -> {path}")
        paths.append(path)
    return paths


def _has_files(folder: Path) -> bool:
    """Whether ``folder`` holds a downloaded file (the hub client's ``.cache`` aside)."""
    return any(
        p.is_file() for p in folder.rglob("*") if ".cache" not in p.relative_to(folder).parts
    )


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Download a model's assets (tokenizer, weights) from the Hugging Face hub."
    )
    parser.add_argument(
        "--repo_id", default="meta-llama/Llama-3.1-8B", help="hub repository, owner/name"
    )
    parser.add_argument(
        "--assets",
        nargs="+",
        choices=sorted(ASSET_FILES),
        default=["tokenizer"],
        help="what to download: the tokenizer, and/or the weights (config.json and safetensors, "
        "for --checkpoint.initial_load_path)",
    )
    parser.add_argument(
        "--local_dir",
        type=Path,
        default=None,
        help="where to put the files (default: assets/hf/<repo name> in the repo root)",
    )
    parser.add_argument(
        "--hf_token",
        default=None,
        help="Hugging Face access token (default: the HF_TOKEN environment variable)",
    )
    args = parser.parse_args(argv)

    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        sys.exit("huggingface_hub is not installed; install it with `pip install huggingface_hub`")

    local_dir = args.local_dir or REPO_ROOT / "assets" / "hf" / args.repo_id.split("/")[-1]
    token = args.hf_token or os.environ.get("HF_TOKEN") or None
    print(f"downloading {', '.join(args.assets)} of {args.repo_id} into {local_dir}")
    existed = local_dir.exists()
    try:
        _check_hub_reachable()
        download_assets(args.repo_id, args.assets, local_dir, token)
    except DownloadError as e:
        if not existed and local_dir.exists() and not _has_files(local_dir):
            shutil.rmtree(local_dir)  # only what this run made, and nothing came
        sys.exit(f"error: {e}")
    flags = []
    if "tokenizer" in args.assets:
        flags.append(f"--model.tokenizer_path={_display_path(local_dir)}")
    if "weights" in args.assets:
        flags.append(
            f"--checkpoint.enable --checkpoint.initial_load_path={_display_path(local_dir)}"
        )
    print(f"done; train with {' '.join(flags)}")


if __name__ == "__main__":
    main()
