"""The ``quicksave`` command line: ``ls``, ``inspect``, ``verify``, ``convert``, ``demo``,
``bench``. Entry point: :func:`quicksave.cli.main.main`."""

from quicksave.cli.main import main

__all__ = ["main"]
