"""``python -m gpushare.bench``: run the benchmark (see the package docstring)."""

from gpushare.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
