"""Round semantics of the shard's wagma rule, driven in-process (the service wraps it in gRPC)."""

from __future__ import annotations

import threading

import pytest
import torch

from gradps.errors import NotNow
from gradps.placement import place
from gradps.v1 import run_pb2, shard_pb2, tensor_pb2
from ps_server.run_state import RunState
from ps_server.schemes.wagma import WagmaRule

KEY = ("w", 0)


def _rule(workers=(0, 1, 2, 3)) -> WagmaRule:
    tensors = [tensor_pb2.TensorSpec(name="w", shape=[4], dtype=tensor_pb2.DTYPE_FLOAT32)]
    request = shard_pb2.OpenRunRequest(
        run_id="r",
        spec=run_pb2.RunSpec(scheme="wagma", optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.1)),
        placement=place(tensors, ["s0"], 1 << 20),
        shard_index=0,
        workers=list(workers),
        total_steps=10,
    )
    return WagmaRule(RunState.open(request, torch.device("cpu")))


def _deposit(rule, worker, step, value, members=(0, 1), is_global=False):
    with rule.run.cond:
        out, frontier = rule.group_average(
            worker, step, frozenset(members), is_global, {KEY: torch.full((4,), float(value))}
        )
    return float(out[KEY][0]), frontier


def test_first_arrival_fixes_the_round_and_a_late_member_gets_it_moved_by_its_own_step():
    rule = _rule()
    _deposit(rule, 1, 0, 10.0)  # worker 1's deposit at step 0 (round with worker 0 at step 0)
    first, _ = _deposit(rule, 0, 1, 2.0)  # worker 0 arrives first at step 1: 1 is late (stale 10)
    assert first == pytest.approx(6.0)  # (2 + 10) / 2: worker 1 contributes its previous model
    late, frontier = _deposit(rule, 1, 1, 100.0)  # worker 1 arrives late: not the plain (2 + 100) / 2
    assert late == pytest.approx(6.0 + (100.0 - 10.0))  # the round's average moved as its model did
    assert frontier == 1


def test_a_round_with_a_late_member_keeps_the_sum_of_the_groups_models():
    """Both members mix the answer as a wagma worker does, w <- (S m + w) / (S + 1): the group's
    models add up to what they did before the round, so the late member's last step is not lost."""
    rule = _rule()
    _deposit(rule, 1, 3, 10.0)
    models = {0: 2.0, 1: 13.0}  # worker 1 moved from 10 to 13 since its deposit at step 3
    mixed = {}
    for worker in (0, 1):  # worker 0 arrives first at step 4; worker 1's step-3 model is used
        m, _ = _deposit(rule, worker, 4, models[worker])
        mixed[worker] = (2 * m + models[worker]) / 3
    assert sum(mixed.values()) == pytest.approx(sum(models.values()))
    assert mixed[0] == pytest.approx((2 * 6.0 + 2.0) / 3)  # the first arrival's own answer is the average


def test_a_straggler_left_out_of_its_rounds_hands_its_step_to_the_next_round_once():
    """A member that comes to a round fixed without it (its models are always too old) adds its
    last local step, its deposit less the model it trained from, to the next round fixed."""
    rule = _rule()
    _deposit(rule, 1, 0, 10.0)  # worker 1 alone at step 0: it trains on from 10
    for step in (1, 2, 3):  # worker 0 runs ahead; worker 1's step-0 model is used at step 1 only
        _deposit(rule, 0, step, 0.0)
    for _ in range(2):  # worker 1 comes to step 2 having moved from 10 to 13; a retry carries nothing more
        late, frontier = _deposit(rule, 1, 2, 13.0)
        assert late == pytest.approx(0.0) and frontier == 3  # round 2 was worker 0's alone
    assert _deposit(rule, 0, 4, 0.0)[0] == pytest.approx(3.0)  # worker 1's step, in the next round
    assert _deposit(rule, 0, 5, 0.0)[0] == pytest.approx(0.0)  # and only there


