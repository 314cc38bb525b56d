"""The report of one ``pytest verify`` run: measurements streamed as JSON lines while the run goes,
failing cases as replayable JSON files, and a summary written at the end.

Nothing is lost if the run dies: each measurement is one line, flushed as soon as it is taken; every
other file is written to a temporary name and renamed into place (atomic on POSIX).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (write a sibling temp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return repr(value)  # JSON has no NaN/inf: keep them readable as strings
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


REPORT_FILES = ("measurements-*.jsonl", "run-*.json", "failures/*.json", "summary.json", "report.md",
                "report.html")


def clear_report_dir(report_dir: str | os.PathLike) -> None:
    """Remove the files of an earlier run (only the files a run writes, nothing else)."""
    root = Path(report_dir)
    for pattern in REPORT_FILES:
        for path in root.glob(pattern):
            path.unlink(missing_ok=True)


class ReportSession:
    """Writes the report of one run into ``report_dir`` (one stream per worker)."""

    def __init__(self, report_dir: str | os.PathLike, *, worker: str = "main", header: dict | None = None):
        self.dir = Path(report_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "failures").mkdir(exist_ok=True)
        self.worker = worker
        self.stream_path = self.dir / f"measurements-{worker}.jsonl"
        self._stream = open(self.stream_path, "a", encoding="utf-8")
        self.counts = {"measurements": 0, "failed_measurements": 0}
        self.started = time.time()
        if header is not None:
            write_atomic(self.dir / f"run-{worker}.json", json.dumps(_jsonable(header), indent=2))

    def record(self, measurement: dict[str, Any]) -> None:
        line = json.dumps(_jsonable({"t": round(time.time() - self.started, 4), **measurement}))
        self._stream.write(line + "\n")
        self._stream.flush()
        self.counts["measurements"] += 1
        if measurement.get("pass") is False:
            self.counts["failed_measurements"] += 1

    def failure(self, *, test: str, message: str, replay: str | None, case: dict | None,
                prop: str | None, implementation: str | None) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in test)[-150:]
        path = self.dir / "failures" / f"{safe}.json"
        write_atomic(path, json.dumps(_jsonable({
            "test": test, "implementation": implementation, "property": prop, "case": case,
            "replay": replay, "message": message}), indent=2))
        return path

    def close(self) -> None:
        if not self._stream.closed:
            self._stream.close()
