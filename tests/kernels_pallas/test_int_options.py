"""The kernels' integer option checks: bools refused, NumPy integers accepted, None where allowed."""

import numpy as np
import pytest

from ember.kernels_pallas.int_options import (
    check_non_negative_int,
    check_num_warps,
    check_positive_int,
    check_power_of_two,
)


@pytest.mark.parametrize(
    "check, value, message",
    [
        (lambda v: check_power_of_two("block", v, 8), 4, "block must be a power of two >= 8, got 4"),
        (lambda v: check_power_of_two("block", v, 8), 24, "block must be a power of two >= 8, got 24"),
        (lambda v: check_power_of_two("block", v, 1), True, "block must be a power of two >= 1, got True"),
        (lambda v: check_power_of_two("block", v, 8), 16.0, "block must be a power of two >= 8, got 16.0"),
        (lambda v: check_positive_int("splits", v), 0, "splits must be a positive int, got 0"),
        (lambda v: check_positive_int("splits", v), True, "splits must be a positive int, got True"),
        (lambda v: check_positive_int("splits", v), None, "splits must be a positive int, got None"),
        (
            lambda v: check_positive_int("splits", v, none_means="chosen per backend"),
            -1,
            r"splits must be a positive int or None \(chosen per backend\), got -1",
        ),
        (lambda v: check_num_warps("num_warps", v), 3, "num_warps must be one of 1, 2, 4, 8, 16, got 3"),
        (lambda v: check_num_warps("num_warps", v), True, "num_warps must be one of 1, 2, 4, 8, 16, got True"),
        (lambda v: check_num_warps("num_warps", v), 4.0, "num_warps must be one of 1, 2, 4, 8, 16, got 4.0"),
        (
            lambda v: check_num_warps("num_warps", v, none_means="by tile"),
            32,
            r"num_warps must be None \(by tile\) or one of 1, 2, 4, 8, 16, got 32",
        ),
        (lambda v: check_non_negative_int("left", v), -1, "left must be a non-negative int, got -1"),
        (lambda v: check_non_negative_int("left", v), False, "left must be a non-negative int, got False"),
    ],
)
def test_bad_values_are_refused_by_name(check, value, message):
    with pytest.raises(ValueError, match=message):
        check(value)


def test_good_values_pass():
    check_power_of_two("block", np.int64(64), 8)
    check_positive_int("splits", np.int32(3))
    check_positive_int("splits", None, none_means="chosen per backend")
    check_num_warps("num_warps", 8)
    check_num_warps("num_warps", None, none_means="by tile")
    check_non_negative_int("left", 0)
