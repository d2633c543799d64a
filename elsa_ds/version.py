"""The package version (read by pyproject.toml and ``--version``)."""
__version__ = "0.2.0"
