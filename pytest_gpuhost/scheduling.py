"""xdist scheduling that keeps one host's procedure on one worker, in order (filled in by the fleet work)."""
