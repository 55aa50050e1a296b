"""One registration per scheme and per codec: everything that names them agrees with the registries."""

from __future__ import annotations

import click
import pytest

from client.cli import cli
from client.sdk import run_spec
from gpu_worker.schemes import WORKER_SCHEMES
from gradps.codec_table import ENTRIES, check_pull_codec, codec_forms, parse_codec
from gradps.codecs import CODECS, get_codec
from gradps.codecs.bench import CODECS as BENCH_CODECS
from gradps.run_spec import default_spec, validate, with_defaults
from gradps.schemes import PARAMS, SCHEMES, check_implemented, schemes_of
from gradps.v1 import run_pb2, tensor_pb2
from ps_server.schemes import RULES


def _params(command: str) -> dict[str, click.Option]:
    """A command's options by their Python name."""
    return {p.name: p for p in cli.commands[command].params if isinstance(p, click.Option) and p.name}


def test_every_scheme_has_a_shard_rule_and_a_worker_rule() -> None:
    assert list(RULES) and set(RULES) == set(SCHEMES)
    assert set(WORKER_SCHEMES) == set(SCHEMES)


def test_a_rule_table_that_misses_a_scheme_is_refused() -> None:
    with pytest.raises(ImportError, match=r"missing \['wagma'\]"):
        check_implemented(set(SCHEMES) - {"wagma"}, "shard rules")
    with pytest.raises(ImportError, match=r"not registered \['gossip'\]"):
        check_implemented({*SCHEMES, "gossip"}, "worker rules")


def test_cli_scheme_choices_are_the_registry() -> None:
    scheme = _params("train")["scheme"]
    assert isinstance(scheme.type, click.Choice)
    assert list(scheme.type.choices) == list(SCHEMES)
    assert _params("compare")["schemes"].default == ",".join(SCHEMES)


def test_every_scheme_parameter_is_a_scheme_params_field_read_by_a_scheme() -> None:
    assert set(PARAMS) == set(run_pb2.SchemeParams.DESCRIPTOR.fields_by_name)
    for param in PARAMS.values():
        assert schemes_of(param), param.name
        param.check(param.default)  # every default is within its own bounds


@pytest.mark.parametrize("command", ["train", "compare"])
def test_cli_defaults_are_the_run_spec_defaults(command: str) -> None:
    """Every RunSpec field the CLI sets gets the same value from `default_spec` (what the SDK's
    `run_spec` starts from) when no option is given."""
    options = _params(command)
    defaults = default_spec()
    for name, param in PARAMS.items():
        assert options[name].default == param.default == getattr(defaults.scheme_params, name), name
    for field in ("model", "dataset", "batch_size", "epochs", "eval_every", "part_size", "seed", "steps"):
        assert options[field].default == getattr(defaults, field), field
    for field in ("lr", "schedule", "momentum", "weight_decay", "step_size", "gamma", "warmup_steps"):
        assert options[field].default == getattr(defaults.optimizer, field), field
    assert options["optimizer"].default == defaults.optimizer.name
    assert parse_codec(str(options["codec"].default)) == defaults.codec
    assert parse_codec(str(options["pull_codec"].default)) == defaults.pull_codec
    if command == "train":
        assert options["scheme"].default == defaults.scheme
        assert options["workers"].default == defaults.workers


def test_the_sdk_and_the_cli_build_the_same_run() -> None:
    from client.cli import build_spec

    cli_options = {name: option.default for name, option in _params("train").items() if name in _spec_option_names()}
    cli_options["codec"] = parse_codec(str(cli_options["codec"]))
    cli_options["pull_codec"] = parse_codec(str(cli_options["pull_codec"]))
    for scheme in SCHEMES:
        assert build_spec(scheme, 2, **cli_options) == run_spec(scheme, workers=2), scheme
    assert run_spec("ssp").scheme_params.staleness == 2


