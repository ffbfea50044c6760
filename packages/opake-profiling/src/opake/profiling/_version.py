"""Version of the opake-profiling distribution."""

__version__ = "0.1.0"
