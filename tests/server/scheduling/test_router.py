"""The router picks the card with the fewest outstanding rows; ties go to the least recently used."""

from sixfold.server.scheduling.router import LeastLoadedRouter


def test_fewest_outstanding_rows_wins() -> None:
    router = LeastLoadedRouter(3)
    a = router.acquire(500)
    b = router.acquire(10)
    c = router.acquire(10)
    assert len({a, b, c}) == 3
    assert router.acquire(1) in (b, c)  # not the card holding 500 rows


def test_ties_go_to_the_least_recently_used_card() -> None:
    router = LeastLoadedRouter(3)
    order = []
    for _ in range(6):
        card = router.acquire(5)
        router.release(card, 5)
        order.append(card)
    assert order == [0, 1, 2, 0, 1, 2]


def test_release_counts_work_done() -> None:
    router = LeastLoadedRouter(2)
    card = router.acquire(7)
    assert router.loads[card].outstanding_rows == 7
    router.release(card, 7)
    assert router.loads[card].outstanding_rows == 0 and router.loads[card].rows == 7


def test_cards_out_of_rotation_are_skipped_until_back() -> None:
    import pytest

    from sixfold.server.scheduling.router import NoHealthyCard
    router = LeastLoadedRouter(2)
    router.mark_down(0)
    assert {router.acquire(1) for _ in range(3)} == {1}
    with pytest.raises(NoHealthyCard, match="out of rotation: \\[0\\]"):
        router.acquire(1, exclude={1})
    router.mark_up(0)
    assert router.acquire(1) == 0
