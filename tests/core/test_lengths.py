"""Expected output lengths: learned per model, never above max_tokens, safe until learned;
requests that stopped at their cap count as censored, not as lengths."""

from __future__ import annotations

from kvgate.core.plan.lengths import MIN_SAMPLES, WINDOW, OutputLengths


def test_max_tokens_until_enough_requests_have_finished() -> None:
    lengths = OutputLengths()
    for _ in range(MIN_SAMPLES - 1):
        lengths.learn("m", 1000, 100)
    assert lengths.expected("m", 1000) == 1000
    assert not lengths.informed("m", 1000)
    lengths.learn("m", 1000, 100)
    assert lengths.expected("m", 1000) == 100
    assert lengths.informed("m", 1000)


def test_a_high_quantile_capped_by_the_requests_own_max_tokens() -> None:
    lengths = OutputLengths()
    for i in range(100):
        lengths.learn("m", 2000, 10 * (i + 1))  # 10 .. 1000
    expected = lengths.expected("m", 2000)
    assert 880 <= expected <= 920
    assert lengths.expected("m", 300) == 300


def test_exact_requests_and_other_models_get_their_max() -> None:
    lengths = OutputLengths()
    for _ in range(50):
        lengths.learn("m", 1000, 50)
    assert lengths.expected("m", 1000, exact=True) == 1000
    assert lengths.expected("other", 1000) == 1000
    assert lengths.informed("m", 1000, exact=True) and lengths.informed("other", 9, exact=True)
    assert not lengths.informed("other", 1000)


def test_too_many_capped_requests_make_the_quantile_untrustworthy() -> None:
    lengths = OutputLengths()
    for i in range(100):
        capped = i % 5 == 0  # 20% stopped at their max_tokens: their true length is unknown
        lengths.learn("m", 200, 200 if capped else 50)
    assert lengths.expected("m", 4000) == 4000
    # They ran to 200: a request allowed up to 200 runs to it, as planned; one allowed
    # 4000 might run far longer than anything seen: a guess.
    assert lengths.informed("m", 200) and not lengths.informed("m", 4000)


def test_smoke_tests_that_ended_at_a_small_cap_do_not_hide_the_length() -> None:
    lengths = OutputLengths()
    for _ in range(5):
        lengths.learn("m", 5, 5)  # "say hi" at max_tokens 5: at least 5, nothing more
    for i in range(MIN_SAMPLES):
        lengths.learn("m", 1800, 200 + i)
    assert lengths.expected("m", 1800) == 200 + MIN_SAMPLES - 2  # 90% of the 16 ended by
    assert lengths.informed("m", 1800)


def test_censored_lengths_are_read_as_kaplan_meier_does() -> None:
    lengths = OutputLengths()
    # 20 ended at 100, 20 ended at 300, and 20 stopped at a cap of 200: of the 40 still
    # running past 100, 20 were censored at 200, so the 20 that ended at 300 carry the
    # whole remaining half: the estimate reaches 90% only at 300.
    for _ in range(20):
        lengths.learn("m", 1000, 100)
        lengths.learn("m", 200, 200)
        lengths.learn("m", 1000, 300)
    assert lengths.learned("m").quantile == 300
    assert lengths.learned("m").median == 300  # two thirds still running past 100
    # Past the last ended length the estimate still has running requests: unknown.
    for _ in range(40):
        lengths.learn("m", 5000, 5000)
    assert lengths.learned("m").quantile is None


def test_the_window_forgets_old_requests() -> None:
    lengths = OutputLengths()
    for _ in range(WINDOW):
        lengths.learn("m", 5000, 3000)
    for _ in range(WINDOW):
        lengths.learn("m", 5000, 100)
    assert lengths.expected("m", 5000) == 100


def test_the_likely_length_is_the_median() -> None:
    lengths = OutputLengths()
    assert lengths.likely("m", 1000) == 1000  # nothing known: what the plan takes
    for i in range(100):
        lengths.learn("m", 2000, 10 * (i + 1))  # 10 .. 1000
    assert lengths.likely("m", 2000) == 500 and lengths.likely("m", 300) == 300
    assert lengths.likely("m", 2000, exact=True) == 2000
