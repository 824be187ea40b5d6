"""The Triton programs of ``pcs.kernels.decode_attention`` (what each one computes, and why: that module's
docstring). A module of its own, imported on the first call on CUDA or under Triton's interpreter: Triton ships with
torch's CUDA wheels, not with the CPU wheel this project pins, and a jitted function calls only module-level ones."""
import triton
import triton.language as tl


@triton.jit
def attend_block(query, keys, values, allowed, start, hi, m, total, acc, scale, s_kn, s_vn, s_ag, s_an, offsets,
                 rows, dims, asked, real, APART: tl.constexpr, IEEE: tl.constexpr):
    # One block of a pair's entries from ``start`` (none at or past ``hi``) into the running softmax sums.
    at = start + offsets
    inside = at < hi
    k = tl.load(keys + at[:, None] * s_kn + dims[None, :], mask=inside[:, None] & real[None, :], other=0.0)
    if IEEE:                                     # float32 entries: no TF32 rounding
        scores = tl.dot(query, tl.trans(k), input_precision="ieee") * scale
    else:
        scores = tl.dot(query, tl.trans(k)) * scale
    seen = inside[None, :] & asked[:, None]
    if APART:
        chosen = tl.load(allowed + rows[:, None] * s_ag + at[None, :] * s_an, mask=seen, other=0)
        seen = seen & (chosen != 0)
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row that has seen nothing yet
    rescale = tl.exp(m - shift)
    p = tl.exp(scores - shift[:, None])
    total = total * rescale + tl.sum(p, 1)
    v = tl.load(values + at[:, None] * s_vn + dims[None, :], mask=inside[:, None] & real[None, :], other=0.0)
    if IEEE:
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, total, acc

@triton.jit(do_not_specialize=["n_kv_heads", "width", "s_qb", "s_qh", "s_qg", "s_kb", "s_kh", "s_kn", "s_vb", "s_vh",
                               "s_vn", "s_ab", "s_ah", "s_ag", "s_an", "s_ob", "s_oh", "s_og"])
def split_attention(q, keys, values, lengths, bases, allowed, acc_out, m_out, l_out, scale, n_kv_heads, width,
                    s_qb, s_qh, s_qg, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ab, s_ah, s_ag, s_an,
                    s_ob, s_oh, s_og, ONE_SPLIT: tl.constexpr,
                    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD: tl.constexpr, D: tl.constexpr,
                    BLOCK: tl.constexpr, JAGGED: tl.constexpr, APART: tl.constexpr, IEEE: tl.constexpr,
                    WHILE: tl.constexpr):
    pair = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = (pair // n_kv_heads).to(tl.int64)        # 64-bit offsets: a layer's buffer may pass 2^31 elements
    h = (pair % n_kv_heads).to(tl.int64)
    n = tl.minimum(tl.load(lengths + pair), width)     # never past the buffer, whatever a length says
    if JAGGED:                                   # the pair's entries from its own offset
        first = tl.load(bases + pair).to(tl.int64)
        k_pair, v_pair, a_pair = first * s_kn, first * s_vn, first * s_an
    else:
        k_pair, v_pair, a_pair = b * s_kb + h * s_kh, b * s_vb + h * s_vh, b * s_ab + h * s_ah
    # this program's part of the pair's entries: whole blocks, the parts as equal as blocks allow
    part = tl.cdiv(tl.cdiv(n, n_splits), BLOCK) * BLOCK
    lo = split * part
    hi = tl.minimum(lo + part, n)
    rows = tl.arange(0, ROWS)                    # the group's query heads, padded to tl.dot's 16 rows
    dims = tl.arange(0, D)                       # the head dimension HEAD, padded to a power of two
    real = dims < HEAD
    offsets = tl.arange(0, BLOCK)
    asked = rows < GROUP
    query = tl.load(q + b * s_qb + h * s_qh + rows[:, None] * s_qg + dims[None, :],
                    mask=asked[:, None] & real[None, :], other=0.0)
    m = tl.full([ROWS], float("-inf"), tl.float32)       # running maximum score per query head
    total = tl.zeros([ROWS], tl.float32)                 # running sum of exp(score - m)
    acc = tl.zeros([ROWS, D], tl.float32)                # running sum of exp(score - m) x value
    if WHILE:                                    # Triton's interpreter takes no loop bounds read from memory
        start = lo
        while start < hi:
            m, total, acc = attend_block(query, keys + k_pair, values + v_pair, allowed + a_pair, start, hi,
                                         m, total, acc, scale, s_kn, s_vn, s_ag, s_an, offsets, rows, dims,
                                         asked, real, APART, IEEE)
            start += BLOCK
    else:                                        # a loop the compiler pipelines
        for start in range(lo, hi, BLOCK):
            m, total, acc = attend_block(query, keys + k_pair, values + v_pair, allowed + a_pair, start, hi,
                                         m, total, acc, scale, s_kn, s_vn, s_ag, s_an, offsets, rows, dims,
                                         asked, real, APART, IEEE)
    if ONE_SPLIT:                                # the whole answer: normalized, into the output
        answer = acc / tl.maximum(total, 1.17549435e-38)[:, None]
        tl.store(acc_out + b * s_ob + h * s_oh + rows[:, None] * s_og + dims[None, :],
                 answer.to(acc_out.dtype.element_ty), mask=asked[:, None] & real[None, :])
    else:                                        # a part's partial sums, merged by merge_splits; a part of no
        out = (pair * n_splits + split).to(tl.int64) * ROWS + rows       # entries writes only its maximum
        read = asked & (rows * 0 + lo < hi)      # a tensor of booleans: the interpreter takes no scalar in a mask
        tl.store(m_out + out, m, mask=asked)
        tl.store(l_out + out, total, mask=read)
        tl.store(acc_out + out[:, None] * D + dims[None, :], acc, mask=read[:, None])

@triton.jit(do_not_specialize=["n_kv_heads", "s_ob", "s_oh", "s_og"])
def merge_splits(acc, m, total, out, n_kv_heads, s_ob, s_oh, s_og,
                 SPLITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD: tl.constexpr,
                 D: tl.constexpr):
    # One program per (row, KV head): the parts' sums rescaled to a common maximum, one after another; a part
    # that read nothing (maximum -inf) is skipped without reading its sums.
    pair = tl.program_id(0)
    b = (pair // n_kv_heads).to(tl.int64)
    h = (pair % n_kv_heads).to(tl.int64)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, D)
    asked = rows < GROUP
    top = tl.full([ROWS], float("-inf"), tl.float32)
    weight = tl.zeros([ROWS], tl.float32)
    answer = tl.zeros([ROWS, D], tl.float32)
    for split in range(SPLITS):
        at = (pair * SPLITS + split).to(tl.int64) * ROWS + rows
        m_split = tl.load(m + at, mask=asked, other=float("-inf"))
        read = asked & (m_split > float("-inf"))
        new_top = tl.maximum(top, m_split)
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        old_scale = tl.exp(top - shift)
        split_scale = tl.where(read, tl.exp(m_split - shift), 0.0)
        weight = weight * old_scale + tl.load(total + at, mask=read, other=0.0) * split_scale
        part = tl.load(acc + at[:, None] * D + dims[None, :], mask=read[:, None], other=0.0)
        answer = answer * old_scale[:, None] + part * split_scale[:, None]
        top = new_top
    answer = answer / tl.maximum(weight, 1.17549435e-38)[:, None]
    tl.store(out + b * s_ob + h * s_oh + rows[:, None] * s_og + dims[None, :],
             answer.to(out.dtype.element_ty), mask=asked[:, None] & (dims[None, :] < HEAD))
