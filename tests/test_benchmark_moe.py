"""benchmarks/moe.py: the timed forms get the problem's dtype (on the H200 the grouped
matmul's rows failed because a float64 scale had promoted the bf16 weights to f32)."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import moe


def test_grouped_matmul_forms_keep_the_problem_dtype():
    sizes = moe.Sizes(problems=(moe.Problem(4, 32, 16, 8),), loads=("skewed",), dtype="bfloat16", impl="xla", repeats=1)
    problem = sizes.problems[0]
    group_sizes = moe.group_sizes_for("skewed", problem.experts, problem.rows)
    forms = moe.forms_for(sizes, problem, group_sizes, jnp.bfloat16, jax.random.key(0))
    for form, (fn, args) in forms.items():
        floats = [a for a in args if jnp.issubdtype(a.dtype, jnp.floating)]
        assert floats and all(a.dtype == jnp.bfloat16 for a in floats), form
        assert fn(*args).shape[-1] == problem.n, form
    assert int(np.sum(group_sizes)) == problem.rows
