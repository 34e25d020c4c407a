"""``quicksave demo``: train a tiny language model, SIGKILL it mid-run, resume it from
its last committed checkpoint and check it ends bit-identical to an uninterrupted run.

Modules: :mod:`.model` (the transformer), :mod:`.data` (shipped text, tokenizer,
resumable sampler), :mod:`.train` (the training child), :mod:`.run` (the orchestration).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the demo with command-line arguments ``argv`` (default: ``sys.argv[1:]``).

    Args:
        argv: e.g. ``["--steps", "30", "--interval", "10"]``; see ``quicksave demo -h``.

    Returns:
        0 iff the resumed run is bit-exact with the reference run, else 1.

    Raises:
        SystemExit: invalid arguments (status 2) or ``--help`` (status 0), as argparse does.

    Example::

        import sys
        from quicksave_tools.demo import main
        sys.exit(main(["--steps", "30", "--interval", "10"]))
    """
    # Imported here so ``import quicksave_tools.demo`` stays cheap for the CLI's --help.
    from quicksave_tools.demo.run import main as run_main

    return run_main(argv)


__all__ = ["main"]
