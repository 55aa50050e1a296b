from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_NONE: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_TOPK: _ClassVar[Codec]
    CODEC_RANDK: _ClassVar[Codec]
    CODEC_SIGN: _ClassVar[Codec]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
CODEC_UNSPECIFIED: Codec
CODEC_NONE: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_TOPK: Codec
CODEC_RANDK: Codec
CODEC_SIGN: Codec

class CodecParams(_message.Message):
    __slots__ = ("codec", "ratio", "stochastic_rounding")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    STOCHASTIC_ROUNDING_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    ratio: float
    stochastic_rounding: bool
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., ratio: _Optional[float] = ..., stochastic_rounding: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class TensorPart(_message.Message):
    __slots__ = ("name", "index", "offset", "count", "dtype", "codec", "payload", "version", "lz4", "shared", "streamed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LZ4_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    offset: int
    count: int
    dtype: DType
    codec: CodecParams
    payload: bytes
    version: int
    lz4: bool
    shared: SharedRegion
    streamed: int
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ..., count: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec: _Optional[_Union[CodecParams, _Mapping]] = ..., payload: _Optional[bytes] = ..., version: _Optional[int] = ..., lz4: _Optional[bool] = ..., shared: _Optional[_Union[SharedRegion, _Mapping]] = ..., streamed: _Optional[int] = ...) -> None: ...

class SharedRegion(_message.Message):
    __slots__ = ("segment", "offset", "length")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    length: int
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...
