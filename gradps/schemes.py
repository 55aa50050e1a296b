"""The scheme registry: every scheme's name, summary and parameters (`SchemeParams` fields) with
their defaults, bounds and help. The shard rules, the worker rules, the CLI and run-spec
validation all derive from it, so a scheme is named and defined once."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gradps.v1 import run_pb2

UINT32 = 2**32 - 1


@dataclass(frozen=True)
class Param:
    """One `SchemeParams` field."""

    # The SchemeParams field; the CLI option is --name-with-dashes.
    name: str
    # int, float or bool.
    type: type
    # The value a run gets when nobody chooses one (the CLI's and the SDK's default).
    default: int | float | bool
    # One line for --help, without the scheme prefix.
    help: str
    # Inclusive bounds; None: unbounded. Floats must also be finite.
    low: float | None = None
    high: float | None = None
    # True when `low` itself is excluded.
    low_open: bool = False
    # True when 0 on the wire means `default` (the proto says "0 means ..."): filled in on submit.
    # A field with explicit presence (`optional`) takes `default` when absent, whatever this says.
    zero_is_default: bool = False

    def check(self, value: float) -> None:
        """ValueError with a one-line message unless `value` is within bounds."""
        if self.type is bool:
            return
        if self.type is float and not math.isfinite(value):
            raise ValueError(f"{self.name} must be a finite number, got {value}")
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        if too_low or (self.high is not None and value > self.high):
            raise ValueError(f"{self.name} must be in {self.bounds_text()}, got {value}")

    def bounds_text(self) -> str:
        """The accepted range, e.g. "(0, 1]" or "[1, 4294967295]"."""
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"{'(' if self.low_open else '['}{low}, {high}{')' if self.high is None else ']'}"


@dataclass(frozen=True)
class Scheme:
    """One training scheme (docs/schemes.md)."""

    # The RunSpec.scheme string.
    name: str
    # One line for --help and tables.
    summary: str
    # The SchemeParams fields its rules read.
    params: tuple[Param, ...] = ()
    # After a shard restarts, every shard and worker of the run goes back to one checkpointed
    # step (its versions count steps); else the restarted shard goes on from its own checkpoint
    # (ps_server/recovery.py). Its checkpoints are at cuts that rank 0 declares (gradps/cuts.py).
    common_cut: bool = False
    # Its model lives on the workers, one replica for all: rank 0 hands it in at every cut
    # (gradps/cuts.py), and every worker takes it up from the shards where
    # the run goes back to a checkpoint, a new worker enters with the others, or a run resumes.
    hands_in_replica: bool = False
    # Each worker keeps a model of its own, which the shards hold only as the workers' latest
    # deposits: a checkpoint holds no one model to export, and a worker that starts past step 0
    # (joining, resumed) takes the consensus of the deposits.
    models_on_workers: bool = False


_STALENESS_LR = Param("staleness_lr", bool, False, "lr / max(1, staleness).")
_DC_LAMBDA = Param("dc_lambda", float, 0.0, "DC-ASGD lambda (0: off).", low=0)
_DC_ADAPTIVE = Param("dc_adaptive", bool, False, "adaptive DC-ASGD lambda.")
_DELAY = (_STALENESS_LR, _DC_LAMBDA, _DC_ADAPTIVE)

_ALL = (
    Scheme(
        "sync",
        "bulk-synchronous: one averaged update per step",
        (
            Param(
                "backup_workers",
                int,
                0,
                "apply a step once all but N live workers pushed it; late gradients are dropped (< workers).",
                low=0,
                high=UINT32,
            ),
        ),
        common_cut=True,
    ),
    Scheme(
        "asgd",
        "asynchronous (GPU A-SGD / Downpour): each push applied at once",
        (
            Param("n_push", int, 1, "push every N steps.", low=1, high=UINT32, zero_is_default=True),
            Param("n_fetch", int, 1, "fetch every N steps.", low=1, high=UINT32, zero_is_default=True),
            *_DELAY,
        ),
    ),
    Scheme(
        "ssp",
        "stale synchronous parallel: asgd with a bound on staleness",
        (Param("staleness", int, 2, "staleness bound s (0 waits like sync).", low=0, high=UINT32), *_DELAY),
    ),
    Scheme(
        "wagma",
        "wait-avoiding group model averaging (WAGMA-SGD)",
        (
            Param("group_size", int, 0, "group size (0: ~sqrt(P)).", low=0, high=UINT32),
            Param("tau", int, 10, "global average every tau steps.", low=1, high=UINT32, zero_is_default=True),
        ),
        models_on_workers=True,
    ),
    Scheme(
        "pseudosync",
        "pseudo-synchronous: update with a predicted gradient, never wait",
        (
            Param("alpha", float, 0.5, "initial a.", low=0, high=1, low_open=True, zero_is_default=True),
            Param("alpha_min", float, 0.1, "min a.", low=0, high=1, low_open=True, zero_is_default=True),
            Param("fixed_alpha", bool, False, "keep a fixed (no adaptation)."),
        ),
        common_cut=True,
        hands_in_replica=True,
    ),
)

# THE list of scheme names, in the order the CLI shows and `compare` runs them.
SCHEMES: dict[str, Scheme] = {s.name: s for s in _ALL}
DEFAULT_SCHEME = "sync"


def _params() -> dict[str, Param]:
    found: dict[str, Param] = {}
    for scheme in _ALL:
        for param in scheme.params:
            if found.setdefault(param.name, param) != param:
                raise ImportError(f"scheme parameter {param.name} is defined twice, differently")
    fields = set(run_pb2.SchemeParams.DESCRIPTOR.fields_by_name)
    if set(found) != fields:
        raise ImportError(f"SchemeParams fields {sorted(fields ^ set(found))} have no single registration")
    return found


# Every SchemeParams field, once, however many schemes read it.
PARAMS: dict[str, Param] = _params()


def schemes_of(param: Param) -> list[str]:
    """The names of the schemes that read `param`."""
    return [s.name for s in _ALL if param in s.params]


def get_scheme(name: str) -> Scheme:
    """The registered scheme `name`; ValueError naming the choices otherwise."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


