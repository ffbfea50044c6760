"""Version of the opake-models distribution."""

__version__ = "0.1.0"
