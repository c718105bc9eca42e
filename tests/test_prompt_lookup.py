"""drafters/prompt_lookup.py: the longest suffix n-gram found earlier in the context proposes what followed its most
recent occurrence; the index grows with the context and starts again when the context is another one."""

import pytest

from localspec.drafters.prompt_lookup import REACH_BANDS, REACH_MAX, PromptLookupDrafter
from localspec.errors import UsageError


def propose(d, ctx, k=4):
    return d.propose(ctx, k, None, None).tokens


def test_the_longest_ngram_wins_and_its_most_recent_occurrence_proposes():
    d = PromptLookupDrafter(2, 4)
    # "1 2" is followed by 7 early and by 8 later; "9 1 2" only by 5: the 3-gram beats both 2-gram occurrences
    ctx = [1, 2, 7, 0, 9, 1, 2, 5, 6, 1, 2, 8, 4, 9, 1, 2]
    assert d.match(ctx, 3) == ([5, 6, 1], 3)
    other = ctx[:-3] + [3, 1, 2]  # "3 1 2" never seen: the latest "1 2" proposes
    assert PromptLookupDrafter(2, 4).match(other, 3) == ([8, 4, 3], 2)


def test_ngram_sizes_outside_the_range_never_match():
    ctx = [4, 5, 6, 0, 4, 5, 6]
    assert PromptLookupDrafter(2, 3).match(ctx, 2) == ([0, 4], 3)
    assert PromptLookupDrafter(4, 4).match(ctx, 2) == ([], 0)  # only a 3-gram repeats
    assert PromptLookupDrafter(1, 1).match([3, 9, 3], 2) == ([9, 3], 1)


def test_k_bounds_the_proposal_and_the_context_end_bounds_it_too():
    d = PromptLookupDrafter()
    ctx = [1, 2, 3, 4, 1, 2]
    assert propose(d, ctx, 1) == [3]
    assert propose(d, ctx, 10) == [3, 4, 1, 2]  # what follows, up to the context's end
    assert propose(d, ctx, 0) == []


@pytest.mark.parametrize("ctx", [[], [7], [7, 8]])
def test_empty_one_token_and_unrepeated_contexts_propose_nothing(ctx):
    d = PromptLookupDrafter()
    assert d.match(ctx, 4) == ([], 0) and propose(d, ctx) == [] and d.offer(ctx, 4) is None


def test_the_index_grows_with_the_context_and_restarts_on_another_one():
    d = PromptLookupDrafter()
    ctx = [5, 6, 7, 8]
    assert propose(d, ctx) == []
    ctx += [5, 6]
    assert propose(d, ctx) == [7, 8, 5, 6]  # the two new tokens were indexed, not the whole context again
    assert d._tokens == ctx
    other = [9, 9, 5, 6]  # another conversation: nothing of the first may propose
    assert propose(d, other) == []
    assert d._tokens == other
    d.begin([1, 2, 1])  # begin() with a diverged context rebuilds as well
    assert propose(d, [1, 2, 1, 2]) == [1, 2]


def test_a_copy_in_progress_is_offered_under_the_band_of_its_reach():
    d = PromptLookupDrafter()
    text = list(range(100, 100 + REACH_MAX + 4))
    short = [1, 2, 30, 40, 50, 1, 2]  # a 2-token match after different text
    offer = d.offer(short, 4)
    assert offer.key == "lookup@2-3" and offer.k == 4 and offer.prior == REACH_BANDS[0][3]
    long = text + [0] + text  # the second copy agrees with everything before the first
    offer = PromptLookupDrafter().offer(long, 4)
    assert offer.key == "lookup@12+" and offer.prior == REACH_BANDS[-1][3]
    mid = text + [0] + [1] + text[-6:]  # six tokens of agreement: a copy under way, apart from shorter matches
    offer = PromptLookupDrafter().offer(mid, 4)
    assert offer.key == "lookup@6-11" and offer.prior == REACH_BANDS[2][3]
    four = text + [0] + [1] + text[-4:]
    offer = PromptLookupDrafter().offer(four, 4)
    assert offer.key == "lookup@4-5" and offer.prior == REACH_BANDS[1][3] < REACH_BANDS[2][3]


def test_bad_sizes_are_refused():
    with pytest.raises(UsageError):
        PromptLookupDrafter(0, 2)
    with pytest.raises(UsageError):
        PromptLookupDrafter(3, 2)
