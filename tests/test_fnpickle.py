"""quicksave.worker.fnpickle: functions the worker cannot import travel by value.

The training-script cases run for real: a script in a temporary folder (its own
``__main__``) pickles its functions with ``dumps`` and starts a fresh interpreter, in
another folder, that never imports the script, to load and call them (the script waits
for it, as the trainer outlives its worker: shared-memory tensors are fetched from it).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import quicksave.worker.fnpickle
from quicksave.errors import CheckpointError
from quicksave.worker.calls import pickle_call, run_pickled_call
from quicksave.worker.fnpickle import dumps, loads

SCRIPT_TIMEOUT_S = 120

# The trainer: defines (a)-(f) in its __main__, pickles them, runs LOADER, waits for it.
TRAINER = """
import functools, multiprocessing, os, subprocess, sys
import torch
import torch.multiprocessing  # CPU tensors pickle as shared memory, as in pickle_call
from quicksave.errors import CheckpointError
from quicksave.worker.fnpickle import dumps

OUT = sys.argv[1]
SCALE = 10


def _double(x):
    return 2 * x


def write_file(path, value):  # (a): a constant, a helper, os and torch
    with open(path, "w") as f:
        f.write(f"{value} from {os.getpid()}")
    return _double(value) * SCALE + int(torch.ones(3).sum())


def make_counter(t):  # (b): a closure over a tensor and a counter
    calls = 0

    def count(step):
        nonlocal calls
        calls += 1
        return [calls, step, float(t.sum())]

    return count


def fib(n):  # (e): recursion through a global
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def countdown():  # (e): recursion through a closure cell
    def down(n):
        return [] if n == 0 else [n] + down(n - 1)

    return down


def is_even(n):  # mutual recursion: one globals dict for both
    return True if n == 0 else is_odd(n - 1)


def is_odd(n):
    return False if n == 0 else is_even(n - 1)


class Shard:  # (f)
    pass


tensor = torch.arange(4.0)
calls = {
    "write_file": write_file,
    "counter": make_counter(tensor),
    "lambda": lambda a, b=3: a * b + SCALE,
    "partial": functools.partial(write_file, value=7),
    "fib": fib,
    "countdown": countdown(),
    "parity": (is_even, is_odd),
}
for name, obj in calls.items():
    with open(os.path.join(OUT, name + ".pkl"), "wb") as f:
        f.write(dumps(obj))
for name, obj in {"class": Shard, "instance": (write_file, (Shard(),), {})}.items():
    try:
        dumps(obj)
    except CheckpointError as e:
        with open(os.path.join(OUT, name + ".error"), "w") as f:
            f.write(str(e))
assert tensor.is_shared()
env = dict(os.environ, QS_AUTHKEY=bytes(multiprocessing.current_process().authkey).hex())
sys.exit(subprocess.run([sys.executable, sys.argv[2], OUT], env=env).returncode)
"""

# A fresh interpreter: it never imports the trainer, whose functions are not in its
# __main__; it reads the payloads and calls them.
LOADER = """
import json, multiprocessing, os, pickle, sys
import torch.multiprocessing  # as the worker does

multiprocessing.current_process().authkey = bytes.fromhex(os.environ["QS_AUTHKEY"])
OUT = sys.argv[1]


def load(name):
    with open(os.path.join(OUT, name + ".pkl"), "rb") as f:
        return pickle.load(f)


assert "write_file" not in globals() and "trainer" not in sys.modules
write_file, count, partial = load("write_file"), load("counter"), load("partial")
is_even, is_odd = load("parity")
results = {
    "write_file": write_file(os.path.join(OUT, "a.txt"), 4),
    "module": write_file.__module__,
    "qualname": count.__qualname__,
    "counter": [count(5), count(6)],
    "lambda": load("lambda")(2),
    "partial": partial(os.path.join(OUT, "d.txt")),
    "fib": load("fib")(10),
    "countdown": load("countdown")(3),
    "parity": [is_even(10), is_odd(8), is_even.__globals__ is is_odd.__globals__],
    "pid": os.getpid(),
}
with open(os.path.join(OUT, "results.json"), "w") as f:
    json.dump(results, f)
