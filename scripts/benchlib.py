"""Machinery for `scripts/bench`: a private nats-server, raw object publishing, mounts, timing, the table.

Everything here is infrastructure; the benchmarks themselves (and the rows they report) live in
`scripts/bench`. Every resource this module creates (server, mounts, temp dir) is registered with an
`Env`, whose `close()` runs from a `finally` block and from `atexit`, so a crash or Ctrl-C never leaves
a mount or a server behind.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 1 << 20
KiB = 1 << 10
CHUNK = 128 * KiB

_T0 = time.monotonic()


def log(msg: str) -> None:
    """Progress on stderr (stdout carries only the table)."""
    print(f"[bench {time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- table
@dataclass(frozen=True)
class Target:
    """A pass/fail threshold on a row's ratio (default) or value."""

    op: str  # ">=", "<=", "<", ">"
    threshold: float
    on: str = "ratio"
    shown: str = ""  # how to print the threshold, e.g. "356 MiB"

    def check(self, value: float) -> bool:
        return {">=": value >= self.threshold, "<=": value <= self.threshold,
                "<": value < self.threshold, ">": value > self.threshold}[self.op]

    def describe(self) -> str:
        return f"{self.op} {self.shown or fmt_num(self.threshold)}"


@dataclass
class Row:
    measure: str
    value: float | str | None
    unit: str = ""
    ratio: float | None = None
    reference: str = ""
    target: Target | None = None
    status: str = ""  # "", PASS, FAIL, ERROR

    def __post_init__(self) -> None:
        if self.target is not None and not self.status:
            subject = self.ratio if self.target.on == "ratio" else self.value
            if isinstance(subject, int | float) and not (isinstance(subject, float) and math.isnan(subject)):
                self.status = "PASS" if self.target.check(float(subject)) else "FAIL"
            else:
                self.status = "N/A"

    def cells(self) -> list[str]:
        ref = self.reference
        if self.target is not None:
            verdict = f"{self.status} (target {self.target.on} {self.target.describe()})"
            ref = f"{verdict}: {ref}" if ref else verdict
        elif self.status == "ERROR":
            ref = f"ERROR: {ref}"
        value = self.value if isinstance(self.value, str) else fmt_num(self.value)
        ratio = "" if self.ratio is None else fmt_num(self.ratio)
        return [self.measure, value, self.unit, ratio, ref]


