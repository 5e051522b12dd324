"""Fleet outputs and host selection: JSON summary, Prometheus textfile, run comparison (fleet work)."""
