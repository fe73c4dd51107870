"""Expected output lengths: learned per model, never above max_tokens, safe until learned."""

from __future__ import annotations

from kvgate.core.plan.lengths import MIN_SAMPLES, WINDOW, OutputLengths


def test_max_tokens_until_enough_requests_have_finished() -> None:
    lengths = OutputLengths()
    for _ in range(MIN_SAMPLES - 1):
        lengths.learn("m", 1000, 100)
    assert lengths.expected("m", 1000) == 1000
    lengths.learn("m", 1000, 100)
    assert lengths.expected("m", 1000) == 100


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


def test_too_many_capped_requests_make_the_quantile_untrustworthy() -> None:
    lengths = OutputLengths()
    for i in range(100):
        capped = i % 5 == 0  # 20% stopped at their max_tokens: their true length is unknown
        lengths.learn("m", 200, 200 if capped else 50)
    assert lengths.expected("m", 4000) == 4000


def test_the_window_forgets_old_requests() -> None:
    lengths = OutputLengths()
    for _ in range(WINDOW):
        lengths.learn("m", 5000, 3000)
    for _ in range(WINDOW):
        lengths.learn("m", 5000, 100)
    assert lengths.expected("m", 5000) == 100
