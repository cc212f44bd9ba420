"""Whether a routed layer's experts are copied by need, and the byte ranges and row runs
those copies take: pure logic."""

import pytest

from layerstream.decisions.experts import BY_NEED_SHARE, copy_by_need, expected_share_hit, ranges_outside, runs


def test_one_token_hits_its_top_k_share_of_the_experts():
    assert expected_share_hit(1, 8, 128) == pytest.approx(8 / 128)
    assert expected_share_hit(1, 2, 2) == 1.0


def test_the_expected_share_grows_with_the_tokens_towards_every_expert():
    shares = [expected_share_hit(tokens, 8, 128) for tokens in (1, 8, 64, 2048)]
    assert shares == sorted(shares) and shares[-1] > 0.999


@pytest.mark.parametrize(
    "tokens, by_need",
    [(1, True), (8, True), (64, False), (2048, False)],  # decoding one and eight sequences; training
)
def test_decoding_copies_by_need_and_a_training_step_copies_whole_stacks(tokens, by_need):
    assert copy_by_need(tokens, 8, 128) is by_need
    assert (expected_share_hit(tokens, 8, 128) < BY_NEED_SHARE) is by_need


def test_no_tokens_or_no_experts_hit_nothing():
    assert expected_share_hit(0, 8, 128) == 0.0 and expected_share_hit(5, 2, 0) == 0.0


def test_the_ranges_outside_the_stacks_cover_every_other_byte_once():
    assert ranges_outside(100, [(10, 20), (40, 60)]) == [(0, 10), (20, 40), (60, 100)]
    assert ranges_outside(100, [(40, 60), (0, 10)]) == [(10, 40), (60, 100)]
    assert ranges_outside(100, [(0, 50), (50, 100)]) == []
    assert ranges_outside(100, [(10, 30), (20, 40)]) == [(0, 10), (40, 100)]  # overlapping holes
    assert ranges_outside(100, []) == [(0, 100)]


def test_rows_are_copied_in_runs_of_consecutive_rows():
    assert runs([7, 1, 3, 2, 2]) == [(1, 4), (7, 8)]
    assert runs([]) == []
