"""dynspec-patch: hosts, files and the CLI around the pure codemods in ``transforms``."""
