"""Session fixture `s3_endpoint`: a real S3 endpoint on loopback (filled in by the decommission work)."""
