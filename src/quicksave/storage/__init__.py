"""Where checkpoints live: locations (paths and URLs) and the storage backends behind
them (``local``, ``s3``, ``msc``), all through one small protocol (:mod:`.backend`)."""

from quicksave.storage.backend import Backend, ObjectInfo, S3Options, StorageOptions
from quicksave.storage.location import Location, local_path, parse_location

__all__ = [
    "Backend",
    "Location",
    "ObjectInfo",
    "S3Options",
    "StorageOptions",
    "local_path",
    "parse_location",
]
