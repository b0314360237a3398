"""Linear algebra as tile programs (TessellateIPU's ``linalg``): Jacobi eigh, QR, Hessenberg."""

from ipu_jax.tessellate.linalg.hessenberg import ipu_hessenberg
from ipu_jax.tessellate.linalg.jacobi import ipu_eigh
from ipu_jax.tessellate.linalg.qr import ipu_qr

__all__ = ["ipu_eigh", "ipu_qr", "ipu_hessenberg"]
