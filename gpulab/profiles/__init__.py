"""Lab host profiles: the YAML machines of ``fixtures/profiles/``, loaded, validated, and their variants."""
