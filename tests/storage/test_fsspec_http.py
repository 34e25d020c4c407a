"""A quicksave checkpoint read over plain HTTP through fsspec (``http://``): a real
HTTP server on loopback (Python's, which lists directories and ignores ranges), as
Lightning's tests serve a checkpoint folder."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import quicksave


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(30)


def test_a_checkpoint_served_over_http_loads(served: tuple[Path, str]) -> None:
    root, url = served
    state = {"w": torch.arange(1000.0), "b": torch.ones(3, dtype=torch.bfloat16), "n": 7}
    quicksave.save(state, root / "c.ckpt")
    back = quicksave.load_state(f"{url}/c.ckpt")
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    assert back["n"] == 7


def test_a_missing_checkpoint_over_http_names_its_url(served: tuple[Path, str]) -> None:
    _, url = served
    with pytest.raises(quicksave.CheckpointNotFoundError) as info:
        quicksave.load_state(f"{url}/missing.ckpt")
    assert f"{url}/missing.ckpt" in str(info.value) and "http://http" not in str(info.value)
