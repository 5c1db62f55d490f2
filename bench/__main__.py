"""``python -m bench``: run the benchmark (see the package docstring)."""

from bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
