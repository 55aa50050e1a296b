"""The codecs a run may name, without their implementations: each codec's name, wire enum value,
properties and parameters, how the CLI writes it, and the checks of a `CodecParams`.

No torch here: the coordinator and the CLI check a spec's codecs with this table alone;
`gradps.codecs` binds each entry to the class that encodes and decodes it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gradps.v1 import tensor_pb2


class CodecError(ValueError):
    """A payload or codec parameter that cannot be decoded; its message is one line for the
    caller to return as gRPC INVALID_ARGUMENT."""


@dataclass(frozen=True)
class CodecEntry:
    """One codec as a run names it."""

    # Short name used in CLI strings and tables, e.g. "int8".
    name: str
    # The tensor.proto Codec enum value whose payload layout it writes.
    enum: tensor_pb2.Codec
    # True when decode(encode(x)) may differ from x (the sender then keeps error feedback).
    lossy: bool
    # True when weights may be pulled in it: a shard keeps no error feedback per puller, so only
    # dense codecs whose values arrive whole.
    pull: bool = False
    # The CodecParams fields it takes besides `codec` (_ARGUMENTS says how the CLI writes each).
    params: tuple[str, ...] = ()


# Every codec, in the order the CLI lists them.
ENTRIES: tuple[CodecEntry, ...] = (
    CodecEntry("none", tensor_pb2.CODEC_NONE, lossy=False, pull=True),
    CodecEntry("fp16", tensor_pb2.CODEC_FP16, lossy=True, pull=True),
    CodecEntry("bf16", tensor_pb2.CODEC_BF16, lossy=True, pull=True),
    CodecEntry("int8", tensor_pb2.CODEC_INT8, lossy=True, params=("stochastic_rounding",)),
    CodecEntry("topk", tensor_pb2.CODEC_TOPK, lossy=True, params=("ratio",)),
    CodecEntry("randk", tensor_pb2.CODEC_RANDK, lossy=True, params=("ratio",)),
    CodecEntry("sign", tensor_pb2.CODEC_SIGN, lossy=True),
)
BY_NAME: dict[str, CodecEntry] = {e.name: e for e in ENTRIES}

# How the CLI writes each CodecParams field a codec may take: the ":ARG" suffix, and whether the
# codec needs it (a ratio) or may go without (stochastic rounding).
_ARGUMENTS: dict[str, tuple[str, bool]] = {"ratio": (":RATIO", True), "stochastic_rounding": (":stochastic", False)}


def _by_enum() -> dict[int, CodecEntry]:
    table: dict[int, CodecEntry] = {e.enum: e for e in ENTRIES}
    enums = {v for v in tensor_pb2.Codec.values() if v != tensor_pb2.CODEC_UNSPECIFIED}
    if len(table) != len(ENTRIES) or set(table) != enums:
        raise ImportError("gradps.codec_table: every Codec enum value but UNSPECIFIED needs exactly one entry")
    fields = set(tensor_pb2.CodecParams.DESCRIPTOR.fields_by_name) - {"codec"}
    if set(_ARGUMENTS) != fields or any(set(e.params) - fields for e in ENTRIES):
        raise ImportError("gradps.codec_table: codec params must be CodecParams fields with a CLI form")
    return table


# Codec enum value -> entry.
_BY_ENUM: dict[int, CodecEntry] = _by_enum()
# CodecParams field -> the names of the codecs that take it.
_TAKEN_BY = {field: [e.name for e in ENTRIES if field in e.params] for field in _ARGUMENTS}


def _words(names: list[str], last: str = "and") -> str:
    return ", ".join(names[:-1]) + f" {last} {names[-1]}" if len(names) > 1 else "".join(names)


def codec_forms(*, pull: bool = False) -> list[str]:
    """The CLI forms of every codec (those a pull may use with `pull`), e.g. "topk:RATIO"."""
    forms = []
    for entry in ENTRIES:
        if pull and not entry.pull:
            continue
        suffixes = [_ARGUMENTS[p] for p in entry.params]
        if not any(required for _, required in suffixes):
            forms.append(entry.name)
        forms.extend(entry.name + suffix for suffix, _ in suffixes)
    return forms


def codec_syntax(*, pull: bool = False) -> str:
    """The accepted CLI strings in one line, for help texts and error messages."""
    forms = codec_forms(pull=pull)
    return ", ".join(forms) + (" (0 < RATIO <= 1)" if any("RATIO" in f for f in forms) else "")


_SYNTAX = codec_syntax()


def ratio_text(ratio: float) -> str:
    """The shortest decimal that reads back as the same float32: 0.1, not 0.10000000149."""
    value = _float32(ratio)
    for digits in range(1, 10):  # 9 significant digits always read back as the same float32
        text = f"{value:.{digits}g}"
        if _float32(float(text)) == value:
            break
    return repr(float(text))  # as Python writes floats: 1.0, 0.01, 1e-05


def _float32(x: float) -> float:
    """`x` rounded to float32, as the ratio travels (CodecParams.ratio)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def check_ratio(ratio: float, codec: str) -> float:
    """CodecError unless 0 < ratio <= 1 (the proto's CodecParams.ratio)."""
    if not 0.0 < ratio <= 1.0:  # also false for NaN
        raise CodecError(f"{codec}: ratio must be in (0, 1], got {ratio}")
    return ratio


