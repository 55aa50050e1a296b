"""`gradps launch`: the user's own script as the workers of a run (real processes: a cluster, the
launcher, the scripts), and the translation of torch optimizers to the shards' optimizer."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from client.cli import cli
from client.local_cluster import LocalCluster
from client.sdk import Client
from gradps.optimizer import spec_of
from gradps.v1 import coordinator_pb2 as cpb

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "own_training_loop.py"


def _example():
    """The example as a module (its training runs only as a script): its model and data."""
    spec = importlib.util.spec_from_file_location("own_training_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A cluster without workers of its own: the launched scripts are its workers."""
    with LocalCluster(shards=2, workers=0, log_dir=tmp_path_factory.mktemp("logs")) as c:
        yield c


def _launch(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "client.cli", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def test_launched_script_trains_and_its_state_dict_loads(cluster, tmp_path):
    out = tmp_path / "run"
    r = _launch(
        "--coordinator", cluster.address, "--workers", "2", "--epochs", "10", "--no-progress", "--out", str(out),
        str(EXAMPLE), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "completed" and summary["workers"] == 2
    accuracy = summary["final_test_accuracy"]
    assert accuracy >= 0.95, summary
    # model.pt: the whole model (BatchNorm's running statistics too) loads strictly into a fresh one
    # and scores what the run reported.
    example = _example()
    state = torch.load(out / "model.pt")
    fresh = example.model()
    fresh.load_state_dict(state)
    assert {"2.running_mean", "2.running_var", "2.num_batches_tracked"} <= state.keys()
    assert state["2.running_mean"].abs().sum() > 0  # trained statistics, not a fresh layer's zeros
    _, test = example.data()
    fresh.eval()
    with torch.no_grad():
        x, y = test.tensors
        fresh_accuracy = (fresh(x).argmax(dim=-1) == y).float().mean().item()
    assert fresh_accuracy == pytest.approx(accuracy, abs=1e-6)
    # The shards' export is the parameters of that model.
    with Client(cluster.address) as client:
        exported = client.export_state_dict(summary["run_id"])
    assert exported.keys() == dict(fresh.named_parameters()).keys()
    for name, value in exported.items():
        assert torch.equal(value, state[name]), name


def test_a_launched_run_lists_its_script_as_its_model(cluster, tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(
        "import torch\nimport gradps\n\ngradps.init()\nmodel = torch.nn.Linear(4, 2)\n"
        "opt = gradps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)\n"
        "for x in gradps.batches([torch.randn(8, 4)] * 3):\n"
        "    opt.zero_grad()\n"
        "    model(x).pow(2).mean().backward()\n"
        "    opt.step()\n"
    )
    out = tmp_path / "run"
    r = _launch(
        "--coordinator", cluster.address, "--workers", "2", "--steps", "3", "--no-progress", "--out", str(out),
        str(script), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["model"], summary["dataset"]) == ("script:tiny.py", "its own data"), summary
    # The spec says so in a field of its own; its model keeps the default, which no worker built.
    with Client(cluster.address) as client:
        spec = client.run(summary["run_id"]).run.spec
    assert (spec.script, spec.model) == ("tiny.py", "mlp")
    listed = CliRunner().invoke(cli, ["runs", "--coordinator", cluster.address], env={"COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    (row,) = [line for line in listed.output.splitlines() if summary["run_id"] in line]
    assert "script:tiny.py" in row and "mlp" not in row, listed.output


def test_unsupported_optimizer_fails_with_one_line(cluster, tmp_path):
    script = tmp_path / "rmsprop.py"
    script.write_text(
        "import torch\nimport gradps\n\ngradps.init()\nmodel = torch.nn.Linear(4, 2)\n"
        "gradps.DistributedOptimizer(torch.optim.RMSprop(model.parameters()), model)\n"
    )
    r = _launch("--coordinator", cluster.address, "--workers", "2", "--no-progress", str(script), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: rank ") and "before the run started" in last, r.stderr
    assert "gradps supports torch.optim.SGD, Adam and AdamW, not torch.optim.RMSprop" in last


def test_a_failing_script_fails_the_launch_with_its_reason(cluster, tmp_path):
    script = tmp_path / "breaks.py"
    script.write_text(
        "import torch\nimport gradps\n\ngradps.init()\nmodel = torch.nn.Linear(4, 2)\n"
        "opt = gradps.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)\n"
        "for step in range(1000):\n"
        "    if gradps.rank() == 1 and step == 5:\n"
        "        raise ValueError('a broken batch')\n"
        "    model(torch.randn(8, 4)).pow(2).mean().backward()\n"
        "    opt.step()\n"
    )
    r = _launch(
        "--coordinator", cluster.address, "--workers", "2", "--steps", "1000", "--scheme", "asgd", "--no-progress",
        "--out", str(tmp_path / "run"), str(script), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: run ") and "ValueError: a broken batch" in last, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["state"] == "failed" and "a broken batch" in summary["message"]


def test_sigterm_stops_the_run_and_every_script(cluster, tmp_path):
    argv = [sys.executable, "-m", "client.cli", "launch", "--coordinator", cluster.address, "--workers", "2"]
    launcher = subprocess.Popen(
        [*argv, "--steps", "1000000", "--no-progress", "--out", str(tmp_path / "run"), str(EXAMPLE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        with Client(cluster.address) as client:
            deadline = time.monotonic() + 120
            while not any(r.state == cpb.RUN_STATE_RUNNING and r.latest for r in client.runs()):
                assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
                time.sleep(0.2)
            (running,) = [r.run_id for r in client.runs() if r.state == cpb.RUN_STATE_RUNNING]
            launcher.send_signal(signal.SIGTERM)
            _, err = launcher.communicate(timeout=60)
            assert launcher.returncode != 0, err
            assert client.run(running).run.state == cpb.RUN_STATE_STOPPED
            # The scripts left the cluster (they are its only workers).
            assert not any(w.alive for w in client.cluster().workers)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_a_sigterm_while_a_script_leaves_does_not_cut_its_leaving_short(cluster, tmp_path):
    # The launcher's stop (SIGTERM) can reach a script that is exiting already (its run ended):
    # it must still leave the cluster then, not stay "alive" there until its heartbeat times out.
    # Its leaving is made slow here, as a busy coordinator makes it, so that the signal lands in it.
    script = tmp_path / "slow_leave.py"
    script.write_text(
        "import os, pathlib, time, torch, gradps\nfrom gradps.worker_session import WorkerSession\n\n"
        "close = WorkerSession.close\n\n"
        "def slow_close(session):\n"
        "    pathlib.Path(f'leaving-{gradps.rank()}').write_text(str(os.getpid()))  # in the launch's folder\n"
        "    time.sleep(1)\n"
        "    close(session)\n\n"
        "WorkerSession.close = slow_close\n"
        "gradps.init()\nmodel = torch.nn.Linear(4, 2)\n"
        "opt = gradps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)\n"
        "for _ in range(3):\n"
        "    model(torch.randn(8, 4)).pow(2).mean().backward()\n"
        "    opt.step()\n"
    )
    launcher = subprocess.Popen(
        [
            *(sys.executable, "-m", "client.cli", "launch", "--coordinator", cluster.address, "--workers", "1"),
            *("--steps", "1000000", "--scheme", "asgd", "--no-progress", "--out", str(tmp_path / "run"), str(script)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        marker = tmp_path / "leaving-0"
        deadline = time.monotonic() + 120
        while not (marker.exists() and marker.read_text()):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)
        os.kill(int(marker.read_text()), signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 1 and "script ended at step 3" in err, err
        with Client(cluster.address) as client:
            assert not any(w.alive for w in client.cluster().workers)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_init_outside_a_launch_is_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPS_")}
    r = subprocess.run(
        [sys.executable, "-c", "import gradps; gradps.init()"], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 1
    assert r.stderr.strip() == (
        "gradps: gradps.init(): not started by gradps launch (GRADPS_LAUNCH_DIR is unset); "
        "run: gradps launch --workers N script.py"
    )


def test_torch_optimizers_translate_to_the_shards_optimizer():
    params = [torch.nn.Parameter(torch.zeros(3))]
    sgd = spec_of(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4))
    assert (sgd.name, sgd.lr, sgd.momentum, sgd.nesterov, sgd.weight_decay) == ("sgd", 0.1, 0.9, True, 1e-4)
    adam = spec_of(torch.optim.Adam(params, lr=1e-3, betas=(0.8, 0.99), eps=1e-6))
    assert (adam.name, adam.lr, adam.beta1, adam.beta2, adam.eps) == ("adam", 1e-3, 0.8, 0.99, 1e-6)
    adamw = spec_of(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05))
    assert (adamw.name, adamw.weight_decay) == ("adamw", 0.05)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: torch.optim.RMSprop(p), "gradps supports torch.optim.SGD, Adam and AdamW, not torch.optim.RMSprop"),
        (lambda p: torch.optim.SGD(p, lr=0.1, dampening=0.5), "SGD(dampening=0.5) is not supported"),
        (lambda p: torch.optim.Adam(p, amsgrad=True), "Adam(amsgrad=True) is not supported"),
        (
            lambda p: torch.optim.SGD([{"params": p[:1]}, {"params": p[1:], "lr": 0.01}], lr=0.1),
            "SGD: every param group must have the same settings",
        ),
    ],
)
def test_what_the_shards_cannot_apply_is_refused(make, message):
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        spec_of(make(params))
