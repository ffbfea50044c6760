"""Version of the opake-patches distribution."""

__version__ = "0.1.0"
