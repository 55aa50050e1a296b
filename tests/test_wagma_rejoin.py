"""Where a wagma worker goes after a round (gpu_worker/schemes/wagma.py `rejoin`)."""

from gpu_worker.schemes.wagma import Rejoin, rejoin


def test_a_worker_that_is_not_behind_takes_the_next_step():
    assert rejoin(step=4, frontier=4, last_frontier=3, tau=10) == Rejoin(5)
    assert rejoin(step=4, frontier=5, last_frontier=3, tau=10) == Rejoin(5)


def test_a_late_worker_skips_to_the_frontier_when_the_global_round_is_far():
    # The others moved 3 steps during its last step and are 4 from the global round: one more
    # step of its own ends before they get there.
    assert rejoin(step=3, frontier=6, last_frontier=3, tau=10) == Rejoin(6)


def test_a_late_worker_joins_a_near_global_round_at_once():
    # The others will reach step 10 in one of their steps; this worker needs three.
    assert rejoin(step=6, frontier=9, last_frontier=6, tau=10) == Rejoin(11, global_step=10)
    assert rejoin(step=6, frontier=8, last_frontier=5, tau=10) == Rejoin(11, global_step=10)


def test_a_global_round_already_under_way_is_joined():
    assert rejoin(step=7, frontier=10, last_frontier=10, tau=10) == Rejoin(11, global_step=10)


def test_a_tie_goes_to_computing_another_step():
    # The others need 3 steps to reach the global round, as long as this worker's next step.
    assert rejoin(step=4, frontier=7, last_frontier=4, tau=10) == Rejoin(7)
