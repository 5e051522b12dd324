"""Outputs of a run, all read from the run record (`pytest_gpuhost.run.record`).

`html` (pytest-html columns, matrix, evidence, heatmaps), `jsonfile` (the JSON evidence file),
`fleet` (plugin glue: --limit, the fleet outputs at session end), `limit` (--limit expressions),
`summary` (the fleet summary and its verdicts), `prometheus` (node_exporter textfile), `files`
(summaries on disk and in S3), `merge` (`python -m pytest_gpuhost.merge`).
"""
