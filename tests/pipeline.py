"""Running scripts/spark_pipeline.py from tests: whether Spark can run here, and one run's JSON summary."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PIPELINE = Path(__file__).resolve().parent.parent / "scripts" / "spark_pipeline.py"
# Small enough for CI on 2 cores (the JVM's start dominates); big enough for 2 files per month partition.
TEST_ROWS = 20_000


def require_spark() -> None:
    """Skip when pyspark or java is missing, but fail under `scripts/test` (or CI), which installs both."""
    missing = [what for what, ok in (("pyspark", importlib.util.find_spec("pyspark") is not None),
                                     ("java", bool(shutil.which("java") or os.environ.get("JAVA_HOME"))))
               if not ok]
    if missing:
        if os.environ.get("NATSFS_REQUIRE_SPARK") or os.environ.get("CI"):
            pytest.fail(f"CI must run the Spark tests, but {', '.join(missing)} is missing (run scripts/setup)")
        pytest.skip(f"{', '.join(missing)} not installed (scripts/setup installs both)")


def run_pipeline(root: Path, *, rows: int = TEST_ROWS, read_root: Path | None = None, log: Path,
                 timeout: float = 240) -> dict[str, Any]:
    """Run the pipeline (local[2]) in a child process; its stderr goes to `log`; returns the summary."""
    cmd = [sys.executable, "-I", str(PIPELINE), "--root", str(root), "--rows", str(rows)]
    if read_root is not None:
        cmd += ["--read-root", str(read_root)]
    with open(log, "ab") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                              timeout=timeout, cwd=log.parent)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise AssertionError(f"pipeline on {root} exited with {proc.returncode}:\n{tail}")
    return json.loads(proc.stdout)


_local: dict[int, dict[str, Any]] = {}


def local_summary(base: Path, rows: int = TEST_ROWS) -> dict[str, Any]:
    """The pipeline's summary on local disk (under `base`), computed once per test session."""
    if rows not in _local:
        root = base / f"spark-local-{rows}"
        _local[rows] = run_pipeline(root / "run", rows=rows, log=Path(f"{root}.log"))
    return _local[rows]
