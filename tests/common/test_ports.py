"""Which hosts listen on every address, and where this machine reaches such a listener."""

from __future__ import annotations

import pytest

from meshnet_gguf.common.ports import is_wildcard, wildcard_loopback


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0", "::ffff:0.0.0.0", "0:0:0:0:0:ffff:0:0"])
def test_every_spelling_of_the_wildcard_is_one(host: str) -> None:
    assert is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "192.168.1.9", "::ffff:127.0.0.1", "node.lan", "localhost"])
def test_an_address_or_a_name_is_no_wildcard(host: str) -> None:
    assert not is_wildcard(host) and wildcard_loopback(host) is None


def test_a_wildcard_is_reached_on_the_loopback_of_its_family() -> None:
    assert wildcard_loopback("0.0.0.0") == wildcard_loopback("::ffff:0.0.0.0") == wildcard_loopback("") == "127.0.0.1"
    assert wildcard_loopback("::") == "::1"
