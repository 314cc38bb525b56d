"""The report of one ``pytest verify`` run: measurements streamed as JSON lines while the run goes,
failing cases as replayable JSON files, and a summary written at the end.

Nothing is lost if the run dies: each measurement is one line, flushed as soon as it is taken; every
other file is written to a temporary name and renamed into place (atomic on POSIX). Under
pytest-xdist each worker writes its own stream (``measurements-gw0.jsonl``, ...) and its own
``run-<worker>.json``; the controller merges them at the end (:mod:`reports.summary`).

Files of a report directory:

``run-<worker>.json``          what ran (implementations, device, versions, command); ``finished`` is
                               added when the worker ends normally, so a killed run shows as partial;
                               ``stopped`` when the run ended early on purpose (a sticky CUDA error):
                               the test that stopped it and the tests not run
``measurements-<worker>.jsonl`` one JSON object per measurement, in the order they were taken
``coverage-<worker>.jsonl``    one JSON object per test: the boundary classes its examples reached
``memory-<worker>.jsonl``      one JSON object per test on a GPU: its peak device memory and the budget
``margins-<worker>.jsonl``     one JSON object per metamorphic comparison: its difference over its tolerance
``failures/*.json``            one per failing test: the shrunk case and the command that replays it
``summary.json``, ``report.md``, ``report.html``  written at the end, or by ``python -m reports summarise``
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any



def replay_command(*, impl: str, prop: str, case: dict, device: str) -> str:
    """The shell command that replays one case (its ``to_dict()``) of one property on ``impl`` (its
    ``--impl`` spec): the one form every failure message, failure file and report shows."""
    parts = ["python", "-m", "verify.replay", "--impl", impl, "--property", prop, "--device", device,
             "--case", json.dumps(case, separators=(",", ":"))]
    return " ".join(shlex.quote(p) for p in parts)



def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (write a sibling temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes the file private; a report is an ordinary file
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN/inf: keep them readable as strings ("nan", "inf", "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def dumps(value: Any, **kwargs) -> str:
    """``json.dumps`` of ``value`` with non-finite floats written as strings and anything else JSON
    cannot hold written as its ``str`` (strict JSON out, never an exception mid-run)."""
    return json.dumps(_jsonable(value), allow_nan=False, default=str, **kwargs)


REPORT_FILES = ("measurements-*.jsonl", "coverage-*.jsonl", "memory-*.jsonl", "margins-*.jsonl", "run-*.json", "failures/*.json", "summary.json", "report.md",
                "report.html", ".*.tmp", "failures/.*.tmp")


def clear_report_dir(report_dir: str | os.PathLike) -> None:
    """Remove the files of an earlier run (only the files a run writes, nothing else)."""
    root = Path(report_dir)
    for pattern in REPORT_FILES:
        for path in root.glob(pattern):
            path.unlink(missing_ok=True)


def command_line(args) -> str:
    """The ``pytest`` command line of a run, quoted for a POSIX shell (``config.invocation_params.args``)."""
    return " ".join(shlex.quote(str(a)) for a in ("pytest", *args))


def safe_file_name(text: str, *, limit: int = 150) -> str:
    """``text`` reduced to characters that are safe in a file name on every platform."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[-limit:].lstrip(".") or "unnamed"


