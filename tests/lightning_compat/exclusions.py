"""The Lightning tests that cannot pass with QuicksaveCheckpointIO as the default, and why.

Only these reasons are allowed (``REASONS``): the test itself writes the checkpoint *file*
with ``torch.save`` and hands it to the Trainer, the test is about ``TorchCheckpointIO``
itself (counts or mocks its ``torch.save`` calls, asserts it is the default), or the
checkpoint holds a value that only pickle can store. Any other stock pass
that fails with quicksave is a quicksave defect, reported by ``run_lightning_tests.py``.

Keys are test ids as pytest prints them; an id without ``[...]`` covers all its
parametrizations.
"""

from __future__ import annotations

REASONS = {
    "torch-file": "the test writes the checkpoint file with torch.save itself and has the "
    "Trainer read it",
    "torch-io": "the test is about TorchCheckpointIO itself: it counts or mocks its torch.save "
    "calls, or asserts that the default CheckpointIO is a TorchCheckpointIO",
    "pickle": "the checkpoint holds a value that only pickle can store",
}

_FREQ = "tests/tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py"
_MC = "tests/tests_pytorch/checkpointing/test_model_checkpoint.py"
_TC = "tests/tests_pytorch/checkpointing/test_trainer_checkpoint.py"
_CONN = "tests/tests_pytorch/trainer/connectors/test_checkpoint_connector.py"
_IO = "tests/tests_pytorch/plugins/test_checkpoint_io_plugin.py"

# test id -> (reason key, what exactly). How to do what each test does with quicksave
# instead is in README.md ("Exclusions").
EXCLUSIONS: dict[str, tuple[str, str]] = {
    f"{_FREQ}::test_default_checkpoint_freq": (
        "torch-io",
        "@mock.patch('torch.save') and asserts save_mock.call_count == the number of saves",
    ),
    f"{_FREQ}::test_top_k": (
        "torch-io",
        "@mock.patch('torch.save') and asserts save_mock.call_count == the number of saves",
    ),
    f"{_MC}::test_model_checkpoint_no_extraneous_invocations": (
        "torch-io",
        "wraps torch.save in a Mock and asserts its call_count on every rank",
    ),
    f"{_TC}::test_trainer_save_checkpoint_storage_options": (
        "torch-io",
        "mocks TorchCheckpointIO.save_checkpoint and asserts how Trainer.save_checkpoint calls "
        "it (storage_options a str, which TorchCheckpointIO ignores)",
    ),
    f"{_IO}::test_multi_wrapped_checkpoint_io_initialization": (
        "torch-io",
        "asserts isinstance(<the IO AsyncCheckpointIO wraps by default>, TorchCheckpointIO)",
    ),
    f"{_CONN}::test_stateful_trainer_ckpt_path_support": (
        "torch-file",
        "torch.save()s foo.ckpt and last.ckpt itself, then fit(ckpt_path=...) reads them",
    ),
}


def excluded(test_id: str) -> tuple[str, str] | None:
    """The exclusion that covers ``test_id`` (exact, or its id without parameters)."""
    hit = EXCLUSIONS.get(test_id)
    if hit is None and "[" in test_id:
        hit = EXCLUSIONS.get(test_id.split("[", 1)[0])
    return hit


for _key, (_reason, _why) in EXCLUSIONS.items():
    assert _reason in REASONS, f"{_key}: unknown reason {_reason!r}"
