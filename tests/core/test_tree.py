"""ember.core.tree: counts, bytes and the summary table."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.byte_sizes import format_bytes
from ember.core.tree import param_bytes, param_count, summary, summary_rows


def params():
    return {
        "decoder": {
            "attn": {"q": jnp.ones((4, 8)), "k": jnp.ones((4, 8))},
            "mlp": {"w": jnp.ones((8, 2), jnp.bfloat16)},
        },
        "embed": {"table": jnp.ones((10, 4))},
    }


def test_counts_and_bytes():
    assert param_count(params()) == 32 + 32 + 16 + 40
    assert param_bytes(params()) == (32 + 32 + 40) * 4 + 16 * 2
    abstract = jax.eval_shape(params)
    assert param_count(abstract) == 120 and param_bytes(abstract) == param_bytes(params())


def test_boxed_flax_params_are_counted():
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(
                3, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            )(x)

    variables = Dense().init(jax.random.key(0), jnp.ones((1, 5)))
    assert param_count(variables) == 5 * 3 + 3


def test_summary_groups_by_module():
    rows = {r["module"]: r for r in summary_rows(params(), depth=2)}
    assert rows["decoder/attn"]["params"] == 64 and rows["decoder/mlp"]["dtypes"] == ["bfloat16"]
    assert rows["embed"]["params"] == 40
    text = summary(params(), depth=1)
    lines = text.splitlines()
    assert lines[0].split() == ["module", "params", "bytes", "dtypes"]
    assert any(line.split()[:2] == ["decoder", "80"] for line in lines)
    assert lines[-1].split()[:2] == ["total", "120"]


def test_format_bytes():
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**30) == "3.0 GiB"
