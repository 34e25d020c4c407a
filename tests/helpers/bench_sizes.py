"""Sizes that keep the storage bench's training part to seconds in tests."""

# the training part's StorageBenchConfig fields
TINY_TRAINING = {
    "train_steps": 4,
    "train_interval": 2,
    "train_hidden": 64,
    "train_layers": 2,
    "train_batch": 4,
    "train_repeat": 1,
    "train_threads": 1,
    "train_calibration_steps": 2,
}
