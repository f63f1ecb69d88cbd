"""Which third-party notices a run drops, and that it drops nothing else."""

import logging
import warnings

import pytest

from torchtitan.tools.logging import quiet_known_torch_notices


@pytest.fixture
def captured():
    """Records that reach the named loggers' handlers after the filters."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    names = ("torch.utils._pytree", "torchao", "torch.distributed.tensor._redistribute")
    loggers = [logging.getLogger(n) for n in names]
    saved = [(lg.filters[:], lg.handlers[:], lg.propagate, lg.level, lg.disabled) for lg in loggers]
    handler = Keep()
    for lg in loggers:  # (earlier tests in this process may have set filters and levels)
        lg.filters[:] = []
        lg.addHandler(handler)
        lg.propagate, lg.disabled = False, False
        lg.setLevel(logging.WARNING)
    yield records
    for lg, (filters, handlers, propagate, level, disabled) in zip(loggers, saved, strict=True):
        lg.filters[:], lg.handlers[:], lg.propagate, lg.disabled = (
            filters,
            handlers,
            propagate,
            disabled,
        )
        lg.setLevel(level)


def test_benign_notices_are_dropped_and_others_kept(captured):
    quiet_known_torch_notices(cuda=False)
    pytree = logging.getLogger("torch.utils._pytree")
    # torch logs it with %-arguments: the filter reads the formatted message.
    pytree.warning("%s is an Enum subclass and is now natively supported", "<enum 'Kernel'>")
    pytree.warning("%s is not a registered pytree node", "Thing")
    torchao = logging.getLogger("torchao")
    torchao.warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
    torchao.warning("Something else from torchao")
    logging.getLogger("torch.distributed.tensor._redistribute").warning(
        "While redistributing from Shard(0) to Replicate()"
    )
    assert captured == ["Thing is not a registered pytree node", "Something else from torchao"]


def test_torchao_kernel_notice_is_kept_on_cuda(captured):
    quiet_known_torch_notices(cuda=True)
    logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so")
    assert captured == ["Failed to load /x/_C_mxfp8.so"]


def test_the_last_pipeline_stages_missing_output_gradient_is_not_warned():
    message = (
        "Stage 1: output_args[0] has requires_grad=True, but output_grads[0] is None. This is "
        "legal at pipeline boundaries but may indicate a missing gradient."
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_known_torch_notices(cuda=False)
        warnings.warn(message, UserWarning, stacklevel=1)
        warnings.warn("Stage 1: something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["Stage 1: something else"]
