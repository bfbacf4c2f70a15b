"""bench/pipeline_vs_llamacpp.py --repeats: the order alternates and the summary's median is the middle pair's
(the whole bench needs minutes of real tool runs; these check its bookkeeping on made-up times)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.bench import load_script


@pytest.fixture(scope="module")
def vs() -> ModuleType:
    return load_script("pipeline_vs_llamacpp")


def _pair(vs: ModuleType, hand_s: float, qy_s: float, first: bool, steal: float = 0.0) -> object:
    load = vs.Load(wall_s=hand_s, ours_s=1.0, other_s=0.0, steal_s=steal)
    return vs.Pair(vs.Way(total_s=hand_s, load=load), vs.Way(total_s=qy_s), first)


def test_repeats_alternate_which_way_goes_first(vs: ModuleType) -> None:
    assert [vs.first_is_quantyard(r) for r in range(4)] == [False, True, False, True]


def test_the_summary_gives_each_pair_and_the_median_ratio(vs: ModuleType) -> None:
    pairs = [_pair(vs, 100, 118, False, steal=50.7), _pair(vs, 100, 99, True), _pair(vs, 100, 105, False)]
    text = vs.repeats_summary(pairs)
    assert "**median ratio 1.050** over 3 pairs (range 0.990-1.180)" in text
    assert "| 1 | llama.cpp | 100.0 | 118.0 | 1.180 | 50.7/? |" in text
    assert "| 2 | quantyard |" in text
    even = vs.repeats_summary(pairs[:2])
    assert "**median ratio 1.085** over 2 pairs" in even  # the mean of the two middle ones
