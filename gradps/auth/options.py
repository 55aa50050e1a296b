"""A service's and a client's command-line options for secrets, tokens, TLS and import allow-lists."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import click

from gradps.auth.client_tokens import read_token_file
from gradps.auth.tls import (
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_CLIENT_AUTH_ENV,
    TLS_KEY_ENV,
    TlsError,
    TlsFiles,
    set_process_tls,
    tls_files,
)
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
    of models and datasets that runs may name (gradps.import_paths.check_import_allowed)."""
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


def _file_options(fn: Callable, cert_help: str, key_help: str, ca_help: str) -> Callable:
    for name, envvar, text in reversed(
        (
            ("--tls-cert", TLS_CERT_ENV, cert_help),
            ("--tls-key", TLS_KEY_ENV, key_help),
            ("--tls-ca", TLS_CA_ENV, ca_help),
        )
    ):
        fn = click.option(
            name, envvar=envvar, show_envvar=True, default=None, type=click.Path(dir_okay=False), help=text
        )(fn)
    return fn


def tls_options(fn: Callable) -> Callable:
    """A server's `--tls-cert`, `--tls-key`, `--tls-ca` (GRADPS_TLS_*) and `--tls-client-auth`."""
    fn = click.option(
        "--tls-client-auth",
        envvar=TLS_CLIENT_AUTH_ENV,
        show_envvar=True,
        is_flag=True,
        help="mTLS: refuse clients without a certificate that chains to --tls-ca.",
    )(fn)
    return _file_options(
        fn,
        "Serve TLS with this certificate (PEM; read again when the file changes). Unset: plaintext.",
        "The certificate's private key (PEM).",
        "CA certificates (PEM) that the other services' and, with --tls-client-auth, the clients' "
        "certificates chain to.",
    )


def service_tls(cert: str | None, key: str | None, ca: str | None, client_auth: bool) -> TlsFiles | None:
    """The TLS a service serves with, from `tls_options` (None: plaintext); its calls to the other
    services then use it too (its certificate as theirs to check). click.UsageError (one line)
    when the files are incomplete, unreadable or do not fit together."""
    try:
        files = tls_files(cert, key, ca, client_auth)
        if files is not None:
            if files.cert is None:
                raise TlsError("--tls-ca alone: a TLS server needs --tls-cert and --tls-key too")
            files.check()
    except TlsError as e:
        raise click.UsageError(str(e)) from None
    set_process_tls(files)
    return files


def client_tls_options(fn: Callable) -> Callable:
    """A client's `--tls-ca`, `--tls-cert` and `--tls-key` (GRADPS_TLS_*): TLS towards the cluster."""
    return _file_options(
        fn,
        "mTLS: the certificate (PEM) this client presents.",
        "The client certificate's private key (PEM).",
        "Connect with TLS, checking the services' certificates against these CA certificates (PEM).",
    )


def use_client_tls(cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
    """Make the `client_tls_options` this process's channels' TLS (None given: plaintext, unless an
    address has its own); click.UsageError (one line) when they are incomplete or unreadable."""
    try:
        files = tls_files(cert, key, ca)
        if files is not None:
            files.check()
    except TlsError as e:
        raise click.UsageError(str(e)) from None
    if files is not None:
        set_process_tls(files)
    return files
