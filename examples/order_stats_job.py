"""The Spark Structured Streaming job of the example pipeline.

Reads order events from tidemq topic ``orders``, keeps a 5 s watermark on the event time and
computes, per 10 s event-time window and region, how many orders were created, paid and shipped
and the revenue (sum of paid amounts). Each finished window (append mode: emitted once the
watermark passes its end) is written to topic ``order-stats`` as one JSON message, exactly once
(the tidemq sink's producer deduplication; docs/spark.md). The source commits its offsets as
consumer group ``orders-pipeline``, so ``tidemq group lag --group orders-pipeline`` shows how far
behind the job is. Standalone::

    python examples/order_stats_job.py --namesrv 127.0.0.1:9876 --checkpoint ./data/ckpt
"""

from __future__ import annotations

import argparse

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

GROUP = "orders-pipeline"
SOURCE_TOPIC = "orders"
RESULT_TOPIC = "order-stats"
WINDOW = "10 seconds"
WATERMARK = "5 seconds"

EVENT_SCHEMA = ("order_id string, customer string, region string, event string, "
                "amount_cents long, ts long")


def order_stats(events: DataFrame) -> DataFrame:
    """tidemq rows -> one row per (window, region): body (JSON), keys, tags."""
    parsed = (events
              .select(F.from_json(F.col("body").cast("string"), EVENT_SCHEMA).alias("e"))
              .select("e.*")
              .withColumn("event_time", F.timestamp_millis("ts"))
              .withWatermark("event_time", WATERMARK)
              # Drop the flush event *after* the watermark saw it. The predicate names the
              # event-time column so the optimizer does not push it below the watermark.
              .where((F.col("event") != "flush") | F.col("event_time").isNull()))
    stats = (parsed
             .groupBy(F.window("event_time", WINDOW), "region")
             .agg(F.count(F.when(F.col("event") == "created", 1)).alias("created"),
                  F.count(F.when(F.col("event") == "paid", 1)).alias("paid"),
                  F.count(F.when(F.col("event") == "shipped", 1)).alias("shipped"),
                  F.coalesce(F.sum(F.when(F.col("event") == "paid", F.col("amount_cents"))),
                             F.lit(0)).alias("revenue_cents")))
    start = F.date_format("window.start", "yyyy-MM-dd'T'HH:mm:ss'Z'")
    end = F.date_format("window.end", "yyyy-MM-dd'T'HH:mm:ss'Z'")
    return stats.select(
        F.to_json(F.struct(start.alias("window_start"), end.alias("window_end"), "region",
                           "created", "paid", "shipped", "revenue_cents")).alias("body"),
        F.array(F.concat_ws("@", "region", start)).alias("keys"),
        F.col("region").alias("tags"),
    )


def start_job(spark: SparkSession, namesrv: str, checkpoint: str,
              trigger: str = "2 seconds") -> StreamingQuery:
    events = (spark.readStream.format("tidemq")
              .option("namesrv", namesrv)
              .option("topics", SOURCE_TOPIC)
              .option("startingOffsets", "earliest")
              .option("maxOffsetsPerTrigger", 20000)
              .option("group", GROUP)
              .load())
    return (order_stats(events).writeStream.format("tidemq")
            .option("namesrv", namesrv)
            .option("topic", RESULT_TOPIC)
            .option("checkpointLocation", checkpoint)
            .outputMode("append")
            .queryName("order-stats")
            .trigger(processingTime=trigger)
            .start())


def main() -> None:
    import tidemq.spark

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--namesrv", default="127.0.0.1:9876")
    ap.add_argument("--checkpoint", required=True)
    a = ap.parse_args()
    spark = (SparkSession.builder.master("local[2]").appName("order-stats")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    tidemq.spark.register(spark)
    start_job(spark, a.namesrv, a.checkpoint).awaitTermination()


if __name__ == "__main__":
    main()
