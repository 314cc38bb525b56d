"""flashverify_kernels.triton.bench's arithmetic and tables on made-up timings (the timing itself needs a GPU: its figures
are in docs/benchmarks.md, with the card named)."""

from __future__ import annotations

import collections

import pytest

from flashverify_kernels.triton import bench


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
    assert "flashverify_kernels/hopper/backward.py" not in text
    r["bwd_kernel"] = "gluon"
    text = bench.markdown([r], "header")
    line = next(l for l in text.splitlines() if l.startswith("| 128 | 4096 | 4 x 16 |"))
    assert f"| {r['triton_bwd_tflops']:.0f} (gluon) | " in line
    assert line.count("|") == text.splitlines()[3].count("|")
    assert "dK/dV kernel was the Gluon one of flashverify_kernels/hopper/backward.py" in text


def test_each_pass_has_its_own_order_so_a_call_follows_every_call_about_as_often():
    keys = ["tf", "tb", "cf", "cb"]
    order = bench.interleaved_order(keys, 2000, seed=1)
    assert len(order) == 8000
    passes = [order[i:i + 4] for i in range(0, len(order), 4)]
    assert all(sorted(p) == sorted(keys) for p in passes)  # every key once a pass
    follows = collections.Counter(zip(order, order[1:]))
    # each of the 12 (predecessor, key) pairs of two keys about as often (a fixed rotation would give each key
    # one predecessor almost always), and a key after itself across passes too
    others = [c for (x, y), c in follows.items() if x != y]
    mean = sum(others) / 12
    assert len(others) == 12 and all(0.8 * mean < c < 1.2 * mean for c in others)
    assert all(follows[(key, key)] > 50 for key in keys)
    for key in keys:  # every place in a pass about equally often
        places = collections.Counter(p.index(key) for p in passes)
        assert all(400 < places[i] < 600 for i in range(4))
    assert order == bench.interleaved_order(keys, 2000, seed=1)  # the same seed, the same order


def _fake_clock(speed, drift_per_call=0.0, first_pass_ms=50.0):
    """A made-up GPU: each call of fn ``f`` takes ``speed[f]`` ms, times a clock that slows by
    ``drift_per_call`` a call; the first pass of each round (the estimate) reads ``first_pass_ms``."""
    state = {"calls": 0, "batches": 0, "seen": []}

    def times(fns):
        state["batches"] += 1
        state["seen"].append(list(fns))
        if state["batches"] % 2 == 1:  # each round's first pass, which only sizes the round
            return [first_pass_ms for _ in fns]
        out = []
        for fn in fns:
            out.append(speed[fn] * (1 + drift_per_call * state["calls"]))
            state["calls"] += 1
        return out
    return times, state


def test_interleaved_timing_keeps_the_median_of_every_call_and_each_rounds_median():
    times, state = _fake_clock({"a": 1.0, "b": 2.0}, drift_per_call=0.1)
    got = bench.timed_interleaved({"a_ms": "a", "b_ms": "b"}, 2, times=times, budget_ms=30.0)
    # the round's size from its first pass: 30 ms a measurement over 50 + 50 ms a pass, so the least, 3
    # passes; round r in interleaved_order's order of seed r
    assert state["seen"][0] == ["a", "b"] and state["seen"][2] == ["a", "b"]
    assert state["seen"][1] == [k[0] for k in bench.interleaved_order(["a_ms", "b_ms"], 3, seed=0)] == list("baabba")
    assert state["seen"][3] == [k[0] for k in bench.interleaved_order(["a_ms", "b_ms"], 3, seed=1)] == list("abbaba")
    # calls b a a b b a | a b b a b a at clock 1.0, 1.1, ... 2.1; the first passes' 50 ms not among them
    assert got["rounds_ms"]["a_ms"] == pytest.approx([1.2, 1.9])  # of 1.1 1.2 1.5 | 1.6 1.9 2.1
    assert got["rounds_ms"]["b_ms"] == pytest.approx([2.6, 3.6])  # of 2.0 2.6 2.8 | 3.4 3.6 4.0
    assert got["a_ms"] == pytest.approx(1.55) and got["b_ms"] == pytest.approx(3.1)


def test_a_clock_that_drifts_during_a_round_reaches_both_measurements_alike():
    """Two equally fast kernels under a clock that slows by 20% over the round: interleaved, their ratio
    stays within a pass's drift of 1, where one measured after the other would read about 10% apart."""
    times, state = _fake_clock({"a": 1.0, "b": 1.0}, drift_per_call=0.0001, first_pass_ms=0.05)
    got = bench.timed_interleaved({"a_ms": "a", "b_ms": "b"}, 1, times=times, budget_ms=50.0)
    assert state["calls"] == 2000  # 1000 passes, the most a round takes
    assert 1.05 < got["a_ms"] < 1.15  # the drift was there
    assert abs(got["a_ms"] / got["b_ms"] - 1) < 0.002


def test_the_ratio_shows_its_lowest_and_highest_round():
    row = _row(triton=(1.0, 2.0), sdpa_cudnn=(1.1, 1.8))
    row.update(rounds=3, rounds_ms={"triton_fwd_ms": [1.0, 1.1, 1.0], "sdpa_cudnn_fwd_ms": [1.1, 1.1, 0.9],
                                    "triton_bwd_ms": [2.0, 2.0, 2.0], "sdpa_cudnn_bwd_ms": [1.8, 1.8, 1.9]})
    row = bench.finish_row(row)
    assert row["fwd_ratio_range"] == pytest.approx([0.9, 1.1])
    assert row["bwd_ratio_range"] == pytest.approx([0.9, 0.95])
    text = bench.markdown([row], "header")
    assert "| 1.10 (0.90-1.10) |" in text and "| 0.90 (0.90-0.95) |" in text


def test_rounds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "--rounds 0: should be 1 or more" in capsys.readouterr().err
