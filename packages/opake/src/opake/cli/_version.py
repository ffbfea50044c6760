"""Version of the opake distribution."""

__version__ = "0.1.0"
