"""Run real llama.cpp (llama-cpp-python's ``libmtmd``) on a vision-language GGUF and its projector
file with one image prompt; print what it computed.

Usage (the llama-cpp-python peer venv's interpreter):
    python llama_cpp_images.py MODEL.gguf MMPROJ.gguf IMAGE.npy PROMPT OUT.npz REPO NEW_TOKENS

IMAGE.npy is an RGB uint8 array [height, width, 3]; PROMPT holds libmtmd's media marker. The
prompt is tokenized by libmtmd (which lays out the image's tokens as the projector type asks),
its chunks evaluated in order, then NEW_TOKENS greedy tokens generated. OUT.npz receives each
image chunk's embeddings as llama.cpp's projector computed them (``image_<i>``) and the logits
of each generated step (``logits``); the last stdout line is JSON: the chunks (text: the token
ids; image: its token count) and the generated tokens.
"""

import ctypes
import json
import sys

if __name__ == "__main__":
    model_path, mmproj_path, image_path, prompt, out_path, repo = sys.argv[1:7]
    new_tokens = int(sys.argv[7])
    sys.path.insert(0, repo)
    import llama_cpp
    import numpy as np
    from llama_cpp import mtmd_cpp as mtmd

    from benchmarks.peers.llama_cpp_open import open_model

    llm = open_model(model_path, n_ctx=256, n_batch=256, n_threads=2, seed=0, logits_all=True,
                     verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.print_timings = False
    params.n_threads = 2
    ctx = mtmd.mtmd_init_from_file(mmproj_path.encode(), llm.model, params)
    if not ctx:
        raise SystemExit(f"libmtmd could not load {mmproj_path}")
    pixels = np.ascontiguousarray(np.load(image_path), dtype=np.uint8)
    height, width = pixels.shape[:2]
    data = (ctypes.c_uint8 * pixels.size).from_buffer_copy(pixels.tobytes())
    bitmap = mtmd.mtmd_bitmap_init(width, height, data)
    text = mtmd.mtmd_input_text()
    raw = prompt.encode()
    text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), True, True
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
    if rc != 0:
        raise SystemExit(f"mtmd_tokenize failed ({rc})")
    n_embd = llama_cpp.llama_model_n_embd(llm.model)
    layout, arrays = [], {}
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            tokens = [int(ptr[j]) for j in range(n.value)]
            llm.eval(tokens)
            layout.append({"type": "text", "tokens": tokens})
            continue
        n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
            raise SystemExit("mtmd_encode_chunk failed")
        embd = mtmd.mtmd_get_output_embd(ctx)
        arrays[f"image_{len(layout)}"] = np.ctypeslib.as_array(
            embd, shape=(n_tokens * n_embd,)).reshape(n_tokens, n_embd).copy()
        new_past = llama_cpp.llama_pos(0)
        rc = mtmd.mtmd_helper_eval_chunk_single(ctx, llm._ctx.ctx, chunk,
                                                llama_cpp.llama_pos(llm.n_tokens),
                                                llama_cpp.llama_seq_id(0), llm.n_batch, False,
                                                ctypes.byref(new_past))
        if rc != 0:
            raise SystemExit(f"mtmd_helper_eval_chunk_single failed ({rc})")
        llm.n_tokens = new_past.value
        layout.append({"type": "image", "n_tokens": int(n_tokens)})
    if layout[-1]["type"] != "text":
        raise SystemExit("the prompt must end with text (its last logits start the generation)")
    generated, logits = [], []
    for _ in range(new_tokens):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        logits.append(row)
        generated.append(int(row.argmax()))
        llm.eval([generated[-1]])
    arrays["logits"] = np.stack(logits)
    np.savez(out_path, **arrays)
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    mtmd.mtmd_free(ctx)
    print(json.dumps({"chunks": layout, "generated": generated, "n_embd": int(n_embd)}))
