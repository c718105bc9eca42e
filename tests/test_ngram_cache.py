"""drafters/ngram_cache.py: llama.cpp's n-gram cache over the prompt and answer so far (the majority continuation after
the longest n-gram whose counts pass llama.cpp's bounds), as a drafter of its own beside prompt lookup under `auto`."""

import pytest

from conftest import N_EXACT, PROMPTS
from localspec.core.engine import GenConfig
from localspec.drafters.ngram_cache import PRIORS, NgramCacheDrafter
from localspec.drafters.prompt_lookup import PromptLookupDrafter


def propose(d, ctx, k=3):
    return d.propose(ctx, k, None, None).tokens


def test_the_majority_continuation_is_drafted_where_prompt_lookup_drafts_the_latest():
    ctx = [1, 2, 5, 9, 1, 2, 5, 9, 1, 2, 6, 9, 0, 1, 2]  # "1 2" went on with 5 twice, then once with 6
    assert propose(NgramCacheDrafter(), ctx) == [5, 9, 1]
    assert propose(PromptLookupDrafter(), ctx) == [6, 9, 0]


def test_a_single_token_drafts_only_where_two_or_more_of_its_occurrences_agree():
    assert propose(NgramCacheDrafter(), [4, 7, 3, 4]) == []  # "4" once: a 1-token guess needs two occurrences
    # "4" went on with 7 twice; "4 7" with 3 and 8 once each, 50% passes after 2 tokens, and a tie goes to the later
    assert propose(NgramCacheDrafter(), [4, 7, 3, 4, 7, 8, 4]) == [7, 8, 4]
    assert propose(NgramCacheDrafter(), [4, 7, 3, 4, 8, 5, 4]) == []  # 1 of 2 each: under 66%


def test_the_offer_names_the_n_gram_that_supports_the_first_token():
    four = NgramCacheDrafter().offer([1, 2, 3, 4, 5, 0, 1, 2, 3, 4], 3)
    assert (four.k, four.key, four.prior) == (3, "ngram@4", PRIORS[4])
    one = NgramCacheDrafter().offer([4, 7, 3, 4, 7, 8, 4], 3)
    assert (one.key, one.prior) == ("ngram@1", PRIORS[1])
    assert PRIORS[1] < PRIORS[4]  # a copy in progress starts trusted more than a one-token guess
    assert NgramCacheDrafter().offer([4, 7, 3, 4, 8, 5, 4], 3) is None  # nothing passes: nothing offered
    assert NgramCacheDrafter().offer([1, 2, 3, 1, 2, 3], 0) is None


def test_counts_grow_with_the_context_and_start_again_for_another_one():
    d = NgramCacheDrafter()
    d.begin([1, 2, 3, 9])
    assert propose(d, [1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2]
    d.begin([1, 2, 3, 8])  # another conversation: the counts of the first are gone
    assert propose(d, [1, 2, 3, 8, 1, 2, 3]) == [8, 1, 2]
    d.begin([1, 2, 3, 8, 1, 2, 3, 8, 5])  # the same one, longer: counted on from where it was
    assert propose(d, [1, 2, 3, 8, 1, 2, 3, 8, 5, 1, 2, 3]) == [8, 5, 1]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_temperature_0_with_the_n_gram_cache_is_plain_decoding(engine, k):
    drafted = 0
    for p in PROMPTS:
        prompt = engine.raw_prompt(p)
        plain = engine.complete(prompt, GenConfig(method="none", max_tokens=N_EXACT)).tokens
        r = engine.complete(prompt, GenConfig(method="ngram", k=k, max_tokens=N_EXACT, exactness="bit"))
        assert r.tokens == plain, (p, k)
        assert r.stats.method == "ngram"
        drafted += r.stats.drafted
    assert drafted > 0  # the tiny model repeats itself: the counts drafted
