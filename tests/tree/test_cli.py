"""`harts workload generate` and `harts tree stats`, through the real entry point."""

from __future__ import annotations

import json

from harts.cli.main import main
from harts.tree import load_jsonl


def test_generate_then_stats_json_is_exact(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert main(["workload", "generate", "--workload", "tiny-stepwise", "--seed", "5", "--out", str(out)]) == 0
    trajs = load_jsonl(out)
    capsys.readouterr()
    assert main(["tree", "stats", "--input", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    expanded = sum(len(t) for t in trajs)
    prefixes = {(t.group, tuple(t.tokens[: p + 1].tolist())) for t in trajs for p in range(len(t))}
    assert stats["expanded_tokens"] == expanded
    assert stats["compact_tokens"] == len(prefixes)
    assert stats["compression"] == expanded / len(prefixes)


def test_stats_table_and_workload_overrides(capsys):
    assert main(["tree", "stats", "--workload", "swe-treestep-8", "--set", "num_groups=2"]) == 0
    text = capsys.readouterr().out
    assert "compression" in text and "expanded tokens" in text
    assert main(["tree", "stats", "--workload", "swe-treestep-8", "--set", "num_groups=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] == 2


def test_user_errors_exit_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "group": "g", "tokens": [1, -1], "loss_mask": [0, 1], '
                   '"advantage": 0, "old_logprobs": [0, 0]}\n')
    assert main(["tree", "stats", "--input", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "line 1: field 'tokens': position 1 is negative" in err
    assert main(["tree", "stats", "--workload", "nope"]) == 2
    assert main(["tree", "stats", "--workload", "tiny-treestep", "--set", "bogus=1"]) == 2


def test_shape_instance_written_is_the_drawn_one(tmp_path, capsys):
    from harts.tree import shapes

    out = tmp_path / "s.jsonl"
    assert main(["workload", "shape", "--instance", "long-agent/2@1024", "--vocab-size", "512", "--out", str(out),
                 "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    got, want = load_jsonl(out), shapes.draw("long-agent", 2, 1024, vocab_size=512)
    assert [t.id for t in got] == [t.id for t in want]
    assert all(a.tokens.tolist() == b.tokens.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
               for a, b in zip(got, want, strict=True))
    assert info["trajectories"] == len(want) and info["longest"] == max(len(t) for t in want) > 1024
    for bad, msg in (("grpo-1", "is not FAMILY/SEED@BUDGET"), ("nope/1@1024", "unknown family 'nope'"),
                     ("grpo/1@100", "at least 256")):
        assert main(["workload", "shape", "--instance", bad, "--out", str(tmp_path / "x.jsonl")]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.jsonl").exists()