"""


def _run_script(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        cwd=path.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run TRAINER (and through it LOADER) once; the folder of payloads and results."""
    root = tmp_path_factory.mktemp("fnpickle")
    (root / "trainer").mkdir()
    (root / "loader").mkdir()
    (root / "out").mkdir()
    trainer, loader = root / "trainer" / "trainer.py", root / "loader" / "loader.py"
    trainer.write_text(TRAINER)
    loader.write_text(LOADER)
    _run_script(trainer, str(root / "out"), str(loader))
    return root / "out"


# ------------------------------------------------------------ the training script
def test_script_functions_run_in_a_fresh_interpreter(trainer_run: Path) -> None:
    results = json.loads((trainer_run / "results.json").read_text())
    pid = results["pid"]
    # (a): the global constant, the helper, os and torch, a file written by the loader
    assert results["write_file"] == 2 * 4 * 10 + 3
    assert (trainer_run / "a.txt").read_text() == f"4 from {pid}"
    assert results["module"] == "__main__"
    # (b): the closure keeps its counter across calls and reads the shared tensor
    assert results["qualname"] == "make_counter.<locals>.count"
    assert results["counter"] == [[1, 5, 6.0], [2, 6, 6.0]]
    # (c), (d), (e)
    assert results["lambda"] == 2 * 3 + 10
    assert results["partial"] == 2 * 7 * 10 + 3
    assert (trainer_run / "d.txt").read_text() == f"7 from {pid}"
    assert results["fib"] == 55
    assert results["countdown"] == [3, 2, 1]
    assert results["parity"] == [True, False, True]


def test_class_of_the_script_is_refused_at_dumps(trainer_run: Path) -> None:
    advice = (
        "cannot be sent to the worker process: the class is defined in the training script "
        "(__main__), which the worker does not run; move it into an importable module "
        "(functions, closures and lambdas are sent by value, classes are not)"
    )
    assert (trainer_run / "class.error").read_text() == f"class __main__.Shard {advice}"
    assert (trainer_run / "instance.error").read_text() == (
        f"an instance of class __main__.Shard {advice}"
    )


# ---------------------------------------------------------------------- in-process
def _module_level(x: int) -> int:
    return x + 1


