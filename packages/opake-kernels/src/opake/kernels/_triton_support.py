"""When the ``triton`` backend can run (no torch or triton import at module import).

* A real GPU: ``torch.utils._triton.has_triton()`` (Triton importable and a CUDA device it
  supports). The backend then runs on ``cuda`` and wins automatic selection there.
* The Triton interpreter: ``TRITON_INTERPRET=1`` and Triton importable. Kernels then run on CPU
  tensors (that is how CI tests them), 600-4000x slower than eager PyTorch, so the backend is
  registered with a priority *below* the torch reference: it is used only when asked for
  explicitly (``backend="triton"`` or ``OPAKE_KERNEL_BACKEND=triton``). Triton reads the
  variable when kernels are defined, so it must be set before ``opake.kernels.triton`` is
  imported; the backend's devices and priority are decided when plugins are loaded.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = [
    "GPU_PRIORITY",
    "INTERPRETER_PRIORITY",
    "interpreting",
    "triton_available",
    "triton_devices",
    "triton_importable",
    "triton_priority",
]

#: priority on a real GPU (above ``chunked``, which registers 10)
GPU_PRIORITY = 20
#: priority under the interpreter (below the ``torch`` reference: never chosen automatically)
INTERPRETER_PRIORITY = -10


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the CPU.

    >>> import os
    >>> interpreting() == (os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true"))
    True
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true")


def triton_importable() -> bool:
    """True when the ``triton`` package is installed (it is not imported)."""
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """The backend's ``available`` check: the interpreter, or Triton with a usable GPU."""
    if not triton_importable():
        return False
    if interpreting():
        return True
    from torch.utils._triton import has_triton

    return bool(has_triton())


def triton_devices() -> tuple[str, ...]:
    """``("cuda", "cpu")`` under the interpreter, else ``("cuda",)``."""
    return ("cuda", "cpu") if interpreting() else ("cuda",)


def triton_priority() -> int:
    """:data:`GPU_PRIORITY`, or :data:`INTERPRETER_PRIORITY` under the interpreter."""
    return INTERPRETER_PRIORITY if interpreting() else GPU_PRIORITY