def _spec_option_names() -> set[str]:
    """The options `spec_options` adds: those both `train` and `compare` take, but their own."""
    names = set(_params("train")) & set(_params("compare"))
    cluster = {"coordinator", "local", "shards", "heartbeat_timeout", "device", "transport", "allow_import"}
    return names - cluster - {"workers", "out", "tensorboard", "no_progress", "help"}


def test_cli_scheme_options_come_from_the_registry() -> None:
    options = _params("train")
    for name, param in PARAMS.items():
        option = options[name]
        assert option.opts == ["--" + name.replace("_", "-")]
        assert option.help and option.help.startswith("/".join(schemes_of(param)) + ": ")
        assert option.is_flag == (param.type is bool)


def test_with_defaults_fills_only_what_the_proto_says_zero_means() -> None:
    spec = with_defaults(run_pb2.RunSpec(scheme="ssp"))
    validate(spec)
    for name, param in PARAMS.items():
        if param.zero_is_default or run_pb2.SchemeParams.DESCRIPTOR.fields_by_name[name].has_presence:
            assert getattr(spec.scheme_params, name) == param.default, name
    # A spec from any language gets the CLI's and the SDK's defaults.
    assert with_defaults(run_pb2.RunSpec()) == default_spec()


def test_explicit_presence_keeps_zero_and_absence_takes_the_default() -> None:
    """Fields whose 0 is a value of its own (`optional` in the proto) keep an explicit 0 on the
    wire, and take the one table's default only when absent."""
    zero = run_pb2.RunSpec(
        scheme="ssp",
        eval_every=0,
        scheme_params=run_pb2.SchemeParams(staleness=0),
        optimizer=run_pb2.OptimizerSpec(schedule="step", gamma=0.0, step_size=10),
    )
    sent = with_defaults(run_pb2.RunSpec.FromString(zero.SerializeToString()))
    assert (sent.scheme_params.staleness, sent.eval_every, sent.optimizer.gamma) == (0, 0, 0.0)
    absent = with_defaults(run_pb2.RunSpec(scheme="ssp"))
    assert (absent.scheme_params.staleness, absent.eval_every, absent.optimizer.gamma) == (2, 50, 0.1)
    assert absent.workers == 2 and absent.part_size + 1024 <= 4 * 1024 * 1024  # a stock client's limit


def test_every_codec_enum_value_has_exactly_one_codec() -> None:
    enums = [v for v in tensor_pb2.Codec.values() if v != tensor_pb2.CODEC_UNSPECIFIED]
    assert sorted(entry.enum for entry in ENTRIES) == sorted(enums)
    assert len({entry.name for entry in ENTRIES}) == len(ENTRIES)
    assert [codec.entry for codec in CODECS] == list(ENTRIES)  # each entry bound to its own class


@pytest.mark.parametrize("form", codec_forms())
def test_every_codec_form_parses_to_its_codec(form: str) -> None:
    params = parse_codec(form.replace("RATIO", "0.5"))
    codec = get_codec(params)
    assert form.startswith(codec.entry.name) and params.codec == codec.entry.enum


def test_pull_codecs_are_the_registered_ones() -> None:
    for entry in ENTRIES:
        params = parse_codec(next(f for f in codec_forms() if f.startswith(entry.name)).replace("RATIO", "0.5"))
        if entry.pull:
            assert check_pull_codec(params) == entry
        else:
            with pytest.raises(ValueError, match="pull codec must be"):
                check_pull_codec(params)


def test_cli_codec_help_lists_every_codec_form() -> None:
    options = _params("train")
    for form in codec_forms():
        assert form in (options["codec"].help or "")
    assert set(codec_forms(pull=True)) == {e.name for e in ENTRIES if e.pull}
    for form in codec_forms(pull=True):
        assert form in (options["pull_codec"].help or "")


def test_the_codec_bench_covers_every_codec() -> None:
    assert {get_codec(parse_codec(text)).entry for text in BENCH_CODECS} == set(ENTRIES)
    assert len(BENCH_CODECS) == len(codec_forms())
