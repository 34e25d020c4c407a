"""Where checkpoints live: locations (paths and URLs) and, later, storage backends."""

from .location import local_path

__all__ = ["local_path"]
