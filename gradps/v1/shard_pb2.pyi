from gradps.v1 import run_pb2 as _run_pb2
from gradps.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PartPlacement(_message.Message):
    __slots__ = ("name", "index", "offset", "count", "shard")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    offset: int
    count: int
    shard: int
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ..., count: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("version", "shards", "tensors", "parts")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    shards: _containers.RepeatedScalarFieldContainer[str]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    parts: _containers.RepeatedCompositeFieldContainer[PartPlacement]
    def __init__(self, version: _Optional[int] = ..., shards: _Optional[_Iterable[str]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ..., parts: _Optional[_Iterable[_Union[PartPlacement, _Mapping]]] = ...) -> None: ...

class OpenRunRequest(_message.Message):
    __slots__ = ("run_id", "spec", "placement", "shard_index", "workers", "total_steps")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec: _run_pb2.RunSpec
    placement: Placement
    shard_index: int
    workers: _containers.RepeatedScalarFieldContainer[int]
    total_steps: int
    def __init__(self, run_id: _Optional[str] = ..., spec: _Optional[_Union[_run_pb2.RunSpec, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., shard_index: _Optional[int] = ..., workers: _Optional[_Iterable[int]] = ..., total_steps: _Optional[int] = ...) -> None: ...

class OpenRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CloseRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class EndRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetMembershipRequest(_message.Message):
    __slots__ = ("run_id", "epoch", "live_workers", "workers")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    epoch: int
    live_workers: _containers.RepeatedScalarFieldContainer[int]
    workers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_id: _Optional[str] = ..., epoch: _Optional[int] = ..., live_workers: _Optional[_Iterable[int]] = ..., workers: _Optional[_Iterable[int]] = ...) -> None: ...

class SetMembershipResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterTensorsRequest(_message.Message):
    __slots__ = ("run_id", "part", "overwrite", "part_count", "replica_step", "restore_epoch")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    PART_COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    part: _tensor_pb2.TensorPart
    overwrite: bool
    part_count: int
    replica_step: int
    restore_epoch: int
    def __init__(self, run_id: _Optional[str] = ..., part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., overwrite: _Optional[bool] = ..., part_count: _Optional[int] = ..., replica_step: _Optional[int] = ..., restore_epoch: _Optional[int] = ...) -> None: ...

class RegisterTensorsResponse(_message.Message):
    __slots__ = ("initialised",)
    INITIALISED_FIELD_NUMBER: _ClassVar[int]
    initialised: int
    def __init__(self, initialised: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("run_id", "worker_id", "min_version", "wait_ms", "codec", "clock", "gradient", "gradient_step", "into", "stream", "restore_epoch")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_STEP_FIELD_NUMBER: _ClassVar[int]
    INTO_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RESTORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker_id: int
    min_version: int
    wait_ms: int
    codec: _tensor_pb2.CodecParams
    clock: int
    gradient: bool
    gradient_step: int
    into: _tensor_pb2.SharedRegion
    stream: StreamCall
    restore_epoch: int
    def __init__(self, run_id: _Optional[str] = ..., worker_id: _Optional[int] = ..., min_version: _Optional[int] = ..., wait_ms: _Optional[int] = ..., codec: _Optional[_Union[_tensor_pb2.CodecParams, _Mapping]] = ..., clock: _Optional[int] = ..., gradient: _Optional[bool] = ..., gradient_step: _Optional[int] = ..., into: _Optional[_Union[_tensor_pb2.SharedRegion, _Mapping]] = ..., stream: _Optional[_Union[StreamCall, _Mapping]] = ..., restore_epoch: _Optional[int] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("part", "parts", "cut_step", "final_weights")
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    CUT_STEP_FIELD_NUMBER: _ClassVar[int]
    FINAL_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    part: _tensor_pb2.TensorPart
    parts: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorPart]
    cut_step: int
    final_weights: bool
    def __init__(self, part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[_tensor_pb2.TensorPart, _Mapping]]] = ..., cut_step: _Optional[int] = ..., final_weights: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("run_id", "worker_id", "step", "part", "parts", "stream", "part_count", "restore_epoch", "cut_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    PART_COUNT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CUT_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker_id: int
    step: int
    part: _tensor_pb2.TensorPart
    parts: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorPart]
    stream: StreamCall
    part_count: int
    restore_epoch: int
    cut_step: int
    def __init__(self, run_id: _Optional[str] = ..., worker_id: _Optional[int] = ..., step: _Optional[int] = ..., part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[_tensor_pb2.TensorPart, _Mapping]]] = ..., stream: _Optional[_Union[StreamCall, _Mapping]] = ..., part_count: _Optional[int] = ..., restore_epoch: _Optional[int] = ..., cut_step: _Optional[int] = ...) -> None: ...

