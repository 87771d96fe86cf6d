"""benchmarks/ssm.py's model sizing and cache accounting, against hand-computed numbers
(from shapes alone: nothing compiles here; the timings themselves are the script's job)."""

import dataclasses

import pytest

from benchmarks import ssm
from ember.models.config import ModelConfig

# 4 layers, 4 heads of 16, pages of 16 tokens, float32.
TRANSFORMER = ModelConfig(vocab_size=512, d_model=64, num_layers=4, num_heads=4, mlp_dim=256, page_size=16)


def test_one_sequence_cache_is_kv_pages_for_attention_and_a_constant_slot_for_linear_attention():
    page = 4 * 2 * 16 * 4 * 16 * 4  # layers * (k, v) * page_size * kv_heads * head_dim * float32
    assert ssm.sequence_cache_bytes(TRANSFORMER, 100) == {
        "state_bytes": 0,
        "kv_bytes": 7 * page,
        "total_bytes": 7 * page,
    }
    linear = dataclasses.replace(TRANSFORMER, block_pattern=("linear",))
    slot = 4 * 4 * 16 * (16 + 1) * 4  # layers * heads * feature_dim * (head_dim + normaliser) * float32
    for context in (100, 5000):
        assert ssm.sequence_cache_bytes(linear, context) == {"state_bytes": slot, "kv_bytes": 0, "total_bytes": slot}


def test_equal_size_takes_the_layer_count_nearest_the_transformers_parameters(monkeypatch):
    embed = 512 * 64 + 64  # embedding + final norm
    target = embed + 4 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64)  # attention, SwiGLU, two norms per layer
    assert ssm.count_params(TRANSFORMER) == target
    assert ssm.with_pattern(TRANSFORMER, ("linear",)).num_layers == 4  # the same parameters per layer
    # Without its MLP a layer holds 4 * 64 * 64 + 64: the nearest count is 16 layers ((target - embed) / 16448 = 15.97).
    monkeypatch.setattr(ssm, "NO_MLP_KINDS", ("linear",))
    config = ssm.with_pattern(TRANSFORMER, ("linear",))
    assert config.mlp_pattern == ("none",) and config.num_layers == 16
    assert ssm.count_params(config) == embed + 16 * (4 * 64 * 64 + 64)
    hybrid = ssm.model_configs("linear", TRANSFORMER)["hybrid"]
    assert hybrid.block_pattern == ("linear", "linear", "linear", "global") and hybrid.num_layers % 4 == 0


@pytest.mark.parametrize("kind", ["global", "local", "mamba9"])
def test_only_state_kinds_are_measured(kind, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["ssm", "--ssm-kind", kind])
    with pytest.raises(SystemExit) as exit_info:
        ssm.main()
    assert exit_info.value.code == 2
    assert f"--ssm-kind '{kind}' is not a state layer kind here" in capsys.readouterr().err
