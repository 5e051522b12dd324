"""Repo-wide pytest settings. The plugin itself is installed as the pytest11 entry point."""