def test_the_final_global_round_is_the_plain_average_that_the_consensus_evaluates():
    rule = _rule(workers=(0, 1))
    _deposit(rule, 1, 0, 10.0)
    for step in (1, 2, 3):
        _deposit(rule, 0, step, 0.0)
    _deposit(rule, 1, 2, 13.0)  # a late step is pending
    results = {}

    def arrive(worker, value):
        results[worker] = _deposit(rule, worker, 10, value, is_global=True)[0]

    threads = [threading.Thread(target=arrive, args=(w, v)) for w, v in ((0, 4.0), (1, 20.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    with rule.run.cond:
        consensus = rule.consensus(0, [KEY])[0][KEY]
    assert results == {0: pytest.approx(12.0), 1: pytest.approx(12.0)}  # (4 + 20) / 2, nothing added
    assert float(consensus[0]) == pytest.approx(12.0)


def test_a_member_that_never_arrives_does_not_block():
    rule = _rule()
    done = threading.Event()

    def arrive():
        _deposit(rule, 0, 0, 4.0, members=(0, 1))
        done.set()

    t = threading.Thread(target=arrive)
    t.start()
    assert done.wait(5), "group round waited for an absent member"
    t.join()
    value, _ = _deposit(rule, 0, 1, 8.0, members=(0, 1))
    assert value == pytest.approx(8.0)  # worker 1 never deposited: left out, not zero


def test_newer_deposits_are_never_mixed_into_an_older_round():
    rule = _rule()
    _deposit(rule, 1, 5, 50.0, members=(1, 2))  # worker 1 is already at step 5
    _deposit(rule, 1, 3, 30.0, members=(1, 3))  # its older deposit arrives later (out of order)
    value, _ = _deposit(rule, 0, 4, 0.0, members=(0, 1))  # round at step 4 with worker 1
    assert value == pytest.approx(15.0)  # (0 + 30) / 2: the step-5 model is not used


def test_global_round_waits_for_every_live_member_and_skips_the_dead():
    rule = _rule(workers=(0, 1, 2))
    results = {}

    def arrive(worker, value):
        results[worker] = _deposit(rule, worker, 10, value, members=(0, 1, 2), is_global=True)[0]

    threads = [threading.Thread(target=arrive, args=(w, v)) for w, v in ((0, 1.0), (1, 2.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(0.3)
    assert not results, "global round finished before every live member deposited"
    with rule.run.cond:  # worker 2 dies: the coordinator shrinks the membership
        rule.run.live_workers = {0, 1}
        rule.membership_changed()
        rule.run.cond.notify_all()
    for t in threads:
        t.join(5)
    assert results == {0: pytest.approx(1.5), 1: pytest.approx(1.5)}


def test_gradient_pushes_are_refused():
    from ps_server.run_state import Push

    rule = _rule()
    with pytest.raises(NotNow, match="GroupAverage"):
        rule.push(Push(0, 0, {KEY: torch.zeros(4)}, {KEY: 0}))


def _kept_steps(rule: WagmaRule) -> dict[int, list[int]]:
    return {w: [s for s, _ in parts[KEY]] for w, parts in rule.deposits.items()}


def test_a_deposit_older_than_the_kept_rounds_is_refused_with_the_frontier_and_changes_nothing():
    rule = _rule()
    _deposit(rule, 0, 5, 5.0)
    _deposit(rule, 0, 6, 6.0)
    kept, rounds = _kept_steps(rule), set(rule.rounds)
    with pytest.raises(NotNow, match=r"round at step 3 is gone: .* jump to step 6 \(the frontier\)"):
        _deposit(rule, 0, 3, 3.0)  # older than both deposits kept: its round could average nothing
    assert _kept_steps(rule) == kept and set(rule.rounds) == rounds and rule.frontier == 6
    # With one newer deposit kept, an older one still has its round: fixed from the worker's own model.
    _deposit(rule, 1, 7, 70.0, members=(1, 2))
    value, frontier = _deposit(rule, 1, 2, 20.0, members=(1, 3))
    assert value == pytest.approx(20.0) and frontier == 7


def test_a_deposit_more_than_a_step_old_is_left_out_and_its_late_worker_gets_the_average():
    rule = _rule()
    _deposit(rule, 1, 2, 100.0, members=(1, 2))  # worker 1, a straggler, last deposited at step 2
    value, _ = _deposit(rule, 0, 4, 8.0, members=(0, 1))  # step 4: worker 1's model is 2 steps old
    assert value == pytest.approx(8.0)  # left out: a stale model would pull worker 0 back
    _deposit(rule, 2, 4, 30.0, members=(2, 3))
    value, _ = _deposit(rule, 3, 5, 10.0, members=(2, 3))  # worker 2 one step behind: averaged in
    assert value == pytest.approx(20.0)
    late, frontier = _deposit(rule, 1, 4, 50.0, members=(0, 1))  # the straggler arrives
    assert late == pytest.approx(8.0) and frontier == 5  # it takes the round's average, and skips ahead


def test_the_consensus_averages_the_latest_models_and_changes_nothing():
    rule = _rule()
    _deposit(rule, 0, 5, 10.0, members=(0, 1))
    _deposit(rule, 1, 4, 20.0, members=(1, 2))  # one step behind the newest: in
    _deposit(rule, 2, 1, 90.0, members=(2, 3))  # four behind: out
    rounds, deposits = dict(rule.rounds), {w: dict(parts) for w, parts in rule.deposits.items()}
    with rule.run.cond:
        out, frontier = rule.consensus(3, [KEY])  # worker 3 never deposited; it may still ask
    assert float(out[KEY][0]) == pytest.approx(15.0) and frontier == 5
    assert rule.rounds == rounds and {w: dict(p) for w, p in rule.deposits.items()} == deposits
    rule.run.live_workers.discard(3)
    with rule.run.cond, pytest.raises(NotNow, match="worker 3 is not a live member"):
        rule.consensus(3, [KEY])


def test_a_group_naming_a_lost_worker_means_the_one_that_took_its_rank():
    rule = _rule(workers=(0, 1))
    run = rule.run
    run.set_workers([0, 2])  # worker 2 joined in rank 1, worker 1's
    run.set_live_workers({0, 2})
    assert run.holders([0, 1]) == run.holders([0, 2]) == frozenset({0, 2})
    # Worker 0 still names worker 1 in its group; worker 2 names itself: one round, fixed by the
    # first arrival (worker 2 had not deposited), the same result for both.
    first, _ = _deposit(rule, 0, 5, 2.0, members=run.holders([0, 1]))
    second, _ = _deposit(rule, 2, 5, 6.0, members=run.holders([0, 2]))
    assert first == second == pytest.approx(2.0)


def test_a_consensus_before_any_deposit_is_the_registered_model():
    rule = _rule(workers=(0, 1))
    rule.run.parts[KEY].values.fill_(3.0)
    with rule.run.cond:
        out, _ = rule.consensus(0, [KEY])
    assert torch.equal(out[KEY], torch.full((4,), 3.0))


def test_a_new_worker_counts_in_the_consensus_with_its_ranks_earlier_deposits():
    rule = _rule(workers=(0, 1))
    _deposit(rule, 0, 3, 2.0, members=(0, 1))
    _deposit(rule, 1, 3, 6.0, members=(0, 1))
    rule.run.set_workers([0, 9])  # worker 9 took rank 1 (joined, or the run resumed)
    rule.run.set_live_workers({0, 9})
    with rule.run.cond:
        out, _ = rule.consensus(9, [KEY])
    assert float(out[KEY][0]) == pytest.approx(4.0)  # worker 1's deposit stands for rank 1
