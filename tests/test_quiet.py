"""Quiet output: the listed third-party messages are hidden, and only they; our own code uses current APIs."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import build_peft_model

from poros_lightning import _quiet
from poros_lightning.api import prepare, unprepare


def test_listed_warnings_are_hidden_and_others_are_not() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default for a script
        _quiet.install()  # as `import poros_lightning` does
        for message, category in _quiet.WARNINGS:
            warnings.warn(message + " (and the rest of it)", category, stacklevel=1)
        warnings.warn("`something_else` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("`is_gradient_checkpointing` is deprecated", UserWarning, stacklevel=1)  # another category
    assert [str(w.message) for w in caught] == [
        "`something_else` is deprecated",
        "`is_gradient_checkpointing` is deprecated",
    ]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_listed_log_messages_are_dropped_and_others_kept() -> None:
    _quiet.install()
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    # A handler on each logger itself: Lightning may have turned propagation off after an earlier Trainer.
    collect = _Collect()
    levels = {logger: logger.level for logger in (bnb, tips)}
    for logger in levels:
        logger.addHandler(collect)
        logger.setLevel(logging.INFO)
    try:
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "offline")
        bnb.warning("Some other bitsandbytes warning")
        tips.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        tips.info("GPU available: False, used: False")
    finally:
        for logger, level in levels.items():
            logger.removeHandler(collect)
            logger.setLevel(level)
    assert collect.messages == [
        "Some other bitsandbytes warning",
        "GPU available: False, used: False",
    ]


def test_install_is_idempotent() -> None:
    _quiet.install()
    before = list(warnings.filters)
    _quiet.install()
    assert warnings.filters == before
    assert (
        sum(isinstance(f, _quiet._DropMessages) for f in logging.getLogger("bitsandbytes.backends.cpu.ops").filters)
        == 1
    )


def test_prepare_uses_transformers_current_checkpointing_names() -> None:
    model = build_peft_model(lora_dropout=0.0)
    base = model.get_base_model()
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is None:
        pytest.skip("this transformers has only the gradient_checkpointing_* names")
    enable()
    with warnings.catch_warnings():
        warnings.resetwarnings()  # none of _quiet's filters: a deprecated call of ours would raise
        warnings.simplefilter("error", FutureWarning)
        prepare(model, device=torch.device("cpu"))
        assert not base.is_activation_checkpointing  # streamed layers recompute on their own
        unprepare(model)
