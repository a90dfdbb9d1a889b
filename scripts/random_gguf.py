"""Random-weight GGUF files of real llama shapes, for benchmarking llama.cpp against ferrite's
synthetic models (`ferrite bench --synthetic NAME --dtype DTYPE`) on the same shapes.

usage: python3 scripts/random_gguf.py NAME DTYPE OUT.gguf [--seed N]
  NAME   llama-3.1-8b | llama-3.2-1b | smollm2-135m | qwen3-30b-a3b (the shapes of ferrite's
         gpu/synthetic.rs; the MoE one as llama.cpp's `qwen3moe`: per-head q/k norms, an f32
         router, the experts of each projection stacked in one tensor)
  DTYPE  bf16 | q4_0 | q4_1 | q5_0 | q8_0 | q4_k | q5_k | q6_k: every matrix, the embedding
         and the LM head in it (norms f32)

Needs the `gguf` package (llama.cpp's gguf-py: PYTHONPATH=<llama.cpp>/gguf-py works) and numpy.
bf16 values are uniform with a 1/fan-in variance; quantized blocks are random bytes with their
f16 scales set so values lie about in [-amp, amp], as ferrite's random blocks do. The vocabulary
is a placeholder SentencePiece list (llama-bench only draws random token ids from it).
"""

import sys

import numpy as np
import gguf

SHAPES = {
    # vocab, hidden, ffn, layers, heads, kv heads, head dim, rope theta, tied
    "llama-3.1-8b": (128256, 4096, 14336, 32, 32, 8, 128, 500000.0, False),
    "llama-3.2-1b": (128256, 2048, 8192, 16, 32, 8, 64, 500000.0, True),
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3, 64, 100000.0, True),
    "qwen3-30b-a3b": (151936, 2048, 6144, 48, 32, 4, 128, 1000000.0, False),
}
# Mixture-of-experts shapes: experts, experts a token, an expert's intermediate size.
MOE = {"qwen3-30b-a3b": (128, 8, 768)}

Q = gguf.GGMLQuantizationType
TYPES = {"bf16": Q.BF16, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q8_0": Q.Q8_0,
         "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
F = gguf.LlamaFileType
FILE_TYPES = {Q.BF16: F.MOSTLY_BF16, Q.Q4_0: F.MOSTLY_Q4_0, Q.Q4_1: F.MOSTLY_Q4_1, Q.Q5_0: F.MOSTLY_Q5_0,
              Q.Q8_0: F.MOSTLY_Q8_0, Q.Q4_K: F.MOSTLY_Q4_K_S, Q.Q5_K: F.MOSTLY_Q5_K_S, Q.Q6_K: F.MOSTLY_Q6_K}
# Block size, bytes, and the f16 scale fields (byte offset, value as a multiple of amp).
BLOCKS = {
    Q.Q4_0: (32, 18, [(0, 1 / 8)]),
    Q.Q4_1: (32, 20, [(0, 2 / 15), (2, -1.0)]),
    Q.Q5_0: (32, 22, [(0, 1 / 16)]),
    Q.Q8_0: (32, 34, [(0, 1 / 127)]),
    Q.Q4_K: (256, 144, [(0, 2 / (15 * 63)), (2, 1 / 63)]),
    Q.Q5_K: (256, 176, [(0, 2 / (31 * 63)), (2, 1 / 63)]),
    Q.Q6_K: (256, 210, [(208, 1 / (32 * 128))]),
}


def matrix(rng: np.random.Generator, qtype: int, rows: int, cols: int, fan_in: int) -> np.ndarray:
    """The raw bytes of a [rows, cols] matrix in qtype, as gguf-py takes them (uint8 rows)."""
    amp = (3.0 / fan_in) ** 0.5
    if qtype == Q.BF16:
        out = np.empty((rows, cols), dtype=np.uint16)
        for start in range(0, rows, 4096):  # in slices: f32 temporaries stay small
            vals = rng.uniform(-amp, amp, size=(min(4096, rows - start), cols)).astype(np.float32)
            out[start:start + len(vals)] = (vals.view(np.uint32) >> 16).astype(np.uint16)
        return out.view(np.uint8)
    elems, size, scales = BLOCKS[qtype]
    if cols % elems:
        sys.exit(f"{gguf.GGMLQuantizationType(qtype).name} needs rows of a multiple of {elems} values, not {cols}")
    blocks = rng.integers(0, 256, size=(rows, cols // elems, size), dtype=np.uint8)
    for offset, mult in scales:
        blocks[:, :, offset:offset + 2] = np.frombuffer(np.float16(amp * mult).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def main() -> None:
    args = sys.argv[1:]
    seed = 0
    if "--seed" in args:
        i = args.index("--seed")
        seed = int(args[i + 1])
        del args[i:i + 2]
    if len(args) != 3 or args[0] not in SHAPES or args[1] not in TYPES:
        sys.exit(__doc__)
    name, dtype, out = args
    vocab, d, ffn, layers, heads, kv_heads, hd, theta, tied = SHAPES[name]
    qtype = TYPES[dtype]
    rng = np.random.default_rng(seed)
    moe = MOE.get(name)
    w = gguf.GGUFWriter(out, "qwen3moe" if moe else "llama")
    w.add_name(f"random {name} {dtype}")
    w.add_context_length(8192)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6 if moe else 1e-5)
    if moe:
        w.add_expert_count(moe[0])
        w.add_expert_used_count(moe[1])
        w.add_expert_feed_forward_length(moe[2])
    w.add_vocab_size(vocab)
    w.add_file_type(FILE_TYPES[qtype])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def add(tensor: str, rows: int, cols: int, fan_in: int, experts: int = 0) -> None:
        m = matrix(rng, qtype, max(experts, 1) * rows, cols, fan_in)
        w.add_tensor(tensor, m.reshape(experts, rows, -1) if experts else m, raw_dtype=qtype)

    ones = np.ones(d, dtype=np.float32)
    add("token_embd.weight", vocab, d, 3)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        add(f"blk.{i}.attn_q.weight", heads * hd, d, d)
        add(f"blk.{i}.attn_k.weight", kv_heads * hd, d, d)
        add(f"blk.{i}.attn_v.weight", kv_heads * hd, d, d)
        add(f"blk.{i}.attn_output.weight", d, heads * hd, heads * hd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        if moe:
            experts, _, mf = moe
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(hd, dtype=np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(hd, dtype=np.float32))
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.uniform(-0.05, 0.05, (experts, d)).astype(np.float32))
            add(f"blk.{i}.ffn_gate_exps.weight", mf, d, d, experts)
            add(f"blk.{i}.ffn_up_exps.weight", mf, d, d, experts)
            add(f"blk.{i}.ffn_down_exps.weight", d, mf, mf, experts)
        else:
            add(f"blk.{i}.ffn_gate.weight", ffn, d, d)
            add(f"blk.{i}.ffn_up.weight", ffn, d, d)
            add(f"blk.{i}.ffn_down.weight", d, ffn, ffn)
    w.add_tensor("output_norm.weight", ones)
    if not tied:
        add("output.weight", vocab, d, d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}: {name} {dtype}")


if __name__ == "__main__":
    main()
