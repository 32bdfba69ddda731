"""secrecy.redact_url / child_environment: what may be printed of a URL, what a child inherits."""

from __future__ import annotations

import pytest

from natsfs.secrecy import child_environment, redact_url, redact_urls


@pytest.mark.parametrize(("url", "shown"), [
    ("nats://u:secretpw@h:4222", "nats://u:***@h:4222"),
    ("nats://token123@h:4222", "nats://***@h:4222"),
    ("tls://u:p@ss/word@h:4222", "tls://u:***@h:4222"),  # unencoded @ and / in the password
    ("u:secretpw@h:4222", "u:***@h:4222"),  # no scheme
    ("nats://h:4222", "nats://h:4222"),
    ("h:4222", "h:4222"),
    ("nats://u:@h", "nats://u:***@h"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redact_urls_joins_every_url_redacted():
    assert redact_urls(["nats://a:x@h1", "nats://h2"]) == "nats://a:***@h1, nats://h2"


def test_child_environment_drops_nats_url():
    assert child_environment({"PATH": "/bin", "NATS_URL": "nats://u:p@h"}) == {"PATH": "/bin"}
