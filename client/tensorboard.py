"""A run's curves as TensorBoard event files: `gradps train --tensorboard DIR` (and `compare`).

One TensorBoard run per gradps run (DIR/<name>): the run's loss, test accuracy (its accuracy
curve, as `client.report.accuracy_curve`: evaluations on the way, then the final model's),
samples/s (in all and by rank, where a straggler shows), mean staleness of its pushes and the
fraction of time its workers waited, each at the step the workers had reached on average
(gradps.run_figures).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gradps import run_figures
from gradps.v1 import coordinator_pb2 as cpb


class RunBoard:
    """Writes one run's metrics, as the coordinator streams them, to `log_dir`."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def add(self, run: cpb.RunStatus, metrics: cpb.Metrics) -> None:
        """One worker's report, with the run's latest reports of every worker."""
        latest = list(run.latest) or [metrics]
        step = round(run_figures.mean_step(latest))
        scalar = self._writer.add_scalar
        scalar("loss", run_figures.mean_loss(latest), step)
        if run_figures.evaluated_on_the_way(metrics):
            self._evaluation(metrics)
        if rates := run_figures.rates_by_rank(latest):
            scalar("samples_per_second", sum(rates.values()), step)
            self._writer.add_scalars("samples_per_second_by_rank", {f"rank{r}": v for r, v in rates.items()}, step)
        if (staleness := run_figures.mean_staleness(latest)) is not None:
            scalar("staleness", staleness, step)
        if (waited := run_figures.wait_fraction(latest)) is not None:
            scalar("wait_fraction", waited, step)

    def _evaluation(self, metrics: cpb.Metrics) -> None:
        self._writer.add_scalar("test_accuracy", metrics.test_accuracy, metrics.step)
        self._writer.add_scalar("test_loss", metrics.test_loss, metrics.step)

    def close(self, latest: Sequence[cpb.Metrics]) -> None:
        """Write the final model's evaluation from the run's last reports (none if it has none yet:
        the run was interrupted), and close."""
        if (final := run_figures.final_report(latest)) is not None:
            self._evaluation(final)
        self._writer.close()
