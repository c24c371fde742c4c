"""Weight files: a round trip restores the model exactly; anything that does not fit is an
error naming the keys."""

from __future__ import annotations

import pytest
import torch

from harts.exec.model import PackedContext, WeightLoadError, build_model


def _out(model):
    ids = torch.arange(20) % model.config.vocab_size
    return model(ids, PackedContext(torch.tensor([0, 8, 20]), chunk_size=16)).hidden_TD


def test_round_trip_restores_outputs(make_config, tmp_path):
    config = make_config()
    src = build_model(config, seed=1)
    src.save_state_dict_file(tmp_path / "w.pt")
    dst = build_model(config, seed=2, dtype=torch.float64)
    assert not torch.equal(src.embed.weight.double(), dst.embed.weight)
    dst.load_state_dict_file(tmp_path / "w.pt")
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert b.dtype == torch.float64 and torch.equal(a.double(), b), name
    assert torch.equal(_out(src.double()), _out(dst))


def test_missing_unexpected_and_misshaped_keys_are_named(make_config, tmp_path):
    config = make_config()
    model = build_model(config)
    state = model.state_dict()
    state.pop("layers.0.mixer.A_log")
    state["layers.9.extra"] = torch.zeros(3)
    state["embed.weight"] = torch.zeros(5, 5)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(WeightLoadError) as info:
        model.load_state_dict_file(tmp_path / "bad.pt")
    msg = str(info.value)
    assert "1 missing: layers.0.mixer.A_log" in msg
    assert "1 unexpected: layers.9.extra" in msg
    assert "1 mis-shaped: embed.weight (file (5, 5), model (64, 32))" in msg
    # nothing was half-loaded
    assert not torch.equal(model.embed.weight, torch.zeros_like(model.embed.weight))


def test_other_config_and_bad_files(make_config, tmp_path):
    build_model(make_config(num_experts=6)).save_state_dict_file(tmp_path / "other.pt")
    model = build_model(make_config())
    with pytest.raises(WeightLoadError, match="mis-shaped: layers.1.ffn.router.weight"):
        model.load_state_dict_file(tmp_path / "other.pt")
    with pytest.raises(WeightLoadError, match="no such weights file"):
        model.load_state_dict_file(tmp_path / "absent.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightLoadError, match="not a torch.save weights file"):
        model.load_state_dict_file(tmp_path / "junk.pt")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(WeightLoadError, match="expected a dict"):
        model.load_state_dict_file(tmp_path / "list.pt")
    state = model.state_dict()
    state["norm.weight"] = torch.full_like(state["norm.weight"], float("nan"))
    torch.save(state, tmp_path / "nan.pt")
    with pytest.raises(WeightLoadError, match="non-finite values in norm.weight"):
        model.load_state_dict_file(tmp_path / "nan.pt")
