"""ember.core.integers: integers of Python and NumPy pass; bools, floats and strings do not."""

import numpy as np
import pytest

from ember.core.integers import is_integer


@pytest.mark.parametrize("value", [0, -3, 2**40, np.int32(7), np.uint8(255), np.int64(-1)])
def test_integers_pass(value):
    assert is_integer(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, np.float32(2), "1", None, [1]])
def test_bools_and_other_values_do_not(value):
    assert not is_integer(value)
