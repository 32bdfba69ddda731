"""The Spark pipeline on a natsfs mount gives the same summary, and leaves the same files, as on local disk."""

from __future__ import annotations

from helpers import create_bucket
from pipeline import require_spark, run_pipeline


def test_spark_pipeline_on_the_mount_matches_local_disk(nats_url, bucket_name, mounter, tmp_path):
    require_spark()
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    local = run_pipeline(tmp_path / "local", log=tmp_path / "spark-local.log")
    mounted = run_pipeline(m.path / bucket_name / "run", log=tmp_path / "spark-mount.log")
    assert mounted == local
    # No leftovers of the committer, every job's marker and checksum files are there.
    assert not [f for f in mounted["files"] if "_temporary" in f]
    assert sum(f.endswith("/_SUCCESS") for f in mounted["files"]) == 8
    assert all(f"{f.rsplit('/', 1)[0]}/.{f.rsplit('/', 1)[1]}.crc" in mounted["files"]
               for f in mounted["files"] if not f.rsplit("/", 1)[1].startswith("."))
    log = m.log()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
