"""A service's and a client's command-line options for secrets, tokens and import allow-lists."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import click

from gradps.auth.client_tokens import read_token_file
from gradps.auth.tokens import SECRET_ENV, SECRET_FILE_ENV, TOKEN_ENV, TOKEN_FILE_ENV, ClusterSecret


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or "": every interface, for all we know


def secret_options(fn: Callable) -> Callable:
    """A server's `--secret-file` (GRADPS_SECRET_FILE), `--secret` (GRADPS_SECRET) and `--insecure`."""
    fn = click.option(
        "--insecure",
        envvar="GRADPS_INSECURE",
        show_envvar=True,
        is_flag=True,
        help="Serve a non-loopback --bind without a cluster secret: every call from the network accepted.",
    )(fn)
    fn = click.option(
        "--secret",
        envvar=SECRET_ENV,
        show_envvar=True,
        default=None,
        show_default=False,
        help="The cluster secret that every token derives from (set the variable: a flag's value shows in ps).",
    )(fn)
    return click.option(
        "--secret-file",
        envvar=SECRET_FILE_ENV,
        show_envvar=True,
        default=None,
        help="File holding the cluster secret (mode 0600).",
    )(fn)


def server_secret(secret: str | None, secret_file: str | None, bind: str, insecure: bool) -> ClusterSecret | None:
    """The secret a service checks tokens with, from its options; click.UsageError (one line) when
    it cannot be read, or when a non-loopback bind has none and --insecure was not given."""
    try:
        text = secret or (read_token_file(secret_file) if secret_file else None)
        cluster = ClusterSecret(text) if text else None
    except ValueError as e:
        raise click.UsageError(f"cluster secret: {e}") from None
    if cluster is None and not insecure and not is_loopback(bind):
        raise click.UsageError(
            f"refusing to serve on {bind} without a cluster secret (GRADPS_SECRET or --secret-file); "
            "--insecure to accept every call from the network"
        )
    return cluster


def allow_import_option(fn: Callable) -> Callable:
    """`--allow-import PREFIX` (repeatable; GRADPS_ALLOW_IMPORT, space-separated): the import paths
    of models and datasets that runs may name (gradps.datasets.check_import_allowed)."""
    return click.option(
        "--allow-import",
        envvar="GRADPS_ALLOW_IMPORT",
        show_envvar=True,
        multiple=True,
        help="A package or module (or one package.module:function) whose models and datasets runs may "
        "import; repeatable. Default: none, only the built-in models and datasets.",
    )(fn)


def token_options(fn: Callable) -> Callable:
    """A client's `--token-file` (GRADPS_TOKEN_FILE) and `--token` (GRADPS_TOKEN)."""
    fn = click.option(
        "--token",
        envvar=TOKEN_ENV,
        show_envvar=True,
        default=None,
        show_default=False,
        help="Bearer token for the cluster's calls (set the variable: a flag's value shows in ps).",
    )(fn)
    return click.option(
        "--token-file", envvar=TOKEN_FILE_ENV, show_envvar=True, default=None, help="File holding the bearer token."
    )(fn)


def option_token(token: str | None, token_file: str | None) -> str | None:
    """The token `token_options` name (None: none given); click.UsageError when the file cannot be read."""
    if token and token.strip():
        return token.strip()
    if not token_file:
        return None
    try:
        return read_token_file(token_file)
    except ValueError as e:
        raise click.UsageError(f"--token-file: {e}") from None
