"""The planner's explain lines print sizes with SI prefixes, never in exponent notation."""

import pytest

from comera_compile.tt import planner


@pytest.mark.parametrize("x, want", [(16.1e9, "16.1G"), (999.4e6, "999M"), (999.7e6, "1G"), (999.7e3, "1M"),
                                     (999.7, "1k"), (0.5, "0.5"), (0.0, "0"), (5e15, "5000T"), (999.7e12, "1000T"),
                                     (-2.5e6, "-2.5M"), (67.1e6, "67.1M")])
def test_si_prefixes_round_up_to_the_next_prefix_instead_of_exponents(x, want):
    assert planner._si(x) == want
