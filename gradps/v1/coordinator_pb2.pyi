from gradps.v1 import run_pb2 as _run_pb2
from gradps.v1 import shard_pb2 as _shard_pb2
from gradps.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_PENDING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_COMPLETED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_PENDING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_COMPLETED: RunState
RUN_STATE_FAILED: RunState
RUN_STATE_STOPPED: RunState

class Metrics(_message.Message):
    __slots__ = ("worker_id", "rank", "step", "loss", "test_accuracy", "test_loss", "samples", "elapsed_s", "bytes_pushed", "bytes_pulled", "staleness_sum", "pushes", "staleness_max", "wait_s", "done", "error", "total_steps", "weights_digest", "final_model")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_SUM_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MAX_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FINAL_MODEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    rank: int
    step: int
    loss: float
    test_accuracy: float
    test_loss: float
    samples: int
    elapsed_s: float
    bytes_pushed: int
    bytes_pulled: int
    staleness_sum: float
    pushes: int
    staleness_max: int
    wait_s: float
    done: bool
    error: str
    total_steps: int
    weights_digest: bytes
    final_model: bool
    def __init__(self, worker_id: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., test_accuracy: _Optional[float] = ..., test_loss: _Optional[float] = ..., samples: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., bytes_pushed: _Optional[int] = ..., bytes_pulled: _Optional[int] = ..., staleness_sum: _Optional[float] = ..., pushes: _Optional[int] = ..., staleness_max: _Optional[int] = ..., wait_s: _Optional[float] = ..., done: _Optional[bool] = ..., error: _Optional[str] = ..., total_steps: _Optional[int] = ..., weights_digest: _Optional[bytes] = ..., final_model: _Optional[bool] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "spec", "state", "submitted_at", "started_at", "finished_at", "workers", "dead_workers", "latest", "total_steps", "message", "pending_reason", "restores", "rolled_back_steps", "restore_epoch", "joins", "scaled_to")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEAD_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PENDING_REASON_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    JOINS_FIELD_NUMBER: _ClassVar[int]
    SCALED_TO_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec: _run_pb2.RunSpec
    state: RunState
    submitted_at: float
    started_at: float
    finished_at: float
    workers: _containers.RepeatedScalarFieldContainer[int]
    dead_workers: _containers.RepeatedScalarFieldContainer[int]
    latest: _containers.RepeatedCompositeFieldContainer[Metrics]
    total_steps: int
    message: str
    pending_reason: str
    restores: int
    rolled_back_steps: int
    restore_epoch: int
    joins: int
    scaled_to: int
    def __init__(self, run_id: _Optional[str] = ..., spec: _Optional[_Union[_run_pb2.RunSpec, _Mapping]] = ..., state: _Optional[_Union[RunState, str]] = ..., submitted_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., workers: _Optional[_Iterable[int]] = ..., dead_workers: _Optional[_Iterable[int]] = ..., latest: _Optional[_Iterable[_Union[Metrics, _Mapping]]] = ..., total_steps: _Optional[int] = ..., message: _Optional[str] = ..., pending_reason: _Optional[str] = ..., restores: _Optional[int] = ..., rolled_back_steps: _Optional[int] = ..., restore_epoch: _Optional[int] = ..., joins: _Optional[int] = ..., scaled_to: _Optional[int] = ...) -> None: ...

class SubmitRunRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _run_pb2.RunSpec
    def __init__(self, spec: _Optional[_Union[_run_pb2.RunSpec, _Mapping]] = ...) -> None: ...

class SubmitRunResponse(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run", "placement")
    RUN_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    run: RunStatus
    placement: _shard_pb2.Placement
    def __init__(self, run: _Optional[_Union[RunStatus, _Mapping]] = ..., placement: _Optional[_Union[_shard_pb2.Placement, _Mapping]] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StopRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ResumeRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class DeleteRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WatchRunResponse(_message.Message):
    __slots__ = ("run", "metrics")
    RUN_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    run: RunStatus
    metrics: Metrics
    def __init__(self, run: _Optional[_Union[RunStatus, _Mapping]] = ..., metrics: _Optional[_Union[Metrics, _Mapping]] = ...) -> None: ...

class TakeCheckpointRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class TakeCheckpointResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[ShardCheckpoint]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[ShardCheckpoint, _Mapping]]] = ...) -> None: ...

class ShardCheckpoint(_message.Message):
    __slots__ = ("shard", "sequence", "step", "bytes", "write_seconds")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    shard: str
    sequence: int
    step: int
    bytes: int
    write_seconds: float
    def __init__(self, shard: _Optional[str] = ..., sequence: _Optional[int] = ..., step: _Optional[int] = ..., bytes: _Optional[int] = ..., write_seconds: _Optional[float] = ...) -> None: ...

class ScaleRunRequest(_message.Message):
    __slots__ = ("run_id", "workers")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    workers: int
    def __init__(self, run_id: _Optional[str] = ..., workers: _Optional[int] = ...) -> None: ...

class ScaleRunResponse(_message.Message):
    __slots__ = ("run", "released")
    RUN_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    run: RunStatus
    released: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run: _Optional[_Union[RunStatus, _Mapping]] = ..., released: _Optional[_Iterable[int]] = ...) -> None: ...

class ListRunCheckpointsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListRunCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "shards")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[RunCheckpoint]
    shards: _containers.RepeatedCompositeFieldContainer[ShardCheckpointSteps]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[RunCheckpoint, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[ShardCheckpointSteps, _Mapping]]] = ...) -> None: ...

class RunCheckpoint(_message.Message):
    __slots__ = ("step", "bytes", "shards")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    bytes: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardCheckpoint]
    def __init__(self, step: _Optional[int] = ..., bytes: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardCheckpoint, _Mapping]]] = ...) -> None: ...

class ShardCheckpointSteps(_message.Message):
    __slots__ = ("shard", "steps")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    shard: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shard: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ...) -> None: ...

class ExportRunRequest(_message.Message):
    __slots__ = ("run_id", "checkpoint_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    checkpoint_step: int
    def __init__(self, run_id: _Optional[str] = ..., checkpoint_step: _Optional[int] = ...) -> None: ...

class ExportRunResponse(_message.Message):
    __slots__ = ("part",)
    PART_FIELD_NUMBER: _ClassVar[int]
    part: _tensor_pb2.TensorPart
    def __init__(self, part: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ...) -> None: ...

class GetClusterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "name", "device", "alive", "run_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    name: str
    device: str
    alive: bool
    run_id: str
    def __init__(self, worker_id: _Optional[int] = ..., name: _Optional[str] = ..., device: _Optional[str] = ..., alive: _Optional[bool] = ..., run_id: _Optional[str] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard_index", "address", "device", "alive")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    address: str
    device: str
    alive: bool
    def __init__(self, shard_index: _Optional[int] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., alive: _Optional[bool] = ...) -> None: ...

class GetClusterResponse(_message.Message):
    __slots__ = ("shards", "workers", "shard_infos")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INFOS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[str]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    shard_infos: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[str]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., shard_infos: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class RegisterShardRequest(_message.Message):
    __slots__ = ("address", "device", "boot_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    device: str
    boot_id: str
    def __init__(self, address: _Optional[str] = ..., device: _Optional[str] = ..., boot_id: _Optional[str] = ...) -> None: ...

class RegisterShardResponse(_message.Message):
    __slots__ = ("shard_index", "heartbeat_interval_ms")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    heartbeat_interval_ms: int
    def __init__(self, shard_index: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class ShardHeartbeatRequest(_message.Message):
    __slots__ = ("address", "device", "boot_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    device: str
    boot_id: str
    def __init__(self, address: _Optional[str] = ..., device: _Optional[str] = ..., boot_id: _Optional[str] = ...) -> None: ...

class ShardHeartbeatResponse(_message.Message):
    __slots__ = ("shard_index", "registered", "heartbeat_interval_ms")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    registered: bool
    heartbeat_interval_ms: int
    def __init__(self, shard_index: _Optional[int] = ..., registered: _Optional[bool] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class JoinWorkerRequest(_message.Message):
    __slots__ = ("name", "device")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    device: str
    def __init__(self, name: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class JoinWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    heartbeat_interval_ms: int
    def __init__(self, worker_id: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class LeaveWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class LeaveWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "run_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    run_id: str
    def __init__(self, worker_id: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("stop", "rejoin")
    STOP_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    rejoin: bool
    def __init__(self, stop: _Optional[bool] = ..., rejoin: _Optional[bool] = ...) -> None: ...

class GetAssignmentRequest(_message.Message):
    __slots__ = ("worker_id", "wait_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    wait_ms: int
    def __init__(self, worker_id: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class GetAssignmentResponse(_message.Message):
    __slots__ = ("run_id", "spec", "rank", "workers", "total_steps")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec: _run_pb2.RunSpec
    rank: int
    workers: _containers.RepeatedScalarFieldContainer[int]
    total_steps: int
    def __init__(self, run_id: _Optional[str] = ..., spec: _Optional[_Union[_run_pb2.RunSpec, _Mapping]] = ..., rank: _Optional[int] = ..., workers: _Optional[_Iterable[int]] = ..., total_steps: _Optional[int] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ("run_id", "tensors", "total_steps", "worker_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    total_steps: int
    worker_id: int
    def __init__(self, run_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ..., total_steps: _Optional[int] = ..., worker_id: _Optional[int] = ...) -> None: ...

class GetPlacementResponse(_message.Message):
    __slots__ = ("placement", "start_step", "restore_epoch")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    placement: _shard_pb2.Placement
    start_step: int
    restore_epoch: int
    def __init__(self, placement: _Optional[_Union[_shard_pb2.Placement, _Mapping]] = ..., start_step: _Optional[int] = ..., restore_epoch: _Optional[int] = ...) -> None: ...

class ReportMetricsRequest(_message.Message):
    __slots__ = ("run_id", "metrics")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    metrics: Metrics
    def __init__(self, run_id: _Optional[str] = ..., metrics: _Optional[_Union[Metrics, _Mapping]] = ...) -> None: ...

class ReportMetricsResponse(_message.Message):
    __slots__ = ("stop",)
    STOP_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    def __init__(self, stop: _Optional[bool] = ...) -> None: ...
