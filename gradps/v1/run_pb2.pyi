from gradps.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "lr", "momentum", "nesterov", "weight_decay", "beta1", "beta2", "eps", "schedule", "warmup_steps", "step_size", "gamma", "total_steps")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    schedule: str
    warmup_steps: int
    step_size: int
    gamma: float
    total_steps: int
    def __init__(self, name: _Optional[str] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., schedule: _Optional[str] = ..., warmup_steps: _Optional[int] = ..., step_size: _Optional[int] = ..., gamma: _Optional[float] = ..., total_steps: _Optional[int] = ...) -> None: ...

class SchemeParams(_message.Message):
    __slots__ = ("n_push", "n_fetch", "staleness_lr", "dc_lambda", "dc_adaptive", "staleness", "group_size", "tau", "alpha", "alpha_min", "fixed_alpha", "backup_workers")
    N_PUSH_FIELD_NUMBER: _ClassVar[int]
    N_FETCH_FIELD_NUMBER: _ClassVar[int]
    STALENESS_LR_FIELD_NUMBER: _ClassVar[int]
    DC_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    DC_ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    ALPHA_MIN_FIELD_NUMBER: _ClassVar[int]
    FIXED_ALPHA_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    n_push: int
    n_fetch: int
    staleness_lr: bool
    dc_lambda: float
    dc_adaptive: bool
    staleness: int
    group_size: int
    tau: int
    alpha: float
    alpha_min: float
    fixed_alpha: bool
    backup_workers: int
    def __init__(self, n_push: _Optional[int] = ..., n_fetch: _Optional[int] = ..., staleness_lr: _Optional[bool] = ..., dc_lambda: _Optional[float] = ..., dc_adaptive: _Optional[bool] = ..., staleness: _Optional[int] = ..., group_size: _Optional[int] = ..., tau: _Optional[int] = ..., alpha: _Optional[float] = ..., alpha_min: _Optional[float] = ..., fixed_alpha: _Optional[bool] = ..., backup_workers: _Optional[int] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("model", "dataset", "scheme", "scheme_params", "optimizer", "batch_size", "steps", "epochs", "seed", "codec", "pull_codec", "eval_every", "workers", "part_size", "dataset_size", "straggler_rank", "straggler_factor", "jitter", "checkpoint_every_steps", "checkpoint_every_seconds", "script")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    SCHEME_PARAMS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PULL_CODEC_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PART_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATASET_SIZE_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_RANK_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FACTOR_FIELD_NUMBER: _ClassVar[int]
    JITTER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCRIPT_FIELD_NUMBER: _ClassVar[int]
    model: str
    dataset: str
    scheme: str
    scheme_params: SchemeParams
    optimizer: OptimizerSpec
    batch_size: int
    steps: int
    epochs: float
    seed: int
    codec: _tensor_pb2.CodecParams
    pull_codec: _tensor_pb2.CodecParams
    eval_every: int
    workers: int
    part_size: int
    dataset_size: int
    straggler_rank: int
    straggler_factor: float
    jitter: float
    checkpoint_every_steps: int
    checkpoint_every_seconds: float
    script: str
    def __init__(self, model: _Optional[str] = ..., dataset: _Optional[str] = ..., scheme: _Optional[str] = ..., scheme_params: _Optional[_Union[SchemeParams, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., batch_size: _Optional[int] = ..., steps: _Optional[int] = ..., epochs: _Optional[float] = ..., seed: _Optional[int] = ..., codec: _Optional[_Union[_tensor_pb2.CodecParams, _Mapping]] = ..., pull_codec: _Optional[_Union[_tensor_pb2.CodecParams, _Mapping]] = ..., eval_every: _Optional[int] = ..., workers: _Optional[int] = ..., part_size: _Optional[int] = ..., dataset_size: _Optional[int] = ..., straggler_rank: _Optional[int] = ..., straggler_factor: _Optional[float] = ..., jitter: _Optional[float] = ..., checkpoint_every_steps: _Optional[int] = ..., checkpoint_every_seconds: _Optional[float] = ..., script: _Optional[str] = ...) -> None: ...