class PushPullRequest(_message.Message):
    __slots__ = ("run_id", "worker_id", "step", "part", "parts", "stream", "pull", "part_count", "restore_epoch", "cut_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PART_COUNT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CUT_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker_id: int
    step: int
    part: _tensor_pb2.TensorPart
    parts: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorPart]
    stream: StreamCall
    pull: PullRequest
    part_count: int
    restore_epoch: int
    cut_step: int
    def __init__(self, run_id: _Optional[str] = ..., worker_id: _Optional[int] = ..., step: _Optional[int] = ..., part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[_tensor_pb2.TensorPart, _Mapping]]] = ..., stream: _Optional[_Union[StreamCall, _Mapping]] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ..., part_count: _Optional[int] = ..., restore_epoch: _Optional[int] = ..., cut_step: _Optional[int] = ...) -> None: ...

class PushPullResponse(_message.Message):
    __slots__ = ("push", "part", "parts", "cut_step", "final_weights")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    CUT_STEP_FIELD_NUMBER: _ClassVar[int]
    FINAL_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    push: PushResponse
    part: _tensor_pb2.TensorPart
    parts: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorPart]
    cut_step: int
    final_weights: bool
    def __init__(self, push: _Optional[_Union[PushResponse, _Mapping]] = ..., part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[_tensor_pb2.TensorPart, _Mapping]]] = ..., cut_step: _Optional[int] = ..., final_weights: _Optional[bool] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("parts", "staleness", "applied", "cut_step", "cut_asked")
    PARTS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    CUT_STEP_FIELD_NUMBER: _ClassVar[int]
    CUT_ASKED_FIELD_NUMBER: _ClassVar[int]
    parts: int
    staleness: int
    applied: bool
    cut_step: int
    cut_asked: bool
    def __init__(self, parts: _Optional[int] = ..., staleness: _Optional[int] = ..., applied: _Optional[bool] = ..., cut_step: _Optional[int] = ..., cut_asked: _Optional[bool] = ...) -> None: ...

class GroupAverageRequest(_message.Message):
    __slots__ = ("run_id", "worker_id", "step", "members", "is_global", "part", "parts", "into", "stream", "part_count", "consensus", "restore_epoch")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    IS_GLOBAL_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    INTO_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    PART_COUNT_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker_id: int
    step: int
    members: _containers.RepeatedScalarFieldContainer[int]
    is_global: bool
    part: _tensor_pb2.TensorPart
    parts: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorPart]
    into: _tensor_pb2.SharedRegion
    stream: StreamCall
    part_count: int
    consensus: bool
    restore_epoch: int
    def __init__(self, run_id: _Optional[str] = ..., worker_id: _Optional[int] = ..., step: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., is_global: _Optional[bool] = ..., part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[_tensor_pb2.TensorPart, _Mapping]]] = ..., into: _Optional[_Union[_tensor_pb2.SharedRegion, _Mapping]] = ..., stream: _Optional[_Union[StreamCall, _Mapping]] = ..., part_count: _Optional[int] = ..., consensus: _Optional[bool] = ..., restore_epoch: _Optional[int] = ...) -> None: ...

class GroupAverageResponse(_message.Message):
    __slots__ = ("part", "parts")
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    part: _tensor_pb2.TensorPart
    parts: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorPart]
    def __init__(self, part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[_tensor_pb2.TensorPart, _Mapping]]] = ...) -> None: ...