def _named(params: tensor_pb2.CodecParams) -> CodecEntry | None:
    """The entry `params.codec` names (CODEC_UNSPECIFIED means CODEC_NONE); None for no entry."""
    return _BY_ENUM.get(params.codec or tensor_pb2.CODEC_NONE)


def check_codec(params: tensor_pb2.CodecParams) -> CodecEntry:
    """The entry of the codec `params` names; CodecError on an unknown codec or parameters that
    do not belong to it."""
    entry = _named(params)
    if entry is None:
        raise CodecError(f"unknown codec {params.codec}")
    if "ratio" in entry.params:
        check_ratio(params.ratio, entry.name)
    for field, takers in _TAKEN_BY.items():
        value = getattr(params, field)
        if value and field not in entry.params:
            raise CodecError(f"{entry.name}: {field} is for {_words(takers)} only, got {value}")
    return entry


def check_pull_codec(params: tensor_pb2.CodecParams) -> CodecEntry:
    """`check_codec` for a pull (PullRequest.codec, RunSpec.pull_codec): CodecError, its message
    one line that starts with "pull codec", unless `params` is a valid codec that may be pulled."""
    entry = _named(params)
    if entry is None or not entry.pull:
        raise CodecError(f"pull codec must be {_words(codec_forms(pull=True), 'or')}")
    try:
        return check_codec(params)
    except CodecError as e:
        raise CodecError(f"pull codec: {e}") from None


def codec_family(params: tensor_pb2.CodecParams) -> str:
    """A codec's family name ("topk", not "topk:0.01"), "unknown" for an enum value no entry has."""
    entry = _named(params)
    return entry.name if entry else "unknown"


def parse_codec(text: str) -> tensor_pb2.CodecParams:
    """Parse a CLI codec string, one of `codec_forms()` ("none", "int8:stochastic", "topk:0.01",
    ...). Raises ValueError with the accepted forms on anything else."""
    name, sep, arg = text.strip().lower().partition(":")
    entry = BY_NAME.get(name)
    if entry is None:
        raise ValueError(f"unknown codec {text!r}; expected one of: {_SYNTAX}")
    if "ratio" in entry.params:
        return tensor_pb2.CodecParams(codec=entry.enum, ratio=_parse_ratio(text, name, sep, arg))
    if sep and "stochastic_rounding" in entry.params and arg == "stochastic":
        return tensor_pb2.CodecParams(codec=entry.enum, stochastic_rounding=True)
    if sep:
        raise ValueError(f"codec {text!r}: {name} takes no {arg!r} argument; expected one of: {_SYNTAX}")
    return tensor_pb2.CodecParams(codec=entry.enum)


def _parse_ratio(text: str, name: str, sep: str, arg: str) -> float:
    if not sep:
        raise ValueError(f"codec {text!r} needs a ratio, e.g. {name}:0.01")
    try:
        ratio = float(arg)
    except ValueError:
        raise ValueError(f"codec {text!r}: ratio {arg!r} is not a number") from None
    # The ratio travels as float32: also reject what float32 rounds to 0.
    if not (0.0 < ratio <= 1.0 and _float32(ratio) > 0):
        raise ValueError(f"codec {text!r}: ratio must be in (0, 1]")
    return ratio


def format_codec(params: tensor_pb2.CodecParams) -> str:
    """The CLI string for `params`, the inverse of `parse_codec`; CodecError if `params` is invalid."""
    entry = check_codec(params)  # same validation as on the wire
    if "ratio" in entry.params:
        return f"{entry.name}:{ratio_text(params.ratio)}"
    if params.stochastic_rounding:
        return f"{entry.name}:stochastic"
    return entry.name
