"""pytest fixtures that bring lab hosts up once per test session (filled in by the lab work)."""