class MapSegmentRequest(_message.Message):
    __slots__ = ("run_id", "worker_id", "segment", "token", "pid", "fd", "pid_namespace")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker_id: int
    segment: str
    token: bytes
    pid: int
    fd: int
    pid_namespace: int
    def __init__(self, run_id: _Optional[str] = ..., worker_id: _Optional[int] = ..., segment: _Optional[str] = ..., token: _Optional[bytes] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ..., pid_namespace: _Optional[int] = ...) -> None: ...

class MapSegmentResponse(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class OpenStreamRequest(_message.Message):
    __slots__ = ("run_id", "worker_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker_id: int
    def __init__(self, run_id: _Optional[str] = ..., worker_id: _Optional[int] = ...) -> None: ...

class OpenStreamResponse(_message.Message):
    __slots__ = ("port", "token", "stream")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    port: int
    token: bytes
    stream: int
    def __init__(self, port: _Optional[int] = ..., token: _Optional[bytes] = ..., stream: _Optional[int] = ...) -> None: ...

class StreamCall(_message.Message):
    __slots__ = ("stream", "call")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    stream: int
    call: int
    def __init__(self, stream: _Optional[int] = ..., call: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("parts", "param_bytes", "pushes", "bytes_pushed", "bytes_pulled", "min_version", "device")
    PARTS_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    parts: int
    param_bytes: int
    pushes: int
    bytes_pushed: int
    bytes_pulled: int
    min_version: int
    device: str
    def __init__(self, parts: _Optional[int] = ..., param_bytes: _Optional[int] = ..., pushes: _Optional[int] = ..., bytes_pushed: _Optional[int] = ..., bytes_pulled: _Optional[int] = ..., min_version: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class CheckpointRunRequest(_message.Message):
    __slots__ = ("run_id", "step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class CheckpointRunResponse(_message.Message):
    __slots__ = ("sequence", "step", "min_version", "max_version", "bytes", "snapshot_seconds", "write_seconds")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    step: int
    min_version: int
    max_version: int
    bytes: int
    snapshot_seconds: float
    write_seconds: float
    def __init__(self, sequence: _Optional[int] = ..., step: _Optional[int] = ..., min_version: _Optional[int] = ..., max_version: _Optional[int] = ..., bytes: _Optional[int] = ..., snapshot_seconds: _Optional[float] = ..., write_seconds: _Optional[float] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("sequence", "step", "min_version", "max_version", "bytes", "created_unix", "seconds")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    step: int
    min_version: int
    max_version: int
    bytes: int
    created_unix: float
    seconds: float
    def __init__(self, sequence: _Optional[int] = ..., step: _Optional[int] = ..., min_version: _Optional[int] = ..., max_version: _Optional[int] = ..., bytes: _Optional[int] = ..., created_unix: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "restored", "step", "restore_epoch")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    restored: bool
    step: int
    restore_epoch: int
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ..., restored: _Optional[bool] = ..., step: _Optional[int] = ..., restore_epoch: _Optional[int] = ...) -> None: ...

class ReadCheckpointRequest(_message.Message):
    __slots__ = ("run_id", "step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ReadCheckpointResponse(_message.Message):
    __slots__ = ("part", "parts")
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    part: _tensor_pb2.TensorPart
    parts: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorPart]
    def __init__(self, part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[_tensor_pb2.TensorPart, _Mapping]]] = ...) -> None: ...

class RestoreRunRequest(_message.Message):
    __slots__ = ("run_id", "epoch", "step", "keep", "live_workers", "membership_epoch", "workers")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    epoch: int
    step: int
    keep: bool
    live_workers: _containers.RepeatedScalarFieldContainer[int]
    membership_epoch: int
    workers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., keep: _Optional[bool] = ..., live_workers: _Optional[_Iterable[int]] = ..., membership_epoch: _Optional[int] = ..., workers: _Optional[_Iterable[int]] = ...) -> None: ...

class RestoreRunResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...
