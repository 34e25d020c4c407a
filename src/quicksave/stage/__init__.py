"""Stage: copy tensors into reusable shared host memory, laid out as the file images (the
engine) or as plain tensor slots (the NVRx-compatible writer)."""
