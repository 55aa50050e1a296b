"""The run the restart tests kill parts of: the digits MLP, two workers, its parts on both shards,
checkpointed every CHECKPOINT_EVERY steps, no evaluation until the end."""

from __future__ import annotations

from gradps.v1 import run_pb2

CHECKPOINT_EVERY = 20


def digits_spec(scheme: str, steps: int, **fields: object) -> run_pb2.RunSpec:
    """The run's spec; `fields` replace its defaults."""
    base: dict[str, object] = dict(
        scheme=scheme,
        workers=2,
        batch_size=32,
        steps=steps,
        eval_every=0,
        seed=0,
        optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.2),
        checkpoint_every_steps=CHECKPOINT_EVERY,
        part_size=16 << 10,  # the mlp's parts on both shards
    )
    base.update(fields)
    return run_pb2.RunSpec(**base)  # type: ignore[arg-type]
