"""Prompt datasets: JSONL / Parquet readers, grain pipelines, synthetic verifiable tasks."""
