"""Stage: copy tensors into reusable host memory laid out as the file images."""
