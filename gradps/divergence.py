"""Settings known to diverge: one line each, said before a run starts rather than found at 10%.

Each rule comes from runs that trained to chance where `sync` with the same settings reached 95%
(digits, MLP, 4 workers; docs/schemes.md, "Settings known to diverge").
"""

from __future__ import annotations

from gradps.optimizer_spec import asynchrony_aware, averages_gradients
from gradps.v1 import run_pb2

# The largest step of one asynchronous push, lr / (1 - momentum) as the shards apply it, that
# trained: 0.2 reached 95%, 0.25 (lr 0.1, momentum 0.9) and 0.5 stayed at 10%, 0.35 ended at 79%.
MAX_PUSH_STEP = 0.2
# asgd with --n-push N > 1 pushes the sum of N gradients: pushes of 0.6 trained (97% with N = 2
# and 4, 94.7% with N = 8, whose pushes of 0.2 reached 95%), of 0.7 (N = 2) and 0.8 (N = 2, 4, 8)
# ended at 10-48% (digits, 4 workers, 50 epochs).
MAX_SUMMED_PUSH_STEP = 0.6
_ASYNCHRONOUS = ("asgd", "ssp")


def known_to_diverge(spec: run_pb2.RunSpec) -> list[str]:
    """One line for each setting of `spec` (defaults applied) known to diverge or stall, with what
    to change; empty when none is."""
    found = []
    opt = spec.optimizer
    params = spec.scheme_params
    if spec.scheme in _ASYNCHRONOUS and (opt.name or "sgd") == "sgd":
        applied = asynchrony_aware(opt, spec.workers)
        summed = max(1, params.n_push) if spec.scheme == "asgd" else 1
        step = summed * applied.lr / (1.0 - applied.momentum)
        limit = MAX_PUSH_STEP if summed == 1 else MAX_SUMMED_PUSH_STEP
        if step > limit * (1 + 1e-9):  # not for a rounding of the lr it names
            what = "lr/(1-momentum)" if summed == 1 else f"{summed} summed gradients times lr/(1-momentum)"
            found.append(
                f"{spec.scheme} moves the model {step:.3g} per push ({what} as the shards apply it to "
                f"{spec.workers} asynchronous workers); above {limit} per push runs diverged where sync "
                f"trained: --lr {opt.lr * limit / step:.3g} or less keeps under it"
            )
    if spec.scheme == "pseudosync" and params.fixed_alpha and params.alpha < 1 and averages_gradients(opt):
        found.append(
            f"pseudosync's fixed prediction (--alpha {params.alpha:g}) in front of an optimizer that averages "
            "gradients itself (momentum, Adam) lags twice and stalled far below its target: drop --fixed-alpha"
        )
    return found
