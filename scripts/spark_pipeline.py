#!/usr/bin/env python3
"""A real PySpark pipeline over a directory, printing one deterministic JSON summary on stdout.

    scripts/spark_pipeline.py --root DIR [--master local[2]] [--rows N] [--read-root DIR2]

It generates a deterministic dataset under DIR/input (orders as Parquet partitioned by month,
customers as CSV), reads it back, runs a job (filter, join, group-by aggregates, window functions)
and writes the results under DIR/output with Spark's standard rename-based committer
(FileOutputCommitter, algorithm v1 by default): Parquet written twice in overwrite mode, JSON, CSV in
append mode, a partitioned Parquet with a dynamic partition overwrite, Parquet through committer v2,
and a managed table (`saveAsTable`) under DIR/warehouse. Then it reads every result back and prints
the summary. `--read-root DIR2` reads the results back from DIR2 instead (the same directory seen
through another path, e.g. a second mount of the same bucket).

What makes two runs comparable (the summary is bit-identical across runs and across filesystems):
- numbers are exact: counts as integers, money as decimals printed as strings, never floats;
- every result is also reduced to a SHA-256 of its rows, sorted, so row order never matters;
- the input dataset, which has too many rows to collect, is reduced to an order-free checksum:
  the sum of `xxhash64` of every row as an exact decimal;
- `files` lists every file left under DIR (relative path, sorted), with the random job UUIDs Spark
  puts in data-file names replaced by `UUID`. This catches leftovers (`_temporary`, old output an
  overwrite should have deleted) and missing `_SUCCESS` or `.crc` files. Sizes are not listed:
  Parquet and JSON bytes depend on the order rows reached a task after a shuffle, which is not fixed.

Spark's own logs go to stderr: the process's stdout is pointed at stderr before the JVM starts, and
the summary is written to the original stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
REGIONS = ("north", "south", "east", "west", "central")
STATUSES = ("paid", "paid", "paid", "shipped", "shipped", "cancelled", "returned")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, type=Path, help="directory to write the dataset and results in")
    p.add_argument("--read-root", type=Path, help="read the results back from here (default: --root)")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--rows", type=int, default=100_000, help="orders to generate (default 100000)")
    return p.parse_args(argv)


def stdout_to_stderr() -> Any:
    """Point fd 1 at stderr (the JVM inherits it) and return a file on the original stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(saved, "w")


