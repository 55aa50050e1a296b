"""A fork server for the local cluster's shards and workers.

Each shard and worker used to be a fresh interpreter that spent seconds of CPU importing torch and
its service before it could register. The fork server is one process (`python -m
client.fork_server`) that imports them once; each service is then a fork of it, in a session of
its own, with its own environment, working folder, arguments and log, running its service's
`main` as `python -m` would, and named as that command (`ps`, `pgrep -f` see it so). The server
reports each child's exit status, so the client holds a `ForkedService` it can poll, wait for and
signal as it would a `subprocess.Popen`.

What an interpreter reads once, when it starts (PYTHON*, LD_*, the thread pools' variables), is
the server's: a service whose environment differs in them gets a server of its own. Where a server
cannot start, dies or does not answer, `start_service` starts the service as a process of its own.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import setproctitle

# The services a fork server imports and forks.
FORKED_MODULES = ("ps_server.shard", "gpu_worker.service")
# What the services import at their first run, imported by the server too: torch.optim loads
# torch._dynamo (sympy with it) at an optimizer's first step, 2 s of a run's start.
_FIRST_RUN_MODULES = ("torch._dynamo",)
# Read when the interpreter, torch or a thread pool starts: a server serves one set of them.
_START_UP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA")
# How long a fork may take, the server's imports included (seconds on a loaded machine).
_FORK_TIMEOUT_S = 60.0


class Service(Protocol):
    """A service's process: a `subprocess.Popen` or a `ForkedService`."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def command_line(module: str, args: Sequence[str]) -> list[str]:
    """The command that starts service `module` with `args` as a process of its own."""
    return [sys.executable, "-m", module, *args]


def start_service(
    module: str,
    args: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    within: Callable[[list[str]], list[str]] | None = None,
) -> Service:
    """Start `python -m module args` with `env`, in a session of its own, appending its output to
    `log`: forked from a fork server where `module` is one of `FORKED_MODULES`, else a new process.
    `within` wraps the command line to run it elsewhere (an emulated host's network namespace):
    such a service always starts as a process, which the wrapper execs where it belongs."""
    if module in FORKED_MODULES and within is None:
        log.touch()  # there once it started, as with a process's; an unwritable folder fails here
        for _ in range(2):  # a server found gone is started again, once
            forked = _server_for(env).fork(module, args, env, log)
            if forked is not None:
                return forked
    argv = command_line(module, args)
    with open(log, "ab") as out:
        return subprocess.Popen(
            within(argv) if within else argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )


def warm_up(env: Mapping[str, str]) -> None:
    """Start the fork server for services with `env` now (it takes seconds to import them)."""
    _server_for(env)


def _start_up_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_START_UP_PREFIXES)))


_servers: dict[tuple[tuple[str, str], ...], _ForkServer] = {}
_servers_lock = threading.Lock()


def _server_for(env: Mapping[str, str]) -> _ForkServer:
    key = _start_up_env(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.gone:
            server = _servers[key] = _ForkServer(dict(key))
        return server


class ForkedService:
    """A service forked by a fork server: `subprocess.Popen`'s poll, wait and signals."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self._returncode: int | None = None
        self._exited = threading.Event()

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def _exit(self, code: int) -> None:
        self._returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self._returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self._returncode is not None
        return self._returncode

    def send_signal(self, sig: int) -> None:
        # Its pid stays its own until the fork server reaps it, which it reports first.
        if self._returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ForkServer:
    """The client's end of a fork server: requests go to its stdin, a thread reads its replies."""

    def __init__(self, start_up_env: dict[str, str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_START_UP_PREFIXES)} | start_up_env
        self._lock = threading.Lock()  # one request at a time: replies come in order
        self._started: list[ForkedService] = []
        self._started_ready = threading.Condition()
        self._children: dict[int, ForkedService] = {}
        self._argv: list[str] = []
        self.gone = False
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                # Its own session: a Ctrl-C at the terminal is the client's to handle.
                start_new_session=True,
            )
        except OSError:
            self.gone = True
            return
        threading.Thread(target=self._read, name="fork-server-replies", daemon=True).start()

    def fork(self, module: str, args: Sequence[str], env: Mapping[str, str], log: Path) -> ForkedService | None:
        """A forked `module`, or None when the server is gone (the caller starts a process then)."""
        request = {"module": module, "args": list(args), "env": dict(env), "cwd": os.getcwd(), "log": str(log)}
        with self._lock:
            if self.gone:
                return None
            assert self._process.stdin is not None
            self._argv = command_line(module, args)  # the child's, once its pid comes
            try:
                self._process.stdin.write(json.dumps(request).encode() + b"\n")
                self._process.stdin.flush()
            except OSError:  # it died; the reader sees it soon, this caller now
                self.gone = True
                return None
            with self._started_ready:
                if not self._started_ready.wait_for(lambda: self._started or self.gone, _FORK_TIMEOUT_S):
                    self._process.kill()  # stuck (in an import?): no later request waits on it
                    self.gone = True
                return self._started.pop(0) if self._started else None

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            reply = json.loads(line)
            if "pid" in reply:
                child = ForkedService(reply["pid"], self._argv)
                self._children[child.pid] = child
                with self._started_ready:
                    self._started.append(child)
                    self._started_ready.notify_all()
            elif "exited" in reply:
                exited = self._children.pop(reply["exited"], None)
                if exited is not None:
                    exited._exit(reply["code"])
        # The server died (killed): its children's exit statuses went with it.
        with self._started_ready:
            self.gone = True
            self._started_ready.notify_all()
        for child in list(self._children.values()):
            threading.Thread(target=_await_orphan, args=(child,), daemon=True).start()


def _await_orphan(child: ForkedService) -> None:
    """Note that a child whose fork server died has exited, once it has (its status is lost: 255)."""
    while _alive(child.pid):
        time.sleep(0.2)
    child._exit(255)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


# The server's side: it runs as `python -m client.fork_server`; only its children leave `_serve`.


def _serve() -> dict[str, Any]:
    """Import the services, then fork a child for each request read on stdin, reporting its pid
    and, once it exits, its exit status on stdout; return the request in each child."""
    for module in (*FORKED_MODULES, *_FIRST_RUN_MODULES):
        importlib.import_module(module)
    # What the imports made lives as long as any child: kept out of the collector's reach, a
    # child's collections (the one at its exit too) walk only what it made itself, and leave the
    # server's pages shared. Its exit took a second of collecting.
    gc.freeze()
    default_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _report_exits()
        if 0 not in readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the client is gone; the children go on, as processes it started would
            sys.exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            session_r, session_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.setsid()
                os.close(session_w)  # it leads its session before the client hears of it, as with Popen
                os.close(session_r)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGINT, default_sigint)
                os.close(wake_r)
                os.close(wake_w)
                return request
            os.close(session_w)
            os.read(session_r, 1)  # end of file: the child closed its end
            os.close(session_r)
            _write({"pid": pid})


def _report_exits() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _write(reply: dict[str, Any]) -> None:
    data = json.dumps(reply).encode() + b"\n"
    while data:
        data = data[os.write(1, data) :]


def _run(request: dict[str, Any]) -> None:
    """In a child: become the service `python -m module args` would start, then run it."""
    # Named first: the title takes the space of the server's environment, which is replaced below.
    setproctitle.setproctitle(" ".join(command_line(request["module"], request["args"])))
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` has it: the user's modules import from there
    module = request["module"]
    sys.argv = [module, *request["args"]]
    importlib.import_module(module).main(args=request["args"], prog_name=f"python -m {module}")


if __name__ == "__main__":
    _run(_serve())
