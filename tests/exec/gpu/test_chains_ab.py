"""`benchmarks/gpu/chains.py --ab` on the CPU (its smoke mode, lengths divided by
`--scale`): the chained run again with a kernel setting, in the same process, recorded
beside the run without it, with the same plan and the same loss."""

import json

import pytest

from benchmarks.gpu import chains


@pytest.fixture(autouse=True)
def _restore_windows_module(monkeypatch):
    """chains.main sets the device and vocabulary of benchmarks/gpu/windows.py; restored after each test."""
    monkeypatch.setattr(chains.W, "DEVICE", chains.W.DEVICE)
    monkeypatch.setattr(chains.W, "VOCAB", chains.W.VOCAB)


def test_the_chained_run_is_repeated_with_the_setting(tmp_path):
    assert chains.main(["--device", "cpu", "--scale", "128", "--cases", "chain64k", "--model", "tiny-cpu",
                        "--steps", "1", "--warmup", "0", "--ab", "rectangle_triangles_min_rows=8",
                        "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "chains.json").read_text())
    cases = result["cases"]
    plain = next(v for k, v in cases.items() if k.startswith("chain64k windows@") and k.endswith("@128"))
    ab = cases["chain64k windows@128 rectangle_triangles_min_rows=8"]
    assert plain["microbatches"] == ab["microbatches"] > 1
    assert ab["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert set(result["derived"]) == {"chain64k chained@16k / unsplit",
                                      "chain64k chained@16k rectangle_triangles_min_rows=8 / unsplit"}


def test_an_unknown_setting_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        chains.main(["--device", "cpu", "--scale", "256", "--cases", "chain64k", "--ab", "no_such_field=1",
                     "--out", str(tmp_path)])
    assert not (tmp_path / "chains.json").exists()


def test_a_plan_setting_is_compared_too(tmp_path):
    """`--ab producer_retention=0.2`: the window plan's PlanConfig field, the chained run
    repeated with it (same rows, the same loss); a value the PlanConfig refuses is refused."""
    assert chains.main(["--device", "cpu", "--scale", "128", "--cases", "chain64k", "--model", "tiny-cpu",
                        "--steps", "1", "--warmup", "0", "--ab", "producer_retention=0.2",
                        "--out", str(tmp_path)]) == 0
    cases = json.loads((tmp_path / "chains.json").read_text())["cases"]
    plain = cases["chain64k windows@128"]
    ab = cases["chain64k windows@128 producer_retention=0.2"]
    assert "error" not in ab and ab["producer_retention"] == 0.2 and plain["producer_retention"] == 0.35
    assert ab["rows"] == plain["rows"]
    assert ab["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    with pytest.raises(SystemExit):
        chains.main(["--device", "cpu", "--scale", "128", "--cases", "chain64k", "--ab", "producer_retention=-1",
                     "--out", str(tmp_path)])


def test_other_lengths_by_name(tmp_path):
    """`single<N>k` and `chain<N>k` take any length, `ordinary16k` is the 16k reference
    (each chained case's peak is set against the ordinary step of its budget), and an
    unknown name is refused."""
    trajs, runs = chains.instance("single96k", scale=128)
    assert [len(t.tokens) for t in trajs] == [96 * 1024 // 128] and runs == [("windows", 256)]
    trajs, runs = chains.instance("chain48k", scale=128)
    assert [len(t.tokens) for t in trajs] == [48 * 1024 // 128] and runs == [("tree", 1024), ("windows", 128)]
    # the named cases draw what they always drew
    assert (chains.instance("chain64k", seed=3)[0][0].tokens == chains.instance("chain64k", seed=3)[0][0].tokens).all()
    with pytest.raises(KeyError, match="unknown case"):
        chains.instance("triple64k")
    assert chains.main(["--device", "cpu", "--scale", "128", "--cases", "chain48k,ordinary16k", "--model",
                        "tiny-cpu", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "chains.json").read_text())
    assert {"chain48k tree@1024", "chain48k windows@128", "ordinary16k expanded@128"} <= set(result["cases"])
    # peaks are read on CUDA only (0 on the CPU), so the CPU run derives the time ratio alone
    assert set(result["derived"]) == {"chain48k chained@16k / unsplit"}


def test_outer_stashes_in_host_memory_are_compared(tmp_path):
    """`--ab chain_stash_device_budgets=0.5`: a trajectory of four budgets run again with
    the stashes past half a budget above each reader in host memory; the same loss, and
    the moved bytes recorded per window."""
    assert chains.main(["--device", "cpu", "--scale", "256", "--cases", "single131k", "--model", "tiny-cpu",
                        "--steps", "1", "--warmup", "0", "--ab", "chain_stash_device_budgets=0.5",
                        "--out", str(tmp_path)]) == 0
    cases = json.loads((tmp_path / "chains.json").read_text())["cases"]
    plain = next(v for k, v in cases.items() if k.startswith("single131k windows@") and "=" not in k)
    ab = next(v for k, v in cases.items() if k.endswith("chain_stash_device_budgets=0.5"))
    assert "error" not in ab and ab["rows"] == plain["rows"]
    assert not any(w["stash_host_bytes"] for w in plain["windows"])
    assert sum(w["stash_host_bytes"] > 0 for w in ab["windows"]) >= 1
    assert ab["loss"] == pytest.approx(plain["loss"], rel=1e-5)


def test_a_memory_trace_needs_cuda(tmp_path):
    """`--memtrace` (one chained step under CUDA memory history) is refused on the CPU
    before any case runs."""
    with pytest.raises(SystemExit):
        chains.main(["--device", "cpu", "--scale", "256", "--cases", "single131k", "--memtrace",
                     "--out", str(tmp_path)])
    assert not (tmp_path / "chains.json").exists()
