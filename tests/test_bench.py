"""kernels.bench's arithmetic and tables on made-up timings (the timing itself needs a GPU: its figures
are in docs/benchmarks.md, with the card named)."""

from __future__ import annotations

import pytest

from kernels import bench


def _row(**ms):
    row = {"d": 128, "n": 4096, "causal": True, "dtype": "fp16", "batch": 4, "heads": 16, "peers": [],
           "not_run": {"sdpa_cudnn": "RuntimeError: No available kernel."}, "max_diff": 1e-3}
    for name, (fwd, bwd) in ms.items():
        row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"] = fwd, bwd
        if name != "triton":
            row["peers"].append(name)
    return bench.finish_row(row)


def test_the_ratio_is_to_the_fastest_peer_of_each_kind():
    r = _row(triton=(1.0, 3.0), sdpa_flash=(1.5, 2.0), flex=(0.8, 4.0))
    flops = 4.0 * 4 * 16 * 4096 * 4096 * 128 / 2  # causal halves the forward
    assert r["triton_fwd_tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    assert r["triton_bwd_tflops"] == pytest.approx(2.5 * flops / 3e-3 / 1e12)
    assert (r["best_fwd"], r["best_bwd"]) == ("flex", "sdpa_flash")  # each kind its own fastest
    assert r["fwd_ratio"] == pytest.approx(0.8) and r["bwd_ratio"] == pytest.approx(2.0 / 3.0)


def test_a_row_without_peers_has_no_ratio_and_the_table_says_so():
    r = _row(triton=(1.0, 3.0))
    assert r["best_fwd"] is None and r["fwd_ratio"] is None
    text = bench.markdown([r], "header")
    line = next(l for l in text.splitlines() if l.startswith("| 128 | 4096 | 4 x 16 |"))
    assert "| - | - |" in line


def test_the_tables_name_the_fastest_peer_every_peer_and_why_one_did_not_run():
    r = _row(triton=(1.0, 3.0), sdpa_flash=(1.5, 2.0), flex=(0.8, 4.0))
    text = bench.markdown([r], "Triton FA2 beside the fastest attention on a card")
    first = next(l for l in text.splitlines() if l.startswith("| 128 | 4096 | 4 x 16 |"))
    assert f"{r['flex_fwd_tflops']:.0f} (flex) | 0.80 |" in first and "(sdpa_flash) | 0.67 |" in first
    assert "| triton | sdpa_flash | sdpa_cudnn | flex |" in text  # the peers' table, cudnn as not run
    assert "- sdpa_cudnn: RuntimeError: No available kernel." in text


def test_the_table_file_is_replaced_whole(tmp_path):
    path = tmp_path / "bench.md"
    bench.write_atomically(str(path), "one\n")
    bench.write_atomically(str(path), "two\n")
    assert path.read_text() == "two\n" and [p.name for p in tmp_path.iterdir()] == ["bench.md"]


@pytest.mark.skipif(bench.torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert bench.main(["--dims", "64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_atomic_dq_backward_gets_its_own_columns_and_ratio_to_the_same_peer():
    r = _row(triton=(1.0, 3.0), sdpa_flash=(1.5, 2.0))
    plain = bench.markdown([r], "header")
    assert "atomic dQ" not in plain
    r["triton_atomic_bwd_ms"] = 2.5
    r = bench.finish_row(r)
    assert r["atomic_bwd_ratio"] == pytest.approx(2.0 / 2.5)  # against the fastest peer's backward
    text = bench.markdown([r], "header")
    assert "| bwd Triton atomic dQ | its ratio |" in text
    line = next(l for l in text.splitlines() if l.startswith("| 128 | 4096 | 4 x 16 |"))
    assert f"| {r['triton_atomic_bwd_tflops']:.0f} | 0.80 |" in line
    assert line.count("|") == text.splitlines()[3].count("|")  # as many cells as the header's rule


def test_a_row_whose_forward_ran_in_gluon_says_so():
    r = _row(triton=(1.0, 3.0), flex=(0.8, 4.0))
    plain = bench.markdown([r], "header")
    assert "(gluon)" not in plain
    r["fwd_kernel"] = "gluon"
    text = bench.markdown([r], "header")
    line = next(l for l in text.splitlines() if l.startswith("| 128 | 4096 | 4 x 16 |"))
    assert f"| {r['triton_fwd_tflops']:.0f} (gluon) | " in line
    assert f"{bench.gluon_env()}=0 keeps the Triton one" in text


def test_a_row_whose_backward_ran_gluon_dkdv_says_so():
    r = _row(triton=(1.0, 3.0), flex=(0.8, 4.0))
    r["fwd_kernel"] = "gluon"
    text = bench.markdown([r], "header")
    assert "kernels/gluon_backward.py" not in text
    r["bwd_kernel"] = "gluon"
    text = bench.markdown([r], "header")
    line = next(l for l in text.splitlines() if l.startswith("| 128 | 4096 | 4 x 16 |"))
    assert f"| {r['triton_bwd_tflops']:.0f} (gluon) | " in line
    assert line.count("|") == text.splitlines()[3].count("|")
    assert "dK/dV kernel was the Gluon one of kernels/gluon_backward.py" in text


def test_rounds_reverse_the_order_every_other_round_and_keep_the_median():
    """No measurement is always timed first after a row's setup (the first one read slow on an H200): the
    order flips every round, and each figure is the median of its rounds."""
    calls = []
    made_up = {"a": [5.0, 1.0, 2.0], "b": [3.0, 9.0, 4.0], "c": [7.0, 7.0, 6.0]}

    def time(fn):
        calls.append(fn)
        return made_up[fn].pop(0)

    got = bench.timed_in_rounds({"a_ms": "a", "b_ms": "b", "c_ms": "c"}, 3, time=time)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert got == {"a_ms": 2.0, "b_ms": 4.0, "c_ms": 7.0}


def test_rounds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "--rounds 0: should be 1 or more" in capsys.readouterr().err
