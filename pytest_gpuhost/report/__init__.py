"""Outputs of a run, all read from the run record (`pytest_gpuhost.run.record`).

`html` (pytest-html columns, matrix, evidence, heatmaps), `jsonfile` (the JSON evidence file),
`fleet` (the fleet outputs at session end; `--limit` is `run/limit.py`), `summary` (the fleet summary and its verdicts), `prometheus` (node_exporter textfile), `files`
(summaries on disk and in S3). The fleet merge that reads them is `pytest_gpuhost.merge`.
"""
