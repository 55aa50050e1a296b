"""`gradps certs`: a CA of the cluster's own, and the certificates its services and clients present.

The folder it writes (keys 0600):

- `ca.pem`, `ca-key.pem`: the CA (`--tls-ca` everywhere; its key only to make more certificates);
- `service.pem`, `service-key.pem`: the services' certificate, for every name in `--hosts` and for
  loopback (a service's own health probe), good for serving and, under mTLS, as the client of the
  other services;
- `client.pem`, `client-key.pem`: a client's (the CLI, the SDK, workers) for mTLS.

Keys are ECDSA P-256; certificates are valid for `days` days.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gradps.auth.client_tokens import write_private_file

DEFAULT_DAYS = 365
_CA, _SERVICE, _CLIENT = "ca", "service", "client"


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as written."""

    cert: Path
    key: Path


LOOPBACK = ["localhost", "127.0.0.1", "::1"]


def default_hosts() -> list[str]:
    """The names a local cluster's services are reached by: loopback and this host's name."""
    return [*LOOPBACK, socket.gethostname()]


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gradps"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _alt_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little apart
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def _write(folder: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    issued = Issued(folder / f"{name}.pem", folder / f"{name}-key.pem")
    issued.key.unlink(missing_ok=True)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_private_file(issued.key, pem.decode().strip())
    issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return issued


def make_ca(folder: Path, days: int = DEFAULT_DAYS, common_name: str = "gradps CA") -> Issued:
    """A self-signed CA in `folder` (ca.pem, ca-key.pem)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (
        _builder(name, name, key, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(key, hashes.SHA256())
    )
    return _write(folder, _CA, cert, key)


def issue(
    ca: Issued, folder: Path, name: str, hosts: Sequence[str], client_only: bool = False, days: int = DEFAULT_DAYS
) -> Issued:
    """A certificate signed by `ca`, written as `name`.pem and `name`-key.pem: for `hosts` (DNS
    names and IP addresses) serving and as a client, or, `client_only`, as a client only."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    usages = (
        [ExtendedKeyUsageOID.CLIENT_AUTH]
        if client_only
        else [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    builder = (
        _builder(_name(f"gradps {name}"), ca_cert.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(_alt_names(hosts), critical=False)
    return _write(folder, name, builder.sign(ca_key, hashes.SHA256()), key)


def make_certs(folder: Path, hosts: Sequence[str], days: int = DEFAULT_DAYS) -> dict[str, Issued]:
    """A CA, the services' certificate for `hosts` and a client's, in `folder` (created 0700)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca = make_ca(folder, days)
    return {
        _CA: ca,
        _SERVICE: issue(ca, folder, _SERVICE, [*hosts, *LOOPBACK], days=days),
        _CLIENT: issue(ca, folder, _CLIENT, [], client_only=True, days=days),
    }


def _hosts(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    hosts = [h.strip() for each in value for h in each.split(",") if h.strip()]
    return hosts or default_hosts()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Folder to write them in.")
@click.option(
    "--hosts",
    multiple=True,
    callback=_hosts,
    help="Names and addresses the services are reached by (comma-separated or repeated; the service "
    "certificate is valid for these only). Default: localhost, 127.0.0.1, ::1 and this host's name.",
)
@click.option("--days", default=DEFAULT_DAYS, type=click.IntRange(1, 3650), help="Validity.")
@click.option("--force", is_flag=True, help="Replace certificates already in --out (a new CA: every file changes).")
def certs(out: Path, hosts: list[str], days: int, force: bool) -> None:
    """Make a CA and the certificates of the services and of a client (PEM) for TLS and mTLS:
    services take --tls-cert service.pem --tls-key service-key.pem --tls-ca ca.pem
    (--tls-client-auth for mTLS), clients GRADPS_TLS_CA=ca.pem (and GRADPS_TLS_CERT/KEY=client*.pem)."""
    if (out / f"{_CA}.pem").exists() and not force:
        raise click.UsageError(f"{out} holds a CA already (ca.pem); --force to replace it")
    try:
        issued = make_certs(out, hosts, days)
    except OSError as e:
        raise click.ClickException(f"--out {out}: {e.strerror or e}") from None
    for name, files in issued.items():
        click.echo(f"{name:8} {files.cert}  {files.key} (0600)")
    click.echo(f"service certificate valid for: {', '.join(dict.fromkeys([*hosts, *LOOPBACK]))}")
