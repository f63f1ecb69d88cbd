# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The data of a run: the tokenizer, a fine-tuning run's chat template, and this
data-parallel rank's loaders of the training and validation data, sharded alike."""

import functools
from typing import Any

from torchtitan.components.data_sources import check_format
from torchtitan.components.dataloader import Tokenizer, build_dataloader
from torchtitan.components.sft_data import load_chat_template, sft_datasets
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.components.validate import Validator
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Model, Training, Validation
from torchtitan.distributed import local_tensor
from torchtitan.tools.paths import resolve_path


class RunData:
    """Reads ``--model.tokenizer_path`` and, for ``--training.data_format chat``, the chat
    template; ``loader`` opens a dataset for this data-parallel rank (each simulated rank's
    while ranks are simulated)."""

    def __init__(
        self, training: Training, model: Model, *, vocab_size: int, dp_rank: int, dp_degree: int
    ):
        self.training, self.dp_rank, self.dp_degree = training, dp_rank, dp_degree
        tokenizer_path = str(resolve_path(model.tokenizer_path))
        self.tokenizer: Tokenizer = build_tokenizer(tokenizer_path)
        if self.tokenizer.vocab_size > vocab_size:
            raise ConfigError(
                f"tokenizer {model.tokenizer_path} has {self.tokenizer.vocab_size} tokens but "
                f"--model.flavor {model.flavor} has vocab_size {vocab_size}; "
                "pick a matching --model.tokenizer_path or flavor"
            )
        self.chat_template = (
            load_chat_template(self.tokenizer, tokenizer_path=tokenizer_path,
                               override=training.chat_template)
            if training.data_format == "chat"
            else None
        )  # fmt: skip
        # What turns rows into windows for a fine-tuning format (None: text).
        self.make_dataset = sft_datasets(
            training.data_format, template=self.chat_template,
            train_on_prompt=training.train_on_prompt, pack=model.attn_mask == "block_causal",
            packing_bins=training.packing_bins,
        )  # fmt: skip

    @property
    def template_source(self) -> str | None:
        """The chat template's text, saved with checkpoints and exports (None: no template)."""
        return self.chat_template.source if self.chat_template is not None else None

    def training_loader(self) -> Any:
        """The endless loader of ``--training.dataset`` (or ``--training.dataset_mix``)."""
        t = self.training
        return self.loader(
            dataset=t.dataset, dataset_path=t.dataset_path, seq_len=t.seq_len,
            local_batch_size=t.local_batch_size, infinite=True, mix=t.mix(),
            shuffle_seed=t.shuffle_seed,
        )  # fmt: skip

    def validator(self, validation: Validation, **run: Any) -> Validator | None:
        """The validation loop (``--validation.enable``), or ``None``; ``run``: the
        ``Validator``'s ``runner`` and ``loss_mesh``."""
        v = validation
        if not v.enable:
            return None
        # Checked now, not at the first validation: a dataset of another format.
        check_format(v.dataset, self.training.data_format, flag="--validation")
        build_loader = functools.partial(
            self.loader, dataset=v.dataset, dataset_path=v.dataset_path, seq_len=v.seq_len,
            local_batch_size=v.local_batch_size, infinite=False, drop_last=True,
            flag="--validation",
        )  # fmt: skip
        return Validator(v, build_loader=build_loader, **run)

    def loader(self, **dataset: Any) -> Any:
        """This data-parallel rank's loader of ``dataset`` (``build_dataloader``'s dataset
        arguments), sharded, formatted and read by workers as the training data is."""
        t = self.training
        build = functools.partial(
            build_dataloader,
            tokenizer=self.tokenizer,
            dp_world_size=self.dp_degree,
            num_workers=t.num_workers,
            sharding=t.data_sharding,
            data_format=t.data_format,
            make_dataset=self.make_dataset,
            **dataset,
        )
        return local_tensor.dataloader_for_rank(
            lambda dp_rank: build(dp_rank=dp_rank), self.dp_rank, self.dp_degree
        )