def fmt_num(v: float | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "n/a"
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.1:
        return f"{v:.2f}"
    if a == 0:
        return "0"
    return f"{v:.3g}"


class Table:
    HEADERS = ("measure", "value", "unit", "ratio", "reference")

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.section = ""

    def add(self, measure: str, value: float | str | None, unit: str = "", *, ratio: float | None = None,
            reference: str = "", target: Target | None = None) -> Row:
        row = Row(measure, value, unit, ratio, reference, target)
        self.rows.append(row)
        cells = row.cells()
        log(f"ROW {cells[0]} = {cells[1]} {cells[2]}" + (f" (ratio {cells[3]})" if cells[3] else "")
            + (f" [{row.status}]" if row.status else ""))
        return row

    def error(self, what: str, exc: BaseException | str) -> Row:
        msg = exc if isinstance(exc, str) else (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        msg = " ".join(str(msg).split())
        if len(msg) > 160:
            msg = msg[:157] + "..."
        row = Row(what, "ERROR", "", None, msg, None, "ERROR")
        self.rows.append(row)
        log(f"ERROR in {what}: {msg}")
        return row

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Run one measurement; an exception becomes an error row and the bench goes on."""
        log(f"-- {what}")
        try:
            yield
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self.error(what, e)

    def counts(self) -> dict[str, int]:
        out = {"PASS": 0, "FAIL": 0, "ERROR": 0, "N/A": 0}
        for r in self.rows:
            if r.status in out:
                out[r.status] += 1
        return out

    def render(self) -> str:
        cells = [list(self.HEADERS)] + [r.cells() for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(self.HEADERS) - 1)]
        right = {1, 3}

        def line(c: Sequence[str]) -> str:
            parts = [(c[i].rjust(widths[i]) if i in right else c[i].ljust(widths[i])) for i in range(len(widths))]
            return (" | ".join([*parts, c[-1]])).rstrip()

        sep = "-+-".join("-" * w for w in widths) + "-+-" + "-" * max(len(c[-1]) for c in cells)
        return "\n".join([line(cells[0]), sep, *(line(c) for c in cells[1:])])


# ---------------------------------------------------------------------------------------------- stats
def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(1, math.ceil(p / 100 * len(s)))
    return s[k - 1]


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def mib_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds if seconds > 0 else float("nan")


def safe_ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


# ---------------------------------------------------------------------------------------------- objects
@dataclass
class ObjSpec:
    """A test object: random bytes, published raw (nats.go layout), optionally also kept as a local file."""

    name: str
    size: int
    local: bool = False
    chunk: int = CHUNK
    # filled in by publishing
    nuid: str = ""
    chunks: int = 0
    digest: str = ""
    local_path: Path | None = None
    published: bool = False


def encode_name(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


async def _connect(url: str, tls: ssl.SSLContext | None = None) -> Any:
    import nats

    return await nats.connect(url, pending_size=64 * MiB, max_reconnect_attempts=0, connect_timeout=5,
                              **({"tls": tls} if tls is not None else {}))


def run_nats(url: str, fn: Callable[[Any], Any], timeout: float | None = None,
             tls: ssl.SSLContext | None = None) -> Any:
    """Run `await fn(nc)` with a fresh nats-py connection on a fresh asyncio loop."""

    async def main() -> Any:
        nc = await _connect(url, tls)
        try:
            coro = fn(nc)
            return await (asyncio.wait_for(coro, timeout) if timeout else coro)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    return asyncio.run(main())


async def create_bucket(nc: Any, bucket: str) -> None:
    from nats.js.api import ObjectStoreConfig

    js = nc.jetstream()
    await js.create_object_store(bucket, config=ObjectStoreConfig(bucket=bucket))


async def publish_object(nc: Any, bucket: str, spec: ObjSpec, local_dir: Path, window: int = 256,
                         source: Path | None = None) -> None:
    """Publish `spec` as nats.go would (chunks, then meta with rollup), fast: acks pipelined; its bytes
    are random, or those of the file `source`."""
    from nats.nuid import NUID

    js = nc.jetstream(publish_async_max_pending=window)
    spec.nuid = NUID().next().decode()
    subject = f"$O.{bucket}.C.{spec.nuid}"
    sha = hashlib.sha256()
    local = None
    if spec.local:
        spec.local_path = local_dir / spec.name
        local = open(spec.local_path, "wb")  # noqa: SIM115 - closed below
    futures: list[asyncio.Future[Any]] = []
    src = open(source, "rb") if source is not None else None  # noqa: SIM115 - closed below
    try:
        left, n = spec.size, 0
        while left > 0:
            data = src.read(min(spec.chunk, left)) if src is not None else os.urandom(min(spec.chunk, left))
            if not data:
                raise RuntimeError(f"{source} is shorter than {spec.size} bytes")
            sha.update(data)
            if local is not None:
                local.write(data)
            futures.append(await js.publish_async(subject, data, wait_stall=60))
            left -= len(data)
            n += 1
            if len(futures) >= 4 * window:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
    finally:
        if local is not None:
            local.close()
        if src is not None:
            src.close()
    spec.chunks = n
    spec.digest = "SHA-256=" + base64.urlsafe_b64encode(sha.digest()).decode()
    meta = meta_json(bucket, spec.name, spec.nuid, spec.size, n, spec.digest, chunk_size=spec.chunk)
    await js.publish(f"$O.{bucket}.M.{encode_name(spec.name)}", meta, headers={"Nats-Rollup": "sub"}, timeout=30)
    spec.published = True


async def raw_publish(url: str, bucket: str, data: bytes, *, window: int, connections: int = 1,
                      chunk: int = CHUNK) -> float:
    """The server's ingest ceiling as Python can reach it: `data` as 128 KiB chunk messages into the
    bucket's stream (each with its `Nats-Msg-Id`, as a put sends them), plain publishes whose acks come
    back to one reply inbox per connection, at most `window` unacknowledged per connection, the chunks
    split evenly over `connections`. No hashing, no meta. Returns the seconds from the first publish to
    the last ack; the chunks are purged afterwards."""
    from nats.nuid import NUID

    nuid = NUID().next().decode()
    subject = f"$O.{bucket}.C.{nuid}"
    view = memoryview(data)
    pieces = [view[i:i + chunk] for i in range(0, len(data), chunk)]
    conns = [await _connect(url) for _ in range(connections)]

    async def one(nc: Any, first: int) -> None:
        mine = range(first, len(pieces), connections)
        acked = 0
        errors: list[bytes] = []
        wake = asyncio.Event()

        async def on_ack(msg: Any) -> None:
            nonlocal acked
            acked += 1
            if b'"error"' in msg.data[:16] or not msg.data:
                errors.append(bytes(msg.data[:200]))
            wake.set()

        inbox = nc.new_inbox()
        await nc.subscribe(inbox + ".*", cb=on_ack)
        await nc.flush()
        for sent, i in enumerate(mine):
            while sent - acked >= window:
                wake.clear()
                await wake.wait()
            await nc.publish(subject, bytes(pieces[i]), reply=f"{inbox}.{i}", headers={"Nats-Msg-Id": f"{nuid}.{i}"})
        while acked < len(mine):
            wake.clear()
            await wake.wait()
        if errors:
            raise RuntimeError(f"raw publish: {len(errors)} refused, e.g. {errors[0]!r}")

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(nc, i) for i, nc in enumerate(conns)))
        secs = time.perf_counter() - t0
        await conns[0].request(f"$JS.API.STREAM.PURGE.OBJ_{bucket}", json.dumps({"filter": subject}).encode(),
                               timeout=30)
        return secs
    finally:
        for nc in conns:
            with contextlib.suppress(Exception):
                await nc.close()


async def raw_direct_get(nc: Any, bucket: str, nuid: str, *, batch: int = 64, chunk: int = CHUNK,
                         timeout: float = 30.0) -> tuple[int, int, int, float]:
    """Read every chunk of `nuid` with batched direct gets to one reply inbox.

    Returns (bytes, chunks, requests, seconds). The clock starts at the first request (the
    subscription is set up before).
    """
    loop = asyncio.get_running_loop()
    state: dict[str, Any] = {"fut": None, "bytes": 0, "n": 0, "last": 0}

    async def on_msg(msg: Any) -> None:
        h = msg.headers or {}
        status = h.get("Status")
        fut = state["fut"]
        if status is not None and not msg.data:
            if fut is not None and not fut.done():
                if status in ("204", "404"):
                    fut.set_result(status)
                else:
                    fut.set_exception(RuntimeError(f"direct get: status {status} {h.get('Description', '')}"))
            return
        state["bytes"] += len(msg.data)
        state["n"] += 1
        state["last"] = int(h["Nats-Sequence"])

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg, pending_bytes_limit=1 << 30, pending_msgs_limit=1 << 20)
    await nc.flush()
    api = f"$JS.API.DIRECT.GET.OBJ_{bucket}"
    subject = f"$O.{bucket}.C.{nuid}"
    seq, requests = 1, 0
    t0 = time.perf_counter()
    try:
        while True:
            before = state["n"]
            state["fut"] = loop.create_future()
            body = {"seq": seq, "next_by_subj": subject, "batch": batch, "max_bytes": batch * (chunk + 1024)}
            await nc.publish(api, json.dumps(body).encode(), reply=inbox)
            requests += 1
            status = await asyncio.wait_for(state["fut"], timeout)
            if state["n"] == before or status == "404":
                break
            seq = state["last"] + 1
    finally:
        elapsed = time.perf_counter() - t0
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return state["bytes"], state["n"], requests, elapsed


async def raw_single_gets(nc: Any, bucket: str, nuid: str, chunk_indexes: Sequence[int],
                          timeout: float = 30.0) -> list[float]:
    """One direct get per chunk index, one at a time (what a random read costs any client): the
    latency of each in ms. The chunks' sequences are taken as consecutive from the first one (as
    `publish_object` lays them out); each reply's subject is checked."""
    api = f"$JS.API.DIRECT.GET.OBJ_{bucket}"
    subject = f"$O.{bucket}.C.{nuid}"
    first = await nc.request(api, json.dumps({"seq": 1, "next_by_subj": subject}).encode(), timeout=timeout)
    base = int(first.headers["Nats-Sequence"])
    lat = []
    for index in chunk_indexes:
        t0 = time.perf_counter()
        msg = await nc.request(api, json.dumps({"seq": base + index}).encode(), timeout=timeout)
        lat.append((time.perf_counter() - t0) * 1000)
        if (msg.headers or {}).get("Nats-Subject") != subject:
            raise RuntimeError(f"chunk {index} is not at sequence {base + index}")
    return lat


# ---------------------------------------------------------------------------------------------- other clients
class Publisher:
    """Another client that stays connected: a nats-py connection on its own asyncio thread, so changes
    can be timed from this (synchronous) process without paying a connect per change."""

    def __init__(self, url: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="publisher", daemon=True)
        self.thread.start()
        self.nc = self.call(_connect(url))
        self.js = self.nc.jetstream(publish_async_max_pending=4096)

    def call(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call(self.nc.close(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def meta_json(bucket: str, name: str, nuid: str, size: int, chunks: int, digest: str, deleted: bool = False,
              chunk_size: int | None = None) -> bytes:
    """A meta as nats.go writes it (natsfs's one meta writer, `natsfs.adr20.meta_json`)."""
    from natsfs.adr20 import meta_doc
    from natsfs.adr20 import meta_json as go_meta_json

    return go_meta_json(meta_doc(name=name, bucket=bucket, nuid=nuid, size=size, chunks=chunks, digest=digest,
                                 chunk_size=chunk_size, deleted=deleted))


def _digest(data: bytes) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


async def put_chunks(js: Any, bucket: str, nuid: str, data: bytes) -> int:
    """The chunks of a small object (one per 128 KiB); the number of chunks."""
    n = 0
    for i in range(0, len(data), CHUNK):
        await js.publish(f"$O.{bucket}.C.{nuid}", data[i : i + CHUNK])
        n += 1
    return n


async def put_meta(js: Any, bucket: str, name: str, nuid: str, data: bytes, chunks: int) -> None:
    """The meta that makes a put visible (after its chunks), with `Nats-Rollup: sub`; waits for the ack."""
    await js.publish(f"$O.{bucket}.M.{encode_name(name)}",
                     meta_json(bucket, name, nuid, len(data), chunks, _digest(data)), headers={"Nats-Rollup": "sub"})


async def delete_meta(js: Any, bucket: str, name: str, nuid: str) -> None:
    """nats.go's Delete, first step: the tombstone (visible at once); the chunks are purged after."""
    await js.publish(f"$O.{bucket}.M.{encode_name(name)}", meta_json(bucket, name, nuid, 0, 0, "", deleted=True),
                     headers={"Nats-Rollup": "sub"})


async def purge_chunks(js: Any, bucket: str, nuid: str) -> None:
    await js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{nuid}")


async def populate_metas(nc: Any, bucket: str, names: Sequence[str], window: int = 8192) -> float:
    """Publish metas under `names` as nats.go would for small objects (fresh nuid, a size of 1-4 KiB in
    one chunk, a distinct digest, `options.max_chunk_size`), acks pipelined; the seconds it took.

    Only the metas are published (no chunk data): enough for listings, which is what they are for."""
    from nats.nuid import NUID

    js = nc.jetstream(publish_async_max_pending=window)
    nuid = NUID()
    t0 = time.perf_counter()
    futures: list[Any] = []
    for i, name in enumerate(names):
        digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(name.encode()).digest()).decode()
        meta = meta_json(bucket, name, nuid.next().decode(), 1024 + i % 3072, 1, digest, chunk_size=CHUNK)
        futures.append(await js.publish_async(f"$O.{bucket}.M.{encode_name(name)}", meta,
                                              headers={"Nats-Rollup": "sub"}, wait_stall=60))
        if len(futures) >= window:
            await asyncio.gather(*futures)
            futures.clear()
    await asyncio.gather(*futures)
    return time.perf_counter() - t0


def wait_until(pred: Callable[[], bool], timeout: float, poll: float = 0.0005) -> float | None:
    """Seconds until `pred()` holds (polled every `poll` s), or None after `timeout`."""
    t0 = time.perf_counter()
    while True:
        if pred():
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            return None
        time.sleep(poll)


# ---------------------------------------------------------------------------------------------- processes
def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in KiB; (0, 0) if it is gone."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


class RssSampler:
    """Peak VmRSS of a process, sampled every `interval` seconds in a thread while the block runs."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.pid = pid
        self.interval = interval
        self.peak_kib = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            rss, _ = rss_kib(self.pid)
            self.peak_kib = max(self.peak_kib, rss)
            self.samples += 1
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        rss, _ = rss_kib(self.pid)
        self.peak_kib = max(self.peak_kib, rss)


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU time of each thread of `pid` so far, by thread id."""
    out: dict[int, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            out[int(tid)] = cpu_seconds(int(tid), f"/proc/{pid}/task/{tid}/stat")
    return out


def cpu_seconds(pid: int, stat_path: str = "") -> float:
    """User + system CPU time of `pid` so far (0 if it is gone)."""
    try:
        with open(stat_path or f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_idle(pids: Sequence[int], busy_below: float = 0.05, window: float = 0.25, limit: float = 15.0) -> float:
    """Seconds waited until each of `pids` used less than `busy_below` of a core over `window` s (at
    most `limit` s): a timed write starts on a quiet server, not while it still removes the chunks of
    the write deleted before it (a purge's work goes on after its reply)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        before = [cpu_seconds(p) for p in pids]
        time.sleep(window)
        if all(cpu_seconds(p) - b < busy_below * window for p, b in zip(pids, before, strict=True)):
            break
    return time.perf_counter() - t0


class CpuMeter:
    """CPU use of some processes over a block, in % of one core: named pids, plus "self" and "children"
    (this process, and the children it reaped during the block, e.g. `cat`)."""

    def __init__(self, pids: dict[str, int], threads_of: int | None = None):
        self.pids = pids
        self.threads_of = threads_of
        self.used: dict[str, float] = {}
        self.threads: list[tuple[int, float]] = []  # (tid, CPU s), busiest first; tid == pid is the main thread
        self.wall = 0.0

    @staticmethod
    def _own() -> tuple[float, float]:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    def __enter__(self) -> CpuMeter:
        self._start = {k: cpu_seconds(p) for k, p in self.pids.items()}
        self._own_start = self._own()
        self._threads_start = thread_cpu_seconds(self.threads_of) if self.threads_of else {}
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        self.used = {k: cpu_seconds(p) - self._start[k] for k, p in self.pids.items()}
        own = self._own()
        self.used["self"] = own[0] - self._own_start[0]
        self.used["children"] = own[1] - self._own_start[1]
        if self.threads_of:
            end = thread_cpu_seconds(self.threads_of)
            self.threads = sorted(((tid, end[tid] - self._threads_start.get(tid, 0.0)) for tid in end),
                                  key=lambda x: -x[1])

    def describe_threads(self) -> str:
        """e.g. "main thread 60%, others 35% (busiest 30%), 4 threads"."""
        if not self.threads or self.wall <= 0:
            return ""
        main = sum(c for tid, c in self.threads if tid == self.threads_of)
        others = [c for tid, c in self.threads if tid != self.threads_of]
        pct = 100 / self.wall
        busiest = f" (busiest {max(others) * pct:.0f}%)" if others else ""
        return (f"main thread {main * pct:.0f}%, other threads {sum(others) * pct:.0f}%{busiest}, "
                f"{len(self.threads)} threads")

    def pct(self, name: str) -> float:
        return 100 * self.used.get(name, 0.0) / self.wall if self.wall > 0 else float("nan")

    def describe(self, *names: str) -> str:
        return ", ".join(f"{n} {self.pct(n):.0f}%" for n in names)


def timed_cmd(cmd: Sequence[str], timeout: float) -> float:
    """Run `cmd` with stdout to /dev/null; its wall time in seconds. Raises on failure or timeout."""
    t0 = time.perf_counter()
    proc = subprocess.run(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=timeout)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {err[-1] if err else ''}")
    return elapsed


_FRESH_MEMORY_PROBE = """
import json, mmap, sys, time
size, parts, block = int(sys.argv[1]), int(sys.argv[2]), bytes(1 << 20)
def write_once():
    m = mmap.mmap(-1, size)
    times, t0 = [], time.perf_counter()
    for off in range(0, size, len(block)):
        m[off:off + len(block)] = block
        if (off + len(block)) % (size // parts) == 0:
            times.append(time.perf_counter() - t0)
    m.close()
    return [b - a for a, b in zip([0.0, *times], times)]
print(json.dumps([write_once(), write_once()]))
"""


def fresh_memory_rates(nbytes: int, parts: int) -> tuple[list[float], float]:
    """MiB/s of a first write to `nbytes` of memory the kernel had free, for each of `parts` equal
    parts in order, then of a write to memory freed just before (the first mapping's pages, given back
    and handed out again), in a child process: the first figures pay whatever the machine charges for
    memory it took back (a VM's host backing a page again), the last does not."""
    out = subprocess.run([sys.executable, "-I", "-c", _FRESH_MEMORY_PROBE, str(nbytes), str(parts)],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    first, again = json.loads(out)
    return [mib_per_s(nbytes // parts, secs) for secs in first], mib_per_s(nbytes, sum(again))


def free_page_reporting() -> str:
    """Whether the kernel reports free memory to a hypervisor that takes it back (virtio-balloon free
    page reporting), as a phrase; "" where it does not."""
    params = Path("/sys/module/page_reporting/parameters")
    try:
        order = int((params / "page_reporting_order").read_text())
        reported = int((params / "reported_kib").read_text())
    except (OSError, ValueError):
        return ""
    if reported <= 0:
        return ""
    return (f"free page reporting on: free blocks of {4 << order >> 10} MiB go back to the host "
            f"({reported / (1 << 20):.0f} GiB so far)")


def drop_page_cache() -> bool:
    """Drop the kernel's clean page cache (root only); False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


class Mount:
    """`python -m natsfs mount MNT --foreground` in a child process."""

    def __init__(self, env: Env, label: str, args: Sequence[str], server: str | None = None):
        env.mount_count += 1
        self.env = env
        self.label = label
        self.path = env.tmp / "mnt"
        self.path.mkdir(exist_ok=True)
        tag = f"{env.mount_count:02d}-{label}"
        self.log_file = env.tmp / "logs" / f"mount-{tag}.log"
        self.cache_dir = env.tmp / "cache" / tag
        self.args = list(args)
        self.server = server or env.url
        self.proc: subprocess.Popen[bytes] | None = None
        self.live = False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> None:
        if os.path.ismount(self.path):
            raise RuntimeError(f"{self.path} is still a mount point")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "natsfs", "mount", str(self.path), "--foreground",
               "--server", self.server, "--cache-dir", str(self.cache_dir), "--log-file", str(self.log_file),
               "--log-level", self.env.log_level, *self.args]
        out = open(self.env.tmp / "logs" / f"{self.log_file.stem}.out", "wb")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=str(self.env.tmp))
        finally:
            out.close()
        self.env.mounts.append(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mount exited with {self.proc.returncode} before mounting: {self.tail()}")
            if os.path.ismount(self.path):
                self.live = True
                return
            time.sleep(0.02)
        raise RuntimeError(f"mount not live after {timeout:g}s: {self.tail()}")

    def tail(self) -> str:
        texts = []
        for p in (self.log_file, self.log_file.with_suffix(".out")):
            with contextlib.suppress(OSError):
                lines = p.read_text(errors="replace").strip().splitlines()
                if lines:
                    texts.append(lines[-1])
        return " / ".join(texts) or f"see {self.log_file}"

    def kill(self) -> None:
        """SIGKILL the daemon: blocked syscalls on the mount then fail with ENOTCONN."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def stop(self) -> None:
        """Unmount (lazily if it is busy) and reap the daemon. Idempotent."""
        if self.live and not os.path.ismount(self.path) and self.proc is not None and self.proc.poll() in (None, 0):
            # Not by us, and not a crash: another process unmounted it (e.g. a test suite's cleanup).
            self.env.vanished += 1
            log(f"mount {self.label} was unmounted by someone else while in use")
        if os.path.ismount(self.path):
            r = subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True, timeout=30)
            if r.returncode != 0:
                log(f"fusermount3 -u failed ({r.stderr.decode(errors='replace').strip()}); lazy unmount")
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True, timeout=30)
        if self.proc is not None:
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                log(f"mount daemon {self.proc.pid} did not exit; killing it")
                self.proc.kill()
                self.proc.wait()
                if os.path.ismount(self.path):
                    subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True, timeout=30)
            self.proc = None
        self.live = False
        if self in self.env.mounts:
            self.env.mounts.remove(self)

    def stats(self) -> dict[str, Any]:
        """The daemon's counters (root xattr user.natsfs.stats)."""
        try:
            return json.loads(os.getxattr(str(self.path), "user.natsfs.stats"))
        except OSError as e:
            alive = self.proc is not None and self.proc.poll() is None
            mounted = os.path.ismount(self.path)
            why = "" if mounted or not alive else "; unmounted from outside while the daemon runs"
            raise OSError(e.errno, f"{e.strerror} (stats xattr of {self.path}; mounted: {mounted}, "
                                   f"daemon alive: {alive}{why})") from e


# ---------------------------------------------------------------------------------------------- environment
@dataclass
class TlsServer:
    """A nats-server that requires TLS (`Env.tls_server`)."""

    url: str  # tls://127.0.0.1:PORT
    ca: Path  # the CA that signed its certificate (`--tls-ca`)
    context: ssl.SSLContext  # for nats-py clients
    pid: int


class Env:
    """A temp dir, a fresh nats-server, buckets/objects, and mounts; `close()` undoes all of it."""

    def __init__(self, tmp_parent: str | None = None, keep: bool = False, log_level: str = "info"):
        self.tmp = Path(tempfile.mkdtemp(prefix="natsfs-bench-", dir=tmp_parent))
        (self.tmp / "logs").mkdir()
        (self.tmp / "local").mkdir()
        self.keep = keep
        self.log_level = log_level
        self.server: Any = None
        self.url = ""
        self.server_version = ""
        self.mounts: list[Mount] = []
        self.mount_count = 0
        self.vanished = 0  # mounts unmounted from outside while we used them
        self.objects: dict[str, ObjSpec] = {}
        self.buckets: set[str] = set()
        self.results: dict[str, float] = {}
        self.failed = False
        self._closed = False
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_exit)

    @property
    def server_pid(self) -> int:
        return self.server.proc.pid if self.server is not None and self.server.proc is not None else -1

    # ---- server
    def start_server(self) -> None:
        from natsfs.server import NatsServer, find_nats_server

        self.server = NatsServer(self.tmp / "server", log_file=self.tmp / "logs" / "nats-server.log")
        self.url = self.server.start()
        with contextlib.suppress(Exception):
            out = subprocess.run([find_nats_server(), "--version"], capture_output=True, text=True, timeout=10)
            self.server_version = out.stdout.strip().split()[-1]
        log(f"nats-server {self.server_version} at {self.url} (store {self.tmp / 'server'})")

    @contextlib.contextmanager
    def tls_server(self) -> Iterator[TlsServer]:
        """A second nats-server, with a store of its own, that requires TLS (a certificate for 127.0.0.1
        from a CA made here with `trustme`), for the duration of the block."""
        import trustme

        from natsfs.server import NatsServer

        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        d = self.tmp / "tls"
        d.mkdir(exist_ok=True)
        paths = {name: d / name for name in ("ca.pem", "server.pem", "server.key")}
        paths["ca.pem"].write_bytes(ca.cert_pem.bytes())
        paths["server.pem"].write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
        paths["server.key"].write_bytes(cert.private_key_pem.bytes())
        config = f'tls {{ cert_file: "{paths["server.pem"]}", key_file: "{paths["server.key"]}" }}\n'
        server = NatsServer(self.tmp / "tls-server", config=config, log_file=self.tmp / "logs" / "nats-server-tls.log")
        url = server.start()
        try:
            context = ssl.create_default_context(cafile=str(paths["ca.pem"]))
            yield TlsServer(url=url.replace("nats://", "tls://", 1), ca=paths["ca.pem"], context=context,
                            pid=server.proc.pid if server.proc is not None else -1)
        finally:
            server.stop()

    def ensure_objects(self, bucket: str, specs: Sequence[ObjSpec]) -> None:
        """Create the bucket and publish whichever of `specs` are not published yet."""
        todo = [s for s in specs if not s.published]
        if not todo and bucket in self.buckets:
            return

        async def fn(nc: Any) -> None:
            if bucket not in self.buckets:
                await create_bucket(nc, bucket)
                self.buckets.add(bucket)
            for s in todo:
                t0 = time.perf_counter()
                await publish_object(nc, bucket, s, self.tmp / "local")
                dt = time.perf_counter() - t0
                log(f"published {bucket}/{s.name}: {s.size / MiB:.1f} MiB in {s.chunks} chunks, "
                    f"{dt:.1f}s ({mib_per_s(s.size, dt):.0f} MiB/s incl. generating random bytes)")
                self.objects[s.name] = s

        run_nats(self.url, fn)

    # ---- mounts
    @contextlib.contextmanager
    def mounted(self, label: str, args: Sequence[str] = (), server: str | None = None) -> Iterator[Mount]:
        """A fresh mount (empty chunk cache, empty page cache) for the duration of the block; of the
        bench's server unless `server` names another."""
        m = Mount(self, label, args, server)
        try:
            t0 = time.perf_counter()
            m.start()
            log(f"mounted ({label}) in {time.perf_counter() - t0:.2f}s, daemon pid {m.pid}")
            yield m
        finally:
            m.stop()

    @contextlib.contextmanager
    def watchdog(self, mount: Mount, seconds: float, what: str) -> Iterator[None]:
        """Kill the daemon if the block takes longer than `seconds` (unblocks reads stuck on the mount)."""
        fired = threading.Event()

        def fire() -> None:
            fired.set()
            log(f"watchdog: {what} exceeded {seconds:g}s, killing mount daemon {mount.pid}")
            mount.kill()

        timer = threading.Timer(seconds, fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        except Exception as e:
            if fired.is_set():
                raise TimeoutError(f"{what} exceeded {seconds:g}s (mount daemon killed)") from e
            raise
        finally:
            timer.cancel()
        if fired.is_set():
            raise TimeoutError(f"{what} exceeded {seconds:g}s (mount daemon killed)")

    # ---- teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for m in list(reversed(self.mounts)):
            try:
                m.stop()
            except Exception as e:
                log(f"could not stop mount {m.label}: {e}")
        if self.server is not None:
            try:
                self.server.stop()
            except Exception as e:
                log(f"could not stop nats-server: {e}")
            self.server = None
        mnt = self.tmp / "mnt"
        if os.path.ismount(mnt):
            log(f"{mnt} is still mounted: leaving {self.tmp} in place")
            return
        if self.keep:
            log(f"kept {self.tmp} (--keep)")
            return
        if self.failed:
            # Keep the logs for a post-mortem, drop the bulky data.
            for sub in ("server/jetstream", "tls-server/jetstream", "local", "cache"):
                shutil.rmtree(self.tmp / sub, ignore_errors=True)
            log(f"logs kept in {self.tmp / 'logs'}")
            return
        shutil.rmtree(self.tmp, ignore_errors=True)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
