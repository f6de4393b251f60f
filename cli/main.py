"""The `kb` console script (`cli.main:app`; `python -m cli.main` runs the same): the app with every command registered."""

from __future__ import annotations

from cli import service, store, tune, work  # noqa: F401 - each registers its commands on `app`
from cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
