"""Running a benchmark's method with another version of the library (``--baseline SRC``
of ``quicksave bench --training`` and ``quicksave bench --storage``): the name suffix of
such a run (:data:`BASELINE`), the check that ``SRC`` holds a ``quicksave`` package
(:func:`check_baseline`) and the environment of the child process that runs it
(:func:`baseline_env`). The parent calls these; the child, started with that
environment, imports ``quicksave`` from the baseline and the benchmark's own code from
this installation."""

from __future__ import annotations

import os

BASELINE = "@baseline"  # suffix of a method run with the baseline's package


def plain(method: str) -> str:
    """``method`` without the :data:`BASELINE` suffix."""
    return method.removesuffix(BASELINE)


def is_baseline(method: str) -> bool:
    return method.endswith(BASELINE)


def check_baseline(src: str) -> None:
    """Raise ValueError unless ``src`` holds a ``quicksave`` package."""
    if not os.path.isfile(os.path.join(src, "quicksave", "__init__.py")):
        raise ValueError(f"{src} holds no quicksave package (quicksave/__init__.py)")


def baseline_env(src: str, base: str) -> dict[str, str]:
    """The environment of a ``@baseline`` run: this process's, with a folder (made in
    ``base`` once) holding only a link to ``src``'s ``quicksave`` package first on
    ``PYTHONPATH``, so the library comes from there and the benchmark's own code from
    this installation."""
    shim = os.path.join(base, "baseline-path")
    link = os.path.join(shim, "quicksave")
    target = os.path.join(os.path.abspath(src), "quicksave")
    if os.path.lexists(link) and os.readlink(link) != target:
        os.unlink(link)  # made for another baseline
    if not os.path.lexists(link):
        os.makedirs(shim, exist_ok=True)
        os.symlink(target, link)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH")) if p)
    return env
