"""``python -m reports merge OUT DIR1 DIR2 ...``: one report from the report folders of a run split into shards
(``pytest verify --shard K/N`` on N runners).

Every stream and run header of shard ``i`` is copied under the worker name ``s<i>-<worker>`` (so nothing of
one shard overwrites another's), the failure files side by side, and a ``run-main.json`` is written for the
whole: the first shard's header (device, profile, versions, implementations), the tests' outcomes added up,
finished only if every shard finished, and the shards' commands. The summary, ``report.md`` and
``report.html`` are then written from the copies, as for one run.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

from reports.session import dumps, read_runs, write_atomic


class MergeError(ValueError):
    """A folder that cannot be merged: not a report, or the output folder among the inputs."""


def merge(out: str | Path, shard_dirs: list[str | Path]) -> Path:
    """Copy the shards' report folders into ``out`` (created; its report files replaced) and write the merged
    ``run-main.json``; the caller writes the summary (:func:`reports.write.write_summary`)."""
    out = Path(out)
    dirs = [Path(d) for d in shard_dirs]
    if not dirs:
        raise MergeError("merge: name the report folders of the shards to merge")
    for d in dirs:
        if not d.is_dir() or not (d / "run-main.json").exists():
            raise MergeError(f"merge: {d} is not the report folder of a pytest verify run (no run-main.json)")
        if d.resolve() == out.resolve():
            raise MergeError(f"merge: the output folder {out} is also a shard's folder; write to a new one")
    out.mkdir(parents=True, exist_ok=True)
    (out / "failures").mkdir(exist_ok=True)
    mains = []
    for i, d in enumerate(dirs, start=1):
        for path in sorted(d.glob("*.jsonl")):
            stream, _, worker = path.stem.partition("-")
            shutil.copyfile(path, out / f"{stream}-s{i}-{worker}.jsonl")
        for run in read_runs(d):
            worker = run.get("worker", "main")
            if worker == "main":
                mains.append(run)
            write_atomic(out / f"run-s{i}-{worker}.json", dumps({**run, "worker": f"s{i}-{worker}"}, indent=2))
        for path in sorted((d / "failures").glob("*.json")):
            target = out / "failures" / path.name
            if target.exists():
                target = out / "failures" / f"s{i}-{path.name}"
            shutil.copyfile(path, target)
    outcomes: Counter = Counter()
    for run in mains:
        outcomes.update(run.get("outcomes") or {})
    first = mains[0]
    merged = {**first, "worker": "main", "outcomes": dict(outcomes),
              "command": "python -m reports merge of " + "; ".join(str(r.get("command")) for r in mains),
              "shards": [{"folder": str(d), "shard": r.get("shard"), "finished": r.get("finished")}
                         for d, r in zip(dirs, mains)]}
    if all(r.get("finished") for r in mains):
        merged["finished"] = max(str(r["finished"]) for r in mains)
        merged["exitstatus"] = max(int(r.get("exitstatus") or 0) for r in mains)
    else:
        merged.pop("finished", None)
        merged.pop("exitstatus", None)
    merged.pop("stopped", None)  # a shard that stopped early says so in its own header, copied above
    write_atomic(out / "run-main.json", json.dumps(merged, indent=2, default=str))
    return out
