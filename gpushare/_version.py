"""The version of gpushare: the one place it is written (setuptools reads it from here)."""

__version__ = "0.1.0"
