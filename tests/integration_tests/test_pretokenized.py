"""Training on pre-tokenized shards (``--training.dataset tokens``) is training on the same
documents read as text: the same losses and validation losses in one process, FSDP 2 equal to
one process under ``by_row``, and a bitwise resume from the window position."""

import shutil
import sys
from pathlib import Path

import pytest
from launch import REPO, SMALL, records, run_train

from torchtitan.train import main

sys.path.insert(0, str(REPO / "scripts"))
import pretokenize  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:'set_vital'")]

RUN = [
    *SMALL, "--debug.deterministic", "--training.steps", "6", "--training.data_sharding",
    "by_row", "--lr_scheduler.warmup_steps", "2",
]  # fmt: skip
VALIDATE = ["--validation.enable", "--validation.freq", "3", "--validation.steps", "4"]


def _losses(dump: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in records(dump) if key in r}


def test_tokens_train_as_text_does_and_resume_bitwise(tmp_path: Path) -> None:
    train, valid = tmp_path / "train_tokens", tmp_path / "validation_tokens"
    assert pretokenize.main(["--out", str(train), "--shard_tokens", "50000"]) == 0
    assert pretokenize.main(["--out", str(valid), "--dataset", "python_docs_validation"]) == 0
    tokens = ["--training.dataset", "tokens", "--training.dataset_path", str(train)]
    tokens += ["--validation.dataset", "tokens", "--validation.dataset_path", str(valid)]

    # One process: the windows are the text loader's, so the run is bitwise the text run.
    text, read = tmp_path / "text", tmp_path / "tokens"
    batch = ["--training.local_batch_size", "8"]
    assert main([*RUN, *VALIDATE, *batch, "--job.dump_folder", str(text)]) == 0
    assert main([*RUN, *VALIDATE, *batch, *tokens, "--job.dump_folder", str(read)]) == 0
    assert _losses(read) == _losses(text) and len(_losses(text)) == 6
    want = _losses(text, "validation_loss")
    assert _losses(read, "validation_loss") == want and sorted(want) == [3, 6]

    # FSDP 2 reading the same global batch (by_row), checkpointed at step 3, then resumed.
    fsdp, resumed = tmp_path / "fsdp", tmp_path / "resumed"
    save = ["--checkpoint.enable", "--checkpoint.interval", "3", "--training.num_workers", "1"]
    save += ["--training.local_batch_size", "4"]
    result = run_train(fsdp, *RUN, *save, *tokens, ngpu=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(_losses(fsdp).values()) == pytest.approx(list(_losses(text).values()), rel=1e-5)
    shutil.copytree(fsdp / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    result = run_train(resumed, *RUN, *save, *tokens, ngpu=2)
    assert result.returncode == 0, result.stderr[-3000:]
    again = _losses(resumed)
    assert sorted(again) == [4, 5, 6]
    assert [again[s] for s in (4, 5, 6)] == [_losses(fsdp)[s] for s in (4, 5, 6)]