def read_jsonl(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of one JSON-lines file, and the number of unreadable lines (a killed run's
    truncated last line, say: counted and skipped, never fatal). A missing file has none."""
    rows, bad = [], 0
    if not Path(path).exists():
        return rows, bad
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def read_stream(report_dir: str | os.PathLike, name: str) -> tuple[list[dict[str, Any]], int]:
    """Every JSON object of the ``<name>-<worker>.jsonl`` streams of a report directory, in file order,
    each with a ``worker`` field (from its file name) if it has none, and the number of unreadable lines."""
    rows, bad = [], 0
    for path in sorted(Path(report_dir).glob(f"{name}-*.jsonl")):
        worker = path.stem.removeprefix(f"{name}-")
        got, unreadable = read_jsonl(path)
        for row in got:
            row.setdefault("worker", worker)
        rows += got
        bad += unreadable
    return rows, bad


def read_runs(report_dir: str | Path) -> list[dict]:
    """The ``run-<worker>.json`` headers, one per worker (the xdist controller's is ``main``)."""
    runs = []
    for path in sorted(Path(report_dir).glob("run-*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            data = {"unreadable": True}
        if not isinstance(data, dict):
            data = {"unreadable": True}
        data.setdefault("worker", path.stem.removeprefix("run-"))
        runs.append(data)
    return runs


class ReportSession:
    """Writes the report of one run into ``report_dir`` (one stream per worker)."""

    def __init__(self, report_dir: str | os.PathLike, *, worker: str = "main", header: dict | None = None):
        self.dir = Path(report_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "failures").mkdir(exist_ok=True)
        self.worker = worker
        self.stream_path = self.dir / f"measurements-{worker}.jsonl"
        self._stream = open(self.stream_path, "a", encoding="utf-8")
        self.counts = {"measurements": 0, "failed_measurements": 0, "failures": 0}
        self.started = time.time()
        self.header = {"worker": worker, "pid": os.getpid(),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
                       **(header or {})}
        self._write_run_file()

    @property
    def run_path(self) -> Path:
        return self.dir / f"run-{self.worker}.json"

    def _write_run_file(self, **extra) -> None:
        write_atomic(self.run_path, dumps({**self.header, **extra}, indent=2))

    def doing(self, what: str | None) -> None:
        """Say in this worker's run file what it is doing (``None``: nothing in particular), so that a process
        that dies there (a segmentation fault in a kernel) leaves a report that names it."""
        if what is None:
            self.header.pop("doing", None)
        else:
            self.header["doing"] = what
        self._write_run_file()

    def record(self, measurement: dict[str, Any]) -> None:
        """Append one measurement to the stream and flush it (one line, readable if the run dies)."""
        line = dumps({"t": round(time.time() - self.started, 4), **measurement})
        self._stream.write(line + "\n")
        self._stream.flush()
        self.counts["measurements"] += 1
        if measurement.get("pass") is False:
            self.counts["failed_measurements"] += 1

    def coverage(self, entry: dict[str, Any]) -> None:
        """Append one test's coverage record (the boundary classes reached) to ``coverage-<worker>.jsonl``."""
        with open(self.dir / f"coverage-{self.worker}.jsonl", "a", encoding="utf-8") as fh:
            fh.write(dumps(entry) + "\n")

    def memory(self, entry: dict[str, Any]) -> None:
        """Append one test's peak device memory record to ``memory-<worker>.jsonl``."""
        self._append("memory", entry)

    def timing(self, entry: dict[str, Any]) -> None:
        """Append one test's wall time and its seconds per stage to ``timing-<worker>.jsonl``."""
        self._append("timing", entry)

    def margin(self, entry: dict[str, Any]) -> None:
        """Append one metamorphic comparison (its difference over its tolerance) to ``margins-<worker>.jsonl``."""
        self._append("margins", entry)

    def _append(self, stream: str, entry: dict[str, Any]) -> None:
        with open(self.dir / f"{stream}-{self.worker}.jsonl", "a", encoding="utf-8") as fh:
            fh.write(dumps(entry) + "\n")

    def failure(self, *, test: str, message: str, replay: str | None, case: dict | None,
                prop: str | None, implementation: str | None, note: str | None = None) -> Path:
        """Write the failure file of one failing test (atomically) and return its path."""
        path = self.dir / "failures" / f"{safe_file_name(test)}.json"
        data = {"test": test, "implementation": implementation, "property": prop, "case": case,
                "replay": replay, "message": message, "worker": self.worker}
        if note:
            data["note"] = note
        write_atomic(path, dumps(data, indent=2))
        self.counts["failures"] += 1
        return path

    def close(self, *, outcomes: dict | None = None, exitstatus: int | None = None,
              stopped: dict | None = None) -> None:
        """End the stream and mark this worker's run as finished (a killed run never gets here);
        ``stopped``: the run ended early on purpose (``{"test", "reason", "not_run"}``)."""
        if self._stream.closed:
            return
        self._stream.close()
        extra: dict[str, Any] = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 "duration_s": round(time.time() - self.started, 3), "counts": self.counts}
        if outcomes is not None:
            extra["outcomes"] = outcomes
        if exitstatus is not None:
            extra["exitstatus"] = int(exitstatus)
        if stopped is not None:
            extra["stopped"] = stopped
        self._write_run_file(**extra)


def versions() -> dict:
    """The versions a run header records: Python, torch, Triton (None when not installed), CUDA,
    Hypothesis (None when not installed). Imports them only when called."""
    import torch

    def version_of(name: str):
        try:
            return __import__(name).__version__
        except ImportError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__, "triton": version_of("triton"),
            "cuda": torch.version.cuda, "hypothesis": version_of("hypothesis")}


def device_name(device: str) -> str:
    """The GPU's name for a ``cuda`` device, else the processor's."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()
