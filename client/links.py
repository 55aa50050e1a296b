"""`--link RATE`: a command's processes on an emulated network (gradps.netem), each on a host of
its own, its references too (the benches' TCP and gloo, compare's DDP ranks), so that what it
measures means what it would between machines.

This process (the driver, which submits the runs) goes onto host 0 for the rest of its life:
gRPC's threads and the sockets they open must be on the network they reach. The hosts' rates can
change between measurements (`use`), with the clusters and their connections kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console

from gradps.netem import EmulatedNetwork, Host, NetemError, enter, parse_links, unavailable


class Links:
    """One emulated network of `hosts` hosts for every `--link` setting of a command."""

    def __init__(self, links: Sequence[str], hosts: int) -> None:
        # Checked before anything starts: a bad --link is a usage error.
        self.settings = [(text, parse_links(text, hosts)) for text in links]
        self.hosts = hosts
        self.network: EmulatedNetwork | None = None

    @staticmethod
    def available(console: Console | None) -> bool:
        """Whether links can be emulated here; where not, one line says why (the bench then runs
        on loopback, unshaped)."""
        reason = unavailable()
        if reason and console:
            console.print(f"{reason}: running on loopback, unshaped", soft_wrap=True)
        return reason is None

    def host(self, k: int) -> Host:
        assert self.network is not None
        return self.network.host(k)

    def use(self, setting: int) -> str:
        """Cap the links as the `setting`-th --link says; its text."""
        assert self.network is not None
        text, rates = self.settings[setting]
        if rates != self.network.rates:
            self.network.set_rates(rates)
        return text

    def __enter__(self) -> Links:
        self.network = EmulatedNetwork(self.settings[0][1]).start()
        try:
            enter(self.network.namespace(0))
        except NetemError:
            self.network.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.network:
            self.network.close()
