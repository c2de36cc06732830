"""The cpu_int4 layout checked against torch's own packer on one ISA path.

Usage: ATEN_CPU_CAPABILITY=avx512|avx2|default python tinygemm_isa.py

torch reads ``ATEN_CPU_CAPABILITY`` once, at start-up, so each ISA path needs a fresh process.
Prints one line ``RESULT {"isa": ..., "block_n": ..., "full_block": ...}`` when every check is
bit-exact, and raises (non-zero exit) at the first disagreement.
"""

import json

import torch

# The shapes packed: whole 64-row blocks, partial blocks of 16/32/48 rows, and the demo model's
# matrices (576 = 9 x 64, 192 = 3 x 64, 1536; the head's 49152 is 768 x 64).
ISA_SHAPES = [(16, 64), (48, 128), (64, 64), (80, 576), (112, 256), (144, 256), (192, 576),
              (576, 1536), (1536, 576)]


def random_module(n: int, k: int, group: int, seed: int = 0):
    """Random codes, scales (a third of them negative, as the grid allows) and zeros."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    scale[:, ::3] *= -1
    zero = (torch.randn(n, k // group, generator=gen) * 0.01).to(torch.bfloat16)
    return codes, scale, zero


def isa_check() -> dict:
    """Our packer, reader, in-place repack (whole and one-block chunks) and kernel-layout
    dequantization (the bf16 reference and the transposed float32 fast path), each against
    ``_convert_weight_to_int4pack_for_cpu``, bit-exact."""
    from cpu_quant.formats.cpu_int4 import layout as tp

    layout = tp.kernel_layout()
    for n, k in ISA_SHAPES:
        group = 64
        codes, scale, zero = random_module(n, k, group, seed=n * k)
        theirs = tp.torch_pack(codes)
        assert torch.equal(layout.pack(codes), theirs), f"pack differs at {n}x{k}"
        assert torch.equal(layout.codes(theirs), codes), f"unpack differs at {n}x{k}"
        portable = tp.pack_codes(codes)
        assert torch.equal(tp.unpack_codes(portable), codes)
        rows = portable.clone()
        tp.repack_to_kernel_(rows)  # whole-matrix chunks
        assert torch.equal(rows, theirs), f"in-place repack differs at {n}x{k}"
        saved, tp.CHUNK_WEIGHTS = tp.CHUNK_WEIGHTS, 64 * k  # one block per chunk
        try:
            rows = portable.clone()
            tp.repack_to_kernel_(rows)
        finally:
            tp.CHUNK_WEIGHTS = saved
        assert torch.equal(rows, theirs), f"chunked repack differs at {n}x{k}"
        storage, sview, zview = tp.scale_zero_storage(n, k, group)
        sview.copy_(scale)
        zview.copy_(zero)
        ref = tp.dequantize_cpu_int4(portable, scale, zero)
        got = tp.dequantize_kernel_rows(theirs, storage, group, 0, n)
        assert torch.equal(got, ref.to(torch.bfloat16)), f"kernel-layout dequant differs at {n}x{k}"
        # the prefill's fast path: transposed, float32, whole and block by block (tails too)
        assert torch.equal(layout.codes_t_(theirs, 0, n, torch.empty(k, n)),
                           codes.t().float()), f"transposed codes differ at {n}x{k}"
        whole = tp.dequantize_kernel_t_(theirs, storage, group, 0, n, torch.empty(k, n))
        assert torch.equal(whole, ref.t()), f"transposed dequant differs at {n}x{k}"
        for r, size in layout.blocks(n):
            part = tp.dequantize_kernel_t_(theirs, storage, group, r, r + size,
                                           torch.empty(k, size))
            assert torch.equal(part, ref[r:r + size].t()), f"block {r} differs at {n}x{k}"
        # and the kernel itself reads what the layout says: one row through it equals the
        # float32 reference of that row (exact products, float32 sums)
        x = torch.zeros(1, k, dtype=torch.bfloat16)
        x[0, 0] = 1.0
        col = torch.ops.aten._weight_int4pack_mm_for_cpu(x, theirs, group, storage)
        assert torch.equal(col[0], ref[:, 0].to(torch.bfloat16)), f"kernel reads {n}x{k} wrong"
    return {"isa": torch.backends.cpu.get_cpu_capability(), "block_n": layout.block_n,
            "full_block": layout.full_block}


if __name__ == "__main__":
    print("RESULT " + json.dumps(isa_check()), flush=True)