def default_params(**values: float) -> run_pb2.SchemeParams:
    """SchemeParams with every field at its registered default unless given in `values`."""
    if unknown := sorted(set(values) - set(PARAMS)):
        raise TypeError(f"unknown scheme parameters: {', '.join(unknown)}")
    params = run_pb2.SchemeParams()
    for name, param in PARAMS.items():
        setattr(params, name, values.get(name, param.default))
    return params


def fill_unset(params: run_pb2.SchemeParams) -> None:
    """Give every unset field its default, in place: an absent one where the field has explicit
    presence (`optional` in the proto: its 0 is a value of its own, as ssp's staleness bound),
    else one that is 0 where 0 means its default (per the proto)."""
    fields = run_pb2.SchemeParams.DESCRIPTOR.fields_by_name
    for name, param in PARAMS.items():
        unset = not params.HasField(name) if fields[name].has_presence else not getattr(params, name)
        if unset and (param.zero_is_default or fields[name].has_presence):
            setattr(params, name, param.default)


def validate_params(params: run_pb2.SchemeParams) -> None:
    """ValueError unless every field is within bounds, whichever scheme reads it: a spec must
    not fail later on a shard or a worker that reads it."""
    for param in PARAMS.values():
        param.check(getattr(params, param.name))


def check_implemented(names: Iterable[str], what: str) -> None:
    """ImportError unless `names` (the keys of a service's rule table) are exactly the registry's."""
    names = set(names)
    if names != set(SCHEMES):
        missing, extra = sorted(set(SCHEMES) - names), sorted(names - set(SCHEMES))
        raise ImportError(f"{what} do not match gradps.schemes: missing {missing}, not registered {extra}")
