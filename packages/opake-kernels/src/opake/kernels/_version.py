"""Version of the opake-kernels distribution."""

__version__ = "0.1.0"