def _decorated(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        return fn(*args) * 2

    return wrapper


@_decorated
def _wrapped(x: int) -> int:  # module attribute is the wrapper; the inner one is not found
    return x + 1


def test_importable_functions_go_by_reference() -> None:
    for fn in (_module_level, os.path.join, _wrapped, print):
        payload = dumps(fn)
        assert loads(payload) is fn
        assert b"_make_function" not in payload  # no code inside
    assert loads(dumps(functools.partial(_module_level, 1)))() == 2


def test_local_functions_go_by_value() -> None:
    offset = torch.tensor(5)

    def add(x: int) -> int:
        return x + int(offset)

    def rec(n: int) -> int:
        return 0 if n == 0 else 1 + rec(n - 1)

    for fn, arg, want in ((add, 1, 6), (lambda x: _module_level(x) * 3, 1, 6), (rec, 4, 4)):
        payload = dumps(fn)
        assert b"_make_function" in payload
        copy = loads(payload)
        assert copy is not fn and copy(arg) == want and copy.__qualname__ == fn.__qualname__
    assert loads(dumps(_wrapped.__wrapped__))(1) == 2  # by value: found as the wrapper


def test_an_empty_cell_stays_empty() -> None:
    def make() -> Callable[[], int]:
        def read() -> int:
            return later

        return read
        later = 1  # never runs: read's cell stays empty

    copy = loads(dumps(make()))
    with pytest.raises(NameError, match="'later'"):
        copy()


def test_only_the_globals_the_code_reads_are_sent() -> None:
    lock = threading.Lock()  # unpicklable: reading it as an attribute must not send it

    class Holder:
        pass

    holder = Holder()
    holder.lock = lock  # type: ignore[attr-defined]
    fn = eval("lambda h: h.lock is not None", {"lock": lock, "os": os})
    assert loads(dumps(fn))(holder) is True


def test_a_tensor_argument_travels_as_shared_memory() -> None:
    t = torch.arange(6.0)
    assert not t.is_shared()
    payload = pickle_call(1, lambda x: x, (t,), {})
    assert t.is_shared()
    result = run_pickled_call(1, payload, [], {})
    assert result.ok, result.detail


def test_unpicklable_things_are_refused_naming_them() -> None:
    class Local:
        pass

    with pytest.raises(CheckpointError) as e:
        dumps(Local)
    assert str(e.value) == (
        f"class {__name__}.test_unpicklable_things_are_refused_naming_them.<locals>."
        "Local cannot be sent to the worker process: the class is defined inside a function; "
        "move it into an importable module (functions, closures and lambdas are sent by "
        "value, classes are not)"
    )
    item = Local()

    def uses() -> Any:
        return item

    captured = r"^function .*<locals>\.uses captures 'item': an instance of class .*Local "
    with pytest.raises(CheckpointError, match=captured):
        dumps(uses)
    with pytest.raises(CheckpointError) as e:
        dumps((_module_level, (threading.Lock(),), {}))
    assert str(e.value) == (
        f"cannot pickle the call of function {__name__}._module_level: "
        "TypeError: cannot pickle '_thread.lock' object"
    )
    with pytest.raises(CheckpointError, match=r"^call 7: its function or arguments cannot be"):
        pickle_call(7, _module_level, (threading.Lock(),), {})
    with pytest.raises(CheckpointError, match=r"the training script's module \(__main__\)"):
        dumps(sys.modules["__main__"])
    uses.__module__ = "__main__"  # as if the training script's: by name, then unresolvable
    with pytest.raises(CheckpointError, match=r"^_lru_cache_wrapper __main__\..*<locals>\.uses "):
        dumps(functools.lru_cache(uses))


def test_another_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        quicksave.worker.fnpickle, "_INTERPRETER", ("cpython-39", b"\x61\x0d\r\n", "3.9.0")
    )
    payload = dumps(lambda: 1)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"was pickled by Python 3\.9\.0 \(cpython-39\)"):
        loads(payload)


# -------------------------------------------------------- end to end, in the worker
# The trainer's own worker process (ProcessPersister: a fresh interpreter that does not
# run the script) runs a function of the script's __main__ with a tensor argument.
E2E = """
import os, sys
import torch
from quicksave.errors import CheckpointError
from quicksave.worker.persisters import ProcessPersister

OUT = sys.argv[1]
state = {"w": torch.arange(4.0)}


class Note:
    pass


def save(path, sd, tag):
    torch.save({k: v * 2 for k, v in sd.items()}, path)
    with open(path + ".tag", "w") as f:
        f.write(f"{tag} {os.getpid()}")


p = ProcessPersister()
try:
    try:
        p.submit_call(1, save, (OUT, state, Note()), {})
    except CheckpointError as e:
        print("REFUSED", e)
    p.submit_call(2, save, (os.path.join(OUT, "ckpt.pt"), state), {"tag": "main"})
    results = []
    while not results:
        results = p.poll(60.0)
    (r,) = results
    print("RESULT", r.job_id, r.ok, r.error or "-", os.getpid(), p.pid)
finally:
    p.close(10.0)
"""


def test_async_fn_of_the_script_runs_in_the_worker(tmp_path: Path) -> None:
    script = tmp_path / "e2e.py"
    script.write_text(E2E)
    out = _run_script(script, str(tmp_path)).stdout
    refused, result = out.splitlines()
    assert refused.startswith(
        "REFUSED call 1: its function or arguments cannot be sent to the worker process "
        "(an instance of class __main__.Note cannot be sent"
    ), out
    _, job_id, ok, error, trainer, worker = result.split(" ")
    assert (job_id, ok, error) == ("2", "True", "-") and trainer != worker
    assert (tmp_path / "ckpt.pt.tag").read_text() == f"main {worker}"
    loaded = torch.load(tmp_path / "ckpt.pt")
    assert torch.equal(loaded["w"], torch.arange(4.0) * 2)