def start_spark(master: str, root: Path) -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(master).appName("natsfs-pipeline")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.sql.shuffle.partitions", "4")
             .config("spark.sql.adaptive.enabled", "false")
             .config("spark.sql.warehouse.dir", str(root / "warehouse"))
             .config("spark.driver.extraJavaOptions", "-XX:+UseSerialGC -XX:TieredStopAtLevel=1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    return spark


def generate(spark: Any, root: Path, rows: int) -> None:
    """Orders (Parquet, partitioned by month) and customers (CSV), from arithmetic on row ids only."""
    from pyspark.sql import functions as F

    customers = max(rows // 40, 10)
    regions = F.array(*[F.lit(r) for r in REGIONS])
    statuses = F.array(*[F.lit(s) for s in STATUSES])
    orders = (spark.range(rows, numPartitions=2)
              .select(F.col("id").alias("order_id"),
                      ((F.col("id") * 7919) % customers).alias("customer_id"),
                      F.date_add(F.lit("2024-01-01").cast("date"), (F.col("id") % 366).cast("int"))
                      .alias("order_date"),
                      (((F.col("id") * 104729) % 99_991).cast("decimal(12,0)") / 100 + 1)
                      .cast("decimal(12,2)").alias("amount"),
                      ((F.col("id") % 9) + 1).cast("int").alias("quantity"),
                      F.element_at(statuses, ((F.col("id") * 31) % len(STATUSES) + 1).cast("int")).alias("status"))
              .withColumn("month", F.date_format("order_date", "yyyy-MM")))
    orders.write.mode("overwrite").partitionBy("month").parquet(str(root / "input/orders"))
    (spark.range(customers, numPartitions=2)
     .select(F.col("id").alias("customer_id"),
             F.format_string("customer-%05d", F.col("id")).alias("name"),
             F.element_at(regions, (F.col("id") % len(REGIONS) + 1).cast("int")).alias("region"),
             F.when(F.col("id") % 10 == 0, "gold").when(F.col("id") % 3 == 0, "silver").otherwise("bronze")
             .alias("tier"))
     .write.mode("overwrite").option("header", True).csv(str(root / "input/customers")))


def read_inputs(spark: Any, root: Path) -> tuple[Any, Any]:
    orders = spark.read.parquet(str(root / "input/orders"))
    customers = (spark.read.option("header", True)
                 .schema("customer_id LONG, name STRING, region STRING, tier STRING")
                 .csv(str(root / "input/customers")))
    return orders, customers


def run_job(spark: Any, root: Path) -> None:
    """The job: every write goes through FileOutputCommitter (`_temporary`, renames, `_SUCCESS`)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    out = root / "output"
    orders, customers = read_inputs(spark, root)
    valid = orders.filter((F.col("status") != "cancelled") & (F.col("quantity") > 0))
    joined = valid.join(customers, "customer_id")

    # A first result that the second write must replace entirely (overwrite deletes old output).
    (orders.groupBy("month").agg(F.count("*").alias("orders"))
     .write.mode("overwrite").parquet(str(out / "region_month")))
    region_month = (joined.groupBy("region", "month")
                    .agg(F.count("*").alias("orders"), F.sum("amount").alias("revenue"),
                         F.sum("quantity").alias("items"), F.countDistinct("customer_id").alias("customers"))
                    .withColumn("running_revenue",
                                F.sum("revenue").over(Window.partitionBy("region").orderBy("month"))))
    region_month.write.mode("overwrite").parquet(str(out / "region_month"))

    spend = joined.groupBy("region", "customer_id", "name", "tier").agg(F.sum("amount").alias("spend"))
    ranked = spend.withColumn("rank", F.dense_rank().over(
        Window.partitionBy("region").orderBy(F.col("spend").desc(), F.col("customer_id"))))
    ranked.filter(F.col("rank") <= 5).write.mode("overwrite").json(str(out / "top_customers"))

    daily = joined.groupBy("order_date").agg(F.sum("amount").alias("revenue"), F.count("*").alias("orders"))
    daily.filter(F.col("order_date") < "2024-07-01").write.mode("overwrite").option("header", True) \
        .csv(str(out / "daily"))
    daily.filter(F.col("order_date") >= "2024-07-01").write.mode("append").option("header", True) \
        .csv(str(out / "daily"))

    by_tier = joined.groupBy("month", "tier").agg(F.sum("amount").alias("revenue"))
    by_tier.write.mode("overwrite").partitionBy("month").parquet(str(out / "tier_month"))
    # Replace two months only: the other months' files must stay.
    (by_tier.filter(F.col("month").isin("2024-03", "2024-04"))
     .withColumn("revenue", (F.col("revenue") * 2).cast("decimal(22,2)"))
     .write.mode("overwrite").option("partitionOverwriteMode", "dynamic")
     .partitionBy("month").parquet(str(out / "tier_month")))

    (valid.groupBy("status").agg(F.count("*").alias("orders"), F.sum("amount").alias("revenue"))
     .write.mode("overwrite").option("mapreduce.fileoutputcommitter.algorithm.version", "2")
     .parquet(str(out / "status_v2")))

    # The session catalog is in memory: a table left by an earlier run over the same root is only a
    # directory, which saveAsTable refuses to adopt.
    if (root / "warehouse/customer_tiers").exists():
        shutil.rmtree(root / "warehouse/customer_tiers")
    (customers.groupBy("region", "tier").agg(F.count("*").alias("customers"))
     .write.mode("overwrite").saveAsTable("customer_tiers"))


def rows_digest(df: Any) -> tuple[int, str]:
    """(row count, SHA-256 of the rows' canonical text, sorted): independent of row order."""
    lines = sorted(json.dumps([str(v) for v in row], ensure_ascii=False) for row in df.collect())
    return len(lines), hashlib.sha256("\n".join(lines).encode()).hexdigest()


def summarize(spark: Any, root: Path, read_root: Path) -> dict[str, Any]:
    from pyspark.sql import functions as F

    orders, customers = read_inputs(spark, read_root)
    row_hash = F.sum(F.xxhash64(*orders.columns).cast("decimal(38,0)"))
    o = orders.agg(F.count("*"), F.sum("amount"), F.sum("quantity"), row_hash).first()
    c = customers.agg(F.count("*"), F.sum(F.xxhash64(*customers.columns).cast("decimal(38,0)"))).first()
    out = read_root / "output"
    results = {
        "region_month": spark.read.parquet(str(out / "region_month")),
        "top_customers": spark.read.schema(
            "region STRING, customer_id LONG, name STRING, tier STRING, spend DECIMAL(22,2), rank INT")
        .json(str(out / "top_customers")),
        "daily": spark.read.option("header", True)
        .schema("order_date DATE, revenue DECIMAL(22,2), orders LONG").csv(str(out / "daily")),
        "tier_month": spark.read.parquet(str(out / "tier_month")),
        "status_v2": spark.read.parquet(str(out / "status_v2")),
        "customer_tiers": spark.read.parquet(str(read_root / "warehouse/customer_tiers")),
    }
    summary: dict[str, Any] = {
        "input": {"orders": o[0], "orders_amount": str(o[1]), "orders_quantity": o[2], "orders_checksum": str(o[3]),
                  "customers": c[0], "customers_checksum": str(c[1])},
        "results": {},
    }
    for name, df in results.items():
        count, digest = rows_digest(df)
        summary["results"][name] = {"rows": count, "sha256": digest}
    rm = results["region_month"].agg(F.sum("revenue"), F.sum("orders"), F.sum("items")).first()
    summary["totals"] = {"revenue": str(rm[0]), "orders": rm[1], "items": rm[2],
                         "daily_revenue": str(results["daily"].agg(F.sum("revenue")).first()[0]),
                         "tier_month_revenue": str(results["tier_month"].agg(F.sum("revenue")).first()[0])}
    summary["files"] = listing(read_root)
    return summary


def listing(root: Path) -> list[str]:
    """Every file under root, relative and sorted, with Spark's random job UUIDs replaced by `UUID`."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            found.append(UUID_RE.sub("UUID", rel))
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = stdout_to_stderr()
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    spark = start_spark(args.master, root)
    try:
        generate(spark, root, args.rows)
        run_job(spark, root)
        summary = summarize(spark, root, (args.read_root or args.root).resolve())
    finally:
        spark.stop()
    out.write(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
