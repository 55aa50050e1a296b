"""Settings known to diverge are said in one line before a run starts; others say nothing."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from client.cli import cli
from client.sdk import run_spec
from gradps.divergence import MAX_PUSH_STEP, known_to_diverge


@pytest.mark.parametrize(
    ("scheme", "options", "words"),
    [
        # lr 0.1 with momentum 0.9 moves 0.25 per push with 4 workers: diverged on digits.
        ("asgd", {"lr": 0.1, "momentum": 0.9}, "asgd moves the model 0.25 per push"),
        ("ssp", {"lr": 0.5}, "--lr 0.2 or less"),
        # n_push 4 pushes 4 gradients summed: 0.8 per push at lr 0.2, which ended at 48%.
        ("asgd", {"lr": 0.2, "n_push": 4}, "0.8 per push (4 summed gradients times lr/(1-momentum)"),
        ("asgd", {"lr": 0.2, "n_push": 4}, "--lr 0.15 or less"),
        ("pseudosync", {"lr": 0.05, "momentum": 0.9, "fixed_alpha": True}, "drop --fixed-alpha"),
        ("pseudosync", {"optimizer": "adam", "lr": 0.001, "fixed_alpha": True, "alpha": 0.3}, "--alpha 0.3"),
    ],
)
def test_a_setting_known_to_diverge_is_one_line_naming_what_to_change(scheme, options, words):
    found = known_to_diverge(run_spec(scheme, workers=4, **options))
    assert len(found) == 1 and words in found[0] and "\n" not in found[0], found


@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("asgd", {"lr": 0.05, "momentum": 0.9}),  # DDP's usual setting: 0.125 per push, trains
        ("asgd", {"lr": 0.2}),  # the default: exactly the largest step that trained
        ("asgd", {"lr": 0.3, "n_push": 2}),  # 0.6 per push, summed: reached 97%
        ("ssp", {"lr": 0.2, "n_push": 4}),  # ssp pushes every step: n_push is asgd's alone
        ("asgd", {"optimizer": "adam", "lr": 0.001}),
        ("sync", {"lr": 0.5, "momentum": 0.9}),  # sync trained at this setting
        ("pseudosync", {"lr": 0.05, "momentum": 0.9}),  # adaptive: passes G through with momentum
        ("pseudosync", {"lr": 0.05, "fixed_alpha": True}),  # plain SGD: its own prediction only
        ("pseudosync", {"lr": 0.05, "momentum": 0.9, "fixed_alpha": True, "alpha": 1.0}),
    ],
)
def test_a_setting_that_trains_says_nothing(scheme, options):
    assert known_to_diverge(run_spec(scheme, workers=4, **options)) == []


def test_the_lr_it_names_moves_the_model_the_largest_step_that_trained():
    line = known_to_diverge(run_spec("asgd", workers=2, lr=0.2, momentum=0.9))[0]
    named = float(line.rsplit("--lr ", 1)[1].split()[0])
    assert known_to_diverge(run_spec("asgd", workers=2, lr=named, momentum=0.9)) == []
    assert known_to_diverge(run_spec("asgd", workers=2, lr=named * 1.01, momentum=0.9))
    assert MAX_PUSH_STEP == pytest.approx(0.2)


def test_train_and_compare_say_it_before_the_run_starts():
    train = CliRunner().invoke(
        cli, ["train", "--scheme", "asgd", "--lr", "0.2", "--momentum", "0.9", "--coordinator", "127.0.0.1:1"]
    )
    assert train.exit_code != 0  # nothing listens there: the warning came before any call
    assert train.output.index("warning: asgd moves the model") < train.output.index("no coordinator reachable")
    compare = CliRunner().invoke(
        cli, ["compare", "--schemes", "sync,ssp", "--lr", "0.5", "--coordinator", "127.0.0.1:1"]
    )
    assert compare.output.count("warning:") == 1 and "warning: ssp" in compare.output
