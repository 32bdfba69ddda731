"""A one-chunk put sends its chunk and its meta in one round trip, the meta expecting the chunk as the
stream's last message (`Nats-Expected-Last-Msg-Id`), against a real nats-server: the object reads back
byte-exact with nats-py, a message of another client landing between the two is survived (the server
refuses the meta, which follows plainly), and a chunk the server refuses never leaves a meta behind."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import create_bucket, nats_py_get, stored_layout, with_nats, with_store

from natsfs.errors import TooBig
from natsfs.streams import EXPECTED_LAST_MSG_ID


async def _put_small(store: Any, tmp_path: Path, bucket: str, name: str, data: bytes) -> Any:
    path = tmp_path / f"spool-{name}"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return await store.put_file(bucket, name, str(path), fd, len(data), expected_revision=0)
    finally:
        os.close(fd)


def _stream_msgs(url: str, bucket: str) -> list[tuple[str, dict[str, str]]]:
    async def fn(nc: Any, js: Any) -> list[tuple[str, dict[str, str]]]:
        out = []
        last = (await js.stream_info(f"OBJ_{bucket}")).state.last_seq
        for seq in range(1, last + 1):
            try:
                m = await js.get_msg(f"OBJ_{bucket}", seq=seq)
            except Exception:
                continue
            out.append((m.subject, dict(m.headers or {})))
        return out

    return with_nats(url, fn)


def test_the_chunk_and_its_meta_in_one_round_trip_read_back_by_another_client(nats_url, bucket_name, tmp_path):
    create_bucket(nats_url, bucket_name)
    data = os.urandom(3000)

    async def put(store: Any) -> Any:
        info = await _put_small(store, tmp_path, bucket_name, "f.txt", data)
        return info, dict(store.streams.calls)

    info, calls = with_store(nats_url, put)
    assert calls.get("publish_each") == 1 and not calls.get("publish") and not calls.get("publish_many")
    assert nats_py_get(nats_url, bucket_name, "f.txt") == data
    layout = stored_layout(nats_url, bucket_name, "f.txt")
    assert (layout["stored_chunks"], layout["stored_size"], layout["stored_digest_ok"]) == (1, 3000, True)
    msgs = _stream_msgs(nats_url, bucket_name)
    assert [s.split(".")[2] for s, _ in msgs] == ["C", "M"]
    assert msgs[1][1].get(EXPECTED_LAST_MSG_ID) == f"{info.nuid}.0"


def test_another_clients_message_in_between_makes_the_meta_follow_plainly(nats_url, bucket_name, tmp_path):
    create_bucket(nats_url, bucket_name)

    async def put(store: Any) -> Any:
        streams = store.streams
        real = streams.publish_each

        async def someone_in_between(msgs: Any) -> Any:
            (chunk_outcome,) = await real(msgs[:1])
            await streams.publish(f"$O.{bucket_name}.C.other-writer", b"theirs", {"Nats-Msg-Id": "other.0"})
            (meta_outcome,) = await real(msgs[1:])
            return [chunk_outcome, meta_outcome]

        streams.publish_each = someone_in_between
        return await _put_small(store, tmp_path, bucket_name, "f.txt", b"mine"), dict(streams.calls)

    info, calls = with_store(nats_url, put)
    assert calls.get("publish") == 2  # the other writer's message, and our meta once it was refused
    assert nats_py_get(nats_url, bucket_name, "f.txt") == b"mine"
    subjects = [s for s, _ in _stream_msgs(nats_url, bucket_name)]
    # The meta the server refused is not stored; the one sent after it is, once.
    assert subjects == [f"$O.{bucket_name}.C.{info.nuid}", f"$O.{bucket_name}.C.other-writer",
                        subjects[-1]] and ".M." in subjects[-1]


def test_a_chunk_the_server_refuses_leaves_no_meta(nats_url, bucket_name, tmp_path):
    create_bucket(nats_url, bucket_name)

    async def put(store: Any) -> None:
        await _limit_message_size(store, bucket_name, 1024)
        with pytest.raises(TooBig):
            await _put_small(store, tmp_path, bucket_name, "f.txt", os.urandom(2000))  # the meta alone would fit

    with_store(nats_url, put)
    assert _stream_msgs(nats_url, bucket_name) == []


async def _limit_message_size(store: Any, bucket: str, limit: int) -> None:
    reply = await store.streams.bridge.request(f"$JS.API.STREAM.INFO.OBJ_{bucket}", b"")
    config = json.loads(reply.data)["config"]
    config["max_msg_size"] = limit
    await store.streams.update_stream(config)
