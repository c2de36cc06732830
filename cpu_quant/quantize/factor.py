"""The Cholesky factor and the triangular inverse GPTQ needs, with the same bits at any thread
count.

LAPACK's threaded Cholesky (``potrf``, behind ``torch.linalg.cholesky_ex``) splits its work by
the number of threads, so its last bits, and through the damping rule the artifact, changed
with ``--threads``. Here the work that depends on the thread count is done on one thread
(the factorization and inversion of diagonal blocks of at most :data:`BLOCK` columns), and the
bulk goes through matrix products, whose sums BLAS splits over the output's rows and columns,
never along the sum. ``cpu-quant`` starts with ``MKL_CBWR=AUTO,STRICT``, the mode in which
oneMKL documents GEMM and TRSM as bitwise reproducible for any thread count; the tests compare
the bits at 1, 2 and 3 threads.

The triangular inverse is computed by blocks (``[[A, 0], [B, C]]⁻¹ = [[A⁻¹, 0], [-C⁻¹BA⁻¹,
C⁻¹]]``): a third of the multiplications of a triangular solve against the identity.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

BLOCK = 256  # columns of a diagonal block, factored or inverted on one thread


@contextmanager
def one_thread():
    """torch (and its BLAS) on one thread inside the block; the caller's count after it."""
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def cholesky_lower(a: torch.Tensor, block: int = BLOCK) -> torch.Tensor | None:
    """The lower Cholesky factor of the symmetric ``a`` (only its lower triangle is read), or
    None when ``a`` is not positive definite in its dtype. Right-looking by blocks: each
    diagonal block factored on one thread, the panel below it solved on one thread, the
    trailing lower blocks updated by matrix products."""
    n = a.shape[0]
    work = a.clone()
    for j in range(0, n, block):
        e = min(j + block, n)
        with one_thread():
            diag, info = torch.linalg.cholesky_ex(work[j:e, j:e])
            if info.item() != 0:
                return None
            work[j:e, j:e] = diag
            if e < n:
                # panel: P Dᵀ = A  <=>  D Pᵀ = Aᵀ
                work[e:, j:e] = torch.linalg.solve_triangular(
                    diag, work[e:, j:e].t(), upper=False).t()
        panel = work[e:, j:e]
        for c in range(e, n, block):  # the lower part of the trailing matrix, by column blocks
            d = min(c + block, n)
            work[c:, c:d].sub_(panel[c - e:] @ panel[c - e:d - e].t())
    return work.tril_()


def invert_lower(lower: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``lower⁻¹`` of a lower-triangular matrix with a nonzero diagonal, itself lower
    triangular. Blocks of at most ``block`` columns are inverted on one thread; larger ones
    split in two halves (at a multiple of ``block``) joined by two matrix products."""
    n = lower.shape[0]
    if n <= block:
        with one_thread():
            eye = torch.eye(n, dtype=lower.dtype)
            return torch.linalg.solve_triangular(lower, eye, upper=False)
    half = -(-(n // 2) // block) * block
    out = torch.zeros_like(lower)
    out[:half, :half] = invert_lower(lower[:half, :half], block)
    out[half:, half:] = invert_lower(lower[half:, half:], block)
    # the lower-left block: -C⁻¹ B A⁻¹ (negated in place: two quarter-size temporaries, not three)
    out[half:, :half] = (out[half:, half:] @ (lower[half:, :half] @ out[:half, :half])).neg_()
    return out
