"""The `kb` command line: thin shells over kb/, ingest/, retrieve/, verify/, generate/ and bench/ (the top layer)."""
