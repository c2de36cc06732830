"""llama.cpp GGUF files, read by ``llama-cli -m``: ``gguf`` (Q4_0 blocks, the symmetric grid of
``gptq``; this docstring) and llama.cpp's file types ``gguf:q4_k_m``, ``gguf:q4_k_s``,
``gguf:iq4_nl`` (``format.GGUFTypeMixFormat``): every tensor on the type ``llama-quantize``
gives it (``mix.py``), each type a module owning its byte layout (``q4_k.py``, ``q5_k.py``,
``q6_k.py``, ``iq4_nl.py``, ``q5_0.py``, ``q5_1.py``, ``q8_0.py``; ``blocks.py`` their
registry), the file named ``<model>-<TYPE>.gguf`` and laid out as below otherwise.

Every llama.cpp command that runs the file, whether cpu-quant runs it or prints it for a user,
comes from :func:`llama_cpp_command`, which turns llama.cpp's weight repacking off
(:data:`LLAMA_CPP_NO_REPACK`).

One file ``<model>-Q4_0.gguf`` (GGUF v3, little-endian, 32-byte tensor alignment, written with
the ``gguf`` package's ``GGUFWriter``). Per quantized linear ``<m>`` with out-features ``N``,
in-features ``K`` (a multiple of 32) and our group ``g`` (a multiple of 32, or ``K``):

=================  =======  ==================  ================================================
GGUF tensor        type     ggml shape ``ne``   content (row-major [N, K/32] blocks of 18 bytes)
=================  =======  ==================  ================================================
``blk.L.<name>``   Q4_0     [K, N]              block ``b`` of row ``n`` covers ``w[n, 32b ..
                                                32b+31]``: bytes 0-1 ``d`` (fp16, LE), bytes
                                                2-17 ``qs``: byte ``2 + j`` holds element ``j``
                                                in its low nibble and element ``j + 16`` in its
                                                high nibble (j = 0..15). ``q ∈ [0, 15]``.
=================  =======  ==================  ================================================

Dequantization (gguf-py ``quants.Q4_0.dequantize_blocks``, ggml ``dequantize_row_q4_0``):
``w[n, 32b + i] = (q[n, 32b + i] - 8) * d[n, b]``: the zero is the fixed 8, as ``gptq``'s.

* **Groups**: Q4_0's block is 32. Group 32 maps one to one; a group ``g = 32m`` writes its scale
  into each of its ``m`` blocks, so the weights are the same numbers (still 4.5 bits per
  weight: every block carries its own ``d``). :func:`unpack_q4_0` therefore reads group 32
  back; :func:`as_blocks_of_32` expands a :class:`GroupQuant` the same way for comparison.
* **Scales**: ours are bf16 values (``core/grid.py``), possibly negative; ``d`` is fp16.
  A bf16 value in fp16's range is exact in fp16 unless it is below ``2**-14`` with more
  significant bits than fp16's subnormals keep, or above 65504. Such a scale is refused
  (:class:`CpuQuantError` naming the tensor) rather than rounded: rounding would silently move
  the weights away from every other format of the same run.
* **Rows**: ``llama`` (Llama, Mistral) applies rope to interleaved pairs, HF to halves, so the
  converter permutes the rows of ``attn_q``/``attn_k`` within each head (``permute_rope_rows``).
  Whole rows move, blocks run along K, so the permutation is exact on the blocks.

Tensors not quantized, each as ``convert_hf_to_gguf.py`` names them:

==========================  =====  ==========================================================
tensor                      type   why
==========================  =====  ==========================================================
``token_embd``              Q8_0   see :data:`EMBEDDING_TYPE` (docs/gguf.md has the numbers)
``output`` (head kept)      Q8_0   same tensor as the embedding when tied, so the same type
norms (``*_norm``)          F32    what the converter writes; Gemma's stored as ``1 + w``
biases (Qwen2's q/k/v)      F32    what the converter writes
a linear kept float         BF16   exact: the plan keeps one float only when K % 32 != 0
==========================  =====  ==========================================================

Metadata: ``general.architecture`` and ``{arch}.*`` hyperparameters, ``general.file_type``
(2, MOSTLY_Q4_0, for ``gguf``; the file type's own for the others), the tokenizer
(``tokenizer.ggml.model = gpt2``, tokens, token types, merges, special ids,
``add_bos_token``, the pre-tokenizer name from :data:`PRE_TOKENIZERS`) and the chat template,
and ``cpu_quant.*`` provenance (group, head_quantized).

While a run is going, each ``end_layer`` writes ``.gguf-parts/part-XXXXX.safetensors``: the
layer's quantized blocks as uint8 [N, bytes per row] under their Hugging Face names and its
float tensors as given (bf16). ``finish`` maps names, permutes, converts and streams everything into
``<model>-Q4_0.gguf.partial``, renames it into place and deletes the parts.

A vision-language model (``vision.py``) gets a second file, llama.cpp's projector file
``mmproj-<model>-BF16.gguf``: its vision tower and projector, unquantized, written from the
kept tensors' parts before the model file.
"""

from .format import GGUFFormat  # noqa: F401  (registers the format)
