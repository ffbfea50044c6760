"""Version of the opake-core distribution."""

__version__ = "0.1.0"
