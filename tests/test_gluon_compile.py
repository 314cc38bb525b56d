"""tests/gluon_compile.py: the workers of one pytest-xdist run split a body's builds between their
processes and read each other's records."""

import threading
import uuid

from tests import gluon_compile

# a body whose builds record which process ran them (compile_one replaced: no kernel is compiled)
_BODY = r"""
import os, time

def compile_one(fn, signature, constexprs):
    time.sleep(0.8)
    return {"pid": os.getpid(), "key": signature}

for i in range(8):
    build(f"k{i}", None, f"k{i}", None)
"""


def test_two_processes_of_one_run_split_the_builds_and_share_the_records(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", uuid.uuid4().hex)
    out = [None, None]

    def run(i):
        out[i] = gluon_compile.results(_BODY)

    threads = [threading.Thread(target=run, args=(i, )) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] == out[1]  # the same record for every key in both
    assert sorted(out[0]) == [f"k{i}" for i in range(8)]
    assert all(record["key"] == key for key, record in out[0].items())
    assert len({record["pid"] for record in out[0].values()}) == 2  # each process compiled some


def test_a_claimed_build_never_written_is_built_by_the_process_that_waits(monkeypatch, tmp_path):
    run_id = uuid.uuid4().hex
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run_id)
    monkeypatch.setenv("GLUON_COMPILE_WAIT", "1")
    first = gluon_compile.results(_BODY)  # every key built and written by one process
    assert len({record["pid"] for record in first.values()}) == 1
    shared = gluon_compile.shared_directory(_BODY)
    (shared / "k3.json").unlink()  # as if the process that claimed k3 had died before writing it
    second = gluon_compile.results(_BODY)
    assert second["k3"]["pid"] != first["k3"]["pid"]  # built again, by the waiting process
    assert all(second[key] == first[key] for key in first if key != "k3")  # read, not built
