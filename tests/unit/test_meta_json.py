"""adr20.meta_json, the one writer of metas, against metas nats.go wrote (tests/fixtures/adr20)."""

from __future__ import annotations

import base64
import json

import pytest
from helpers import FIXTURES

from natsfs.adr20 import meta_json


def _go_metas() -> list[bytes]:
    out = []
    for name in ("OBJ_interop.json", "OBJ_other.json"):
        for m in json.loads((FIXTURES / name).read_text())["messages"]:
            raw = base64.b64decode(m["data_b64"])
            # Written by nats.go: the README's `go/*` objects and `target.txt`.
            if ".M." in m["subject"] and (raw.startswith(b'{"name":"go/') or raw.startswith(b'{"name":"target.txt"')):
                out.append(raw)
    return out


@pytest.mark.parametrize("raw", _go_metas(), ids=lambda raw: json.loads(raw)["name"])
def test_reproduces_what_nats_go_wrote_byte_for_byte(raw):
    assert meta_json(json.loads(raw)) == raw


def test_go_order_omitted_empties_sorted_maps_and_html_escapes():
    doc = {"digest": "", "chunks": 0, "bucket": "b", "name": "a<&>\u2028é", "metadata": {"z": "1", "a": "2"},
           "description": "", "size": 0, "nuid": "N", "mtime": "0001-01-01T00:00:00Z", "extra": 1}
    assert meta_json(doc) == ('{"name":"a\\u003c\\u0026\\u003e\\u2028é","metadata":{"a":"2","z":"1"},"bucket":"b",'
                              '"nuid":"N","size":0,"mtime":"0001-01-01T00:00:00Z","chunks":0,"extra":1}').encode()
