"""The rule table of the CUDA C++ lifter: which structural regions mean what.

Each `Rule` matches a `Region` (ingest.cuda_tree) by its kind, a regex on its head (function or
struct name, if-condition, statement text), optionally a regex on the enclosing scope and on the
region's text. The first matching rule wins for a region. IR meanings use the names of docs/ir.md:
`q_idx`, `kv_idx` (absolute positions), `M`/`N` (seqlen_q/seqlen_k of the batch entry), `m`
(query block index), `BLOCK_M`/`BLOCK_N`, `window_left`/`window_right`, `softcap`, `slopes`.

Facts encoded here were read off the pinned sources (see corpus/):
- FA2 aligns causal/local masks to the bottom-right: row r may see col c iff
  c < r + 1 + N - M + window_right (and c >= r + N - M - window_left when local).
- FA2 ALiBi subtracts slope * |r + N - M - c| in general; under a causal mask it adds slope * c,
  which differs from the general form only by a per-row constant that softmax cancels.
- FA2's apply_softcap computes tanh(s * (1/softcap)) and folds softcap into the softmax scale,
  i.e. softcap * tanh(score / softcap).
- CUTLASS FMHA causal masks default to top-left alignment (Q at the beginning); the
  kIsQBegin=false variant (77) adds offset_q = N - M.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ingest.cuda_tree import Region, RegionKind

__all__ = ["Rule", "RULES", "BACKWARD_RULES", "BWD_SCOPE", "match_rule"]

F, S, I, E, T = RegionKind.FUNCTION, RegionKind.STRUCT, RegionKind.IF, RegionKind.ELSE, RegionKind.STMT

CAUSAL_BR = "q_idx + (N - M) >= kv_idx"
CAUSAL_TL = "q_idx >= kv_idx"
LOCAL_BR = "(kv_idx <= q_idx + (N - M) + window_right) & (kv_idx >= q_idx + (N - M) - window_left)"
BOUNDS = "kv_idx < N"
ALIBI = "score - slopes[h] * abs(q_idx + (N - M) - kv_idx)"
ALIBI_CAUSAL = "score + slopes[h] * kv_idx"
SOFTCAP = "softcap * tanh(score / softcap)"
ONLINE = "online_softmax (m_i, l_i, acc) += s @ vt"
FINALIZE = "finalize ot, lt = (m_i, l_i, acc)"
COMBINE = "combine o, lse = (o_part, lse_part)"
GQA = "h // (Hq // Hkv)"
PAGED = "block_table[b, n_start // page_size] * page_size + n_start % page_size"
VARLEN = "cu_seqlens_q[b + 1] - cu_seqlens_q[b]"
DROPOUT = "where(rand[b, h, q_idx, kv_idx] <= 1 - p_drop, p / (1 - p_drop), 0.0)"
NMAX_BR = "minimum(cdiv(N, BLOCK_N), cdiv((m + 1) * BLOCK_M + N - M + window_right, BLOCK_N))"
NMIN_LOCAL = "maximum(0, (m * BLOCK_M + N - M - window_left) // BLOCK_N)"
NMAX_TL = "minimum(cdiv(N, BLOCK_N), cdiv((m + 1) * BLOCK_M, BLOCK_N))"
NMAX_BR_CUTLASS = "minimum(cdiv(N, BLOCK_N), cdiv((m + 1) * BLOCK_M + N - M, BLOCK_N))"


@dataclass(frozen=True)
class Rule:
    name: str
    kinds: frozenset[RegionKind]
    head: str  # regex searched in Region.head
    snippet_kind: str
    title: str
    ir: str
    features: dict = field(default_factory=dict)
    scope: str | None = None  # regex searched in Region.scope
    body: str | None = None  # regex searched in the region's source text
    body_not: str | None = None  # regex that must NOT occur in the region's text
    once_per_scope: bool = False  # keep only the first match per enclosing scope

    def matches(self, region: Region, text: str) -> bool:
        if region.kind not in self.kinds or not re.search(self.head, region.head):
            return False
        if self.scope is not None and not re.search(self.scope, region.scope):
            return False
        if self.body is not None and not re.search(self.body, text):
            return False
        return self.body_not is None or not re.search(self.body_not, text)


def _r(name: str, kinds: set, head: str, kind: str, title: str, ir: str, features: dict | None = None, **kw) -> Rule:
    return Rule(name, frozenset(kinds), head, kind, title, ir, features or {}, **kw)


BWD = {"backward": True}
BWD_SCOPE = r"^compute_dq_dk_dv"
# FA2's backward: one KV column block per program (`compute_dq_dk_dv_1colblock`), q blocks visited from the last
# down to m_block_min (the first block a causal/local KV block sees, bottom-right aligned), dQ into an f32 buffer.
MBLOCK_MIN_BR = "maximum(0, (n * BLOCK_N + M - N) // BLOCK_M)"

# Backward rules come first: inside the backward kernels they win over the forward rules of the same regions.
BACKWARD_RULES: tuple[Rule, ...] = (
    _r("fa2_bwd_dot_do_o", {F}, r"^dot_do_o$", "bwd_delta",
       "delta = rowsum(dO * O) of each q row (times p_dropout), reduced over the row's threads", "reduce dt = sum(og, 1)", BWD),
    _r("fa2_bwd_preprocess", {F}, r"^compute_dot_do_o$", "bwd_delta",
       "Backward preprocess kernel: delta per q block (and the dq accumulator cleared)",
       "store delta[b, h, m_start:+BLOCK_M] = dt", BWD),
    _r("fa2_bwd_convert_dq", {F}, r"^convert_dQ$", "bwd_dq_accumulate",
       "dQ from the f32 accumulator (summed over deterministic splits), times the softmax scale, to the input dtype",
       "store dq[b, h, m_start:+BLOCK_M, :] = dqt", BWD),
    _r("fa2_bwd_convert_dkv", {F}, r"^convert_dKV$", "bwd_dkdv_epilogue",
       "dK, dV from f32 accumulators (GQA/MQA: summed over the q heads of a KV head), scaled, to the input dtype",
       "store dk[b, hk, n_start:+BLOCK_N, :] = dk_acc", {**BWD}),
    _r("fa2_bwd_seqk_parallel", {F}, r"^compute_dq_dk_dv_seqk_parallel$", "bwd_loop_bounds",
       "KV-outer grid: one KV column block per program (strided over the SMs when deterministic)",
       "for n in range(0, cdiv(N, BLOCK_N), 1) forward:", BWD),
    _r("fa2_bwd_mblock_min", {T}, r"int m_block_min = ", "bwd_loop_bounds",
       "First q block a KV block sees: 0, or the diagonal for causal/local (bottom-right aligned); q blocks run last to first",
       MBLOCK_MIN_BR, {**BWD, "causal": True}, scope=BWD_SCOPE),
    _r("fa2_bwd_mblock_max_local", {I}, r"^Is_local$", "bwd_loop_bounds",
       "Last q block a KV block sees under a sliding window",
       "minimum(cdiv(M, BLOCK_M), cdiv((n + 1) * BLOCK_N + M - N + window_left, BLOCK_M))",
       {**BWD, "sliding_window": True}, scope=BWD_SCOPE, body=r"m_block_max"),
    _r("fa2_bwd_causal_mask", {I}, r"^m_block \* kBlockM < \(n_block \+ 1\) \* kBlockN \+ binfo\.actual_seqlen_q - binfo\.actual_seqlen_k \|\|",
       "mask_causal", "Backward causal mask on q blocks that cross the diagonal (bottom-right aligned)", CAUSAL_BR,
       {**BWD, "causal": True}, scope=BWD_SCOPE),
    _r("fa2_bwd_local_mask", {I}, r"^m_block \* kBlockM < .* - params\.window_size_right", "mask_local",
       "Backward sliding-window mask on q blocks near the window's edges", LOCAL_BR, {**BWD, "sliding_window": True},
       scope=BWD_SCOPE),
    _r("fa2_bwd_bounds_mask", {I}, r"^!Is_even_MN && \(n_block \+ 1\) \* kBlockN >= binfo\.actual_seqlen_k$", "mask_bounds",
       "Backward: ragged last KV block, columns past seqlen_k get -inf", BOUNDS, BWD, scope=BWD_SCOPE),
    _r("fa2_bwd_alibi", {I}, r"^Has_alibi$", "alibi", "Backward: ALiBi bias re-applied to the recomputed scores", ALIBI,
       {**BWD, "alibi": True, "score_mod": "alibi"}, scope=BWD_SCOPE),
    _r("fa2_bwd_softcap", {I}, r"^Is_softcap$", "softcap", "Backward: softcap re-applied to the recomputed scores", SOFTCAP,
       {**BWD, "softcap": True, "score_mod": "softcap"}, scope=BWD_SCOPE, body=r"apply_softcap"),
    _r("fa2_bwd_dtanh", {I}, r"^Is_softcap$", "bwd_score_mod_grad",
       "Backward softcap: d tanh = 1 - tanh² of the scores, multiplied into dS (the derivative of score_mod)",
       "score_mod_grad ds wrt s at (b, h, m_start, n_start)", {**BWD, "softcap": True}, scope=BWD_SCOPE,
       body=r"dtanh"),
    _r("fa2_bwd_dropout", {I}, r"^Is_dropout$", "dropout",
       "Backward: the forward's dropout mask re-applied to P (same Philox draws) before dV = Pᵀ dO", DROPOUT,
       {**BWD, "dropout": True}, scope=BWD_SCOPE, body=r"apply_dropout"),
    _r("fa2_bwd_probs", {T}, r"scale_apply_exp2", "bwd_probs",
       "P recomputed from the saved LSE: exp2(s * scale_log2 - lse * scale_log2)", "probs p = exp(s - lt)", BWD,
       scope=BWD_SCOPE),
    _r("fa2_bwd_ds", {T}, r"float scaled_ds = pointwise_mult", "bwd_softmax_grad",
       "dS = P * (dP - delta) per element (delta = dP_sum, the preprocess's rowsum(dO * O))",
       "softmax_grad ds = p * (dp - dt)", BWD, scope=BWD_SCOPE),
    _r("fa2_bwd_dq_serial", {I}, r"^!Seq_parallel$", "bwd_dq_accumulate",
       "dQ of this KV block added into the f32 buffer without atomics (one program walks the KV blocks)",
       "store dq_acc[b, h, m_start:+BLOCK_M, :] += dqp", BWD, scope=BWD_SCOPE),
    _r("fa2_bwd_dq_atomic", {T}, r"atomicAdd\(&tdQgdQaccum", "bwd_dq_accumulate",
       "dQ of this KV block added into the f32 buffer with atomicAdd (one program per KV block)",
       "store dq_acc[b, h, m_start:+BLOCK_M, :] += dqp", BWD, scope=BWD_SCOPE),
    _r("fa2_bwd_dq_direct", {I}, r"^Is_last$", "bwd_dq_accumulate",
       "dQ written directly when this is the only KV block (scaled, converted)", "store dq[b, h, m_start:+BLOCK_M, :] = dqt",
       BWD, scope=BWD_SCOPE, body=r"tdQgdQ"),
    _r("fa2_bwd_dk_scale", {T}, r"acc_dk\(i\) \*= params\.scale_softmax_rp_dropout", "bwd_dkdv_epilogue",
       "Epilogue: dK scaled by the softmax scale (and 1/(1 - p) with dropout) after the q-block loop",
       "elementwise dk_acc = dk_acc * sm_scale", BWD, scope=BWD_SCOPE),
    _r("fa2_bwd_launch", {F}, r"^run_flash_bwd_seqk_parallel$", "schedule",
       "Backward launch: delta preprocess over q blocks, dq/dk/dv over (KV blocks, b, h), dq conversion",
       "schedule block_m=kBlockM block_n=kBlockN num_warps=kNWarps", BWD),
    _r("fa2_bwd_traits", {S}, r"^Flash_bwd_kernel_traits$", "schedule",
       "Backward kernel traits: tile (kBlockM, kBlockN, kHeadDim), warps, MMA atom layouts for S/dP, dK/dV and dQ, "
       "V in registers, double buffering", "schedule block_m=kBlockM block_n=kBlockN num_warps=kNWarps", BWD),
)

RULES: tuple[Rule, ...] = BACKWARD_RULES + (
    # ---- FA2 mask.h
    _r("fa2_mask_bounds_fn", {F}, r"^apply_mask$", "mask_bounds", "Key-bounds mask: columns past seqlen_k get -inf", BOUNDS, scope=r"^$"),
    _r("fa2_mask_local_fn", {F}, r"^apply_mask_local$", "mask_local",
       "Sliding-window mask, bottom-right aligned (window_size_left/right)", LOCAL_BR, {"sliding_window": True}),
    _r("fa2_mask_causal_fn", {F}, r"^apply_mask_causal$", "mask_causal",
       "Causal mask as local mask with window (inf, 0), bottom-right aligned", CAUSAL_BR, {"causal": True}),
    _r("fa2_mask_causal_idx", {F}, r"^apply_mask_causal_w_idx$", "mask_causal",
       "Causal mask from explicit (row, col) index tensor", CAUSAL_TL, {"causal": True}),
    _r("fa2_mask_struct", {S}, r"^Mask$", "mask_causal",
       "Mask<Is_causal, Is_local, Has_alibi>: fused causal/local/ALiBi/bounds masking of a score tile", CAUSAL_BR,
       {"causal": True, "sliding_window": True, "alibi": True}),
    _r("fa2_mask_causal_branch", {I}, r"^Causal_mask$", "mask_causal",
       "Causal masking step: col >= row + 1 + seqlen_k - seqlen_q -> -inf", CAUSAL_BR, {"causal": True}),
    _r("fa2_mask_local_branch", {I}, r"^Is_local$", "mask_local", "Local (sliding-window) masking step", LOCAL_BR,
       {"sliding_window": True}, scope=r"Mask"),
    _r("fa2_mask_even_branch", {I}, r"!Is_even_MN$", "mask_bounds",
       "Ragged last KV block: mask columns >= seqlen_k", BOUNDS, scope=r"Mask"),
    _r("fa2_alibi_both", {I}, r"^Has_alibi$", "alibi", "ALiBi bias on the score tile (causal and general forms)", ALIBI,
       {"alibi": True, "score_mod": "alibi"}, scope=r"Mask", body=r"abs\("),
    _r("fa2_alibi_colonly", {I}, r"^Has_alibi$", "alibi",
       "ALiBi bias, column-only form (+slope * col; equal to the general form up to a row constant)", ALIBI_CAUSAL,
       {"alibi": True, "score_mod": "alibi"}, scope=r"Mask|Alibi"),
    _r("fa2_alibi_causal", {I}, r"^Is_causal$", "alibi",
       "ALiBi under a causal mask: +slope * col (row constant dropped, softmax-invariant)", ALIBI_CAUSAL,
       {"alibi": True, "score_mod": "alibi", "causal": True}, scope=r"Mask|Alibi", body=r"alibi_slope"),
    _r("fa2_alibi_general", {E}, r"^!\(Is_causal\)$", "alibi",
       "ALiBi, general form: -slope * |row + seqlen_k - seqlen_q - col|", ALIBI,
       {"alibi": True, "score_mod": "alibi"}, scope=r"Mask|Alibi", body=r"alibi_slope"),
    _r("fa2_alibi_struct", {S}, r"^Alibi$", "alibi", "Alibi<Is_causal>: apply ALiBi slopes to a score tile", ALIBI,
       {"alibi": True, "score_mod": "alibi"}),
    # ---- FA2 softmax.h / utils.h / dropout.h / rotary.h / block_info.h
    _r("fa2_softmax_struct", {S}, r"^Softmax$", "online_softmax", "Softmax<kNRows>: running max/sum, rescale of O", ONLINE),
    _r("fa2_softmax_rescale", {F}, r"^softmax_rescale_o$", "softmax_rescale",
       "Online softmax step: new row max, rescale acc_o and row sum by exp2((m_old - m_new) * scale_log2)", ONLINE),
    _r("fa2_scale_apply_exp2", {F}, r"^scale_apply_exp2$", "softmax_rescale",
       "exp2(s * scale_log2 - m * scale_log2) with -inf rows guarded", "exp2(score * scale_log2 - m_i * scale_log2)"),
    _r("fa2_normalize_lse", {F}, r"^normalize_softmax_lse$", "softmax_finalize",
       "Finalize: O /= row sum, LSE = m * scale + log(sum); +inf LSE for empty rows", FINALIZE, {"return_lse": True}),
    _r("fa2_softcap_fn", {F}, r"^apply_softcap$", "softcap", "Logit softcap: tanh(s / softcap), softcap folded into scale",
       SOFTCAP, {"softcap": True, "score_mod": "softcap"}),
    _r("fa2_dropout_struct", {S}, r"^Dropout$", "dropout", "Philox dropout on the probability tile (keep-prob threshold in uint8)",
       DROPOUT, {"dropout": True}),
    _r("fa2_rotary", {F}, r"^copy_rotary_(interleaved|contiguous)$", "rotary", "Rotary embedding applied while copying K/Q",
       "x * cos_t[pos, j] + x_rot * sin_t[pos, j]"),
    _r("fa2_blockinfo", {S}, r"^BlockInfo$", "varlen",
       "BlockInfo: per-batch seqlens from cu_seqlens (varlen), seqused_k, leftpad_k", VARLEN, {"varlen": True}),
    _r("fa2_blockinfo_offset", {F}, r"^(q|k)_offset$", "block_info", "Row offset of a batch entry: packed (varlen) or strided",
       "where(is_varlen, cu_seqlens_q[b] * row_stride, b * batch_stride)", {"varlen": True}, scope=r"BlockInfo"),
    _r("fa2_params_block_table", {T}, r"\bblock_table\b", "paged_kv", "Paged KV cache parameters (block_table, page size)",
       PAGED, {"paged_kv": True}, scope=r"^Flash_fwd_params$", once_per_scope=True),
    _r("fa2_params_gqa", {T}, r"\bh_h_k_ratio\b", "gqa", "GQA: precomputed h / h_k ratio", GQA, scope=r"^Qkv_params$"),
    # ---- FA2 flash_fwd_kernel.h
    _r("fa2_nmin_local", {T}, r"n_block_min = !Is_local \? 0", "kv_loop_bounds",
       "First KV block for sliding window (blocks left of the window are skipped)", NMIN_LOCAL, {"sliding_window": True}),
    _r("fa2_nmin_split", {T}, r"n_block_min = !Is_local \? n_split_idx", "kv_loop_bounds",
       "First KV block of this split (split-KV), window-clamped when local", "(split * n_blocks_per_split)",
       {"split_kv": True}),
    _r("fa2_nmax_split", {T}, r"n_block_max = std::min\(cute::ceil_div\(binfo\.actual_seqlen_k, kBlockN\), \(n_split_idx",
       "kv_loop_bounds", "Last KV block of this split (split-KV)",
       "minimum(cdiv(N, BLOCK_N), (split + 1) * n_blocks_per_split)", {"split_kv": True}),
    _r("fa2_nmax_causal", {I}, r"^Is_causal \|\| Is_local$", "kv_loop_bounds",
       "Causal/local block skipping: KV blocks right of the diagonal are never loaded", NMAX_BR,
       {"causal": True, "sliding_window": True}, body=r"n_block_max"),
    _r("fa2_empty_rows", {I}, r"n_block_max <= n_block_min|n_block_min >= n_block_max", "epilogue",
       "Empty KV range: write O = 0 and LSE = +inf (or -inf for a split) and exit early",
       "store lse[b, h, m_start:+BLOCK_M] = lt", {"return_lse": True}),
    _r("fa2_masking_steps", {T}, r"constexpr int n_masking_steps", "kv_loop_bounds",
       "Number of KV iterations that need masking before the mask-free loop",
       "where(~(causal | local), 1, where(even_mn & causal, cdiv(BLOCK_M, BLOCK_N), cdiv(BLOCK_M, BLOCK_N) + 1))",
       {"causal": True}, once_per_scope=True),
    _r("fa2_gqa_tile", {T}, r"bidh / params\.h_h_k_ratio", "gqa", "GQA/MQA: query head h reads KV head h / (h / h_k)", GQA,
       {}, once_per_scope=True),
    _r("fa2_block_table_ptr", {T}, r"const int \*block_table =", "paged_kv", "Paged KV: this batch entry's block table",
       PAGED, {"paged_kv": True}),
    _r("fa2_paged_offset", {T}, r"row_offset_k = block_table == nullptr", "paged_kv",
       "Paged KV: physical row of the last KV block through block_table", PAGED, {"paged_kv": True}),
    _r("fa2_paged_advance", {I}, r"^block_table == nullptr$", "paged_kv",
       "Paged KV: advance K/V pointers to the next block through block_table", PAGED, {"paged_kv": True}, once_per_scope=True),
    _r("fa2_softcap_branch", {I}, r"^Is_softcap$", "softcap", "Softcap the score tile before masking", SOFTCAP,
       {"softcap": True, "score_mod": "softcap"}, once_per_scope=True),
    _r("fa2_dropout_branch", {I}, r"^Is_dropout$", "dropout", "Dropout on P before the P @ V product", DROPOUT,
       {"dropout": True}, body=r"apply_dropout", once_per_scope=True),
    _r("fa2_alibi_slope", {T}, r"const float alibi_slope = ", "alibi",
       "ALiBi slope per (batch, head), divided by softmax scale (bias added before scaling)", ALIBI,
       {"alibi": True, "score_mod": "alibi"}),
    _r("fa2_rescale_call", {T}, r"softmax_rescale_o", "online_softmax", "Online softmax update after each S tile", ONLINE,
       {}, once_per_scope=True),
    _r("fa2_finalize_call", {T}, r"normalize_softmax_lse", "softmax_finalize", "Normalize O and compute LSE", FINALIZE,
       {"return_lse": True}, once_per_scope=True),
    _r("fa2_write_lse", {I}, r"get<1>\(taccOcO_row\(0\)\) == 0", "epilogue", "Epilogue: write LSE rows in bounds",
       "store lse[b, h, m_start:+BLOCK_M] = lt", {"return_lse": True}, body=r"gLSE"),
    _r("fa2_lse_tile", {F}, r"^get_lse_tile$", "epilogue", "LSE tile layout, padded or unpadded (varlen) and GQA-swapped",
       "store lse[b, h, m_start:+BLOCK_M] = lt", {"return_lse": True, "varlen": True}),
    _r("fa2_binfo", {T}, r"BlockInfo</\*Varlen=\*/!Is_even_MN> binfo", "varlen",
       "Varlen: actual seqlen_q/seqlen_k of this batch entry from cu_seqlens", VARLEN, {"varlen": True}, once_per_scope=True),
    _r("fa2_split_out", {T}, r"Tensor gOaccum = ", "epilogue",
       "Split-KV: partial O and LSE go to oaccum/lseaccum instead of O", "store o_part[split, b, h, m_start:+BLOCK_M, :] = ot",
       {"split_kv": True}, once_per_scope=True),
    _r("fa2_append_kv", {I}, r"^Append_KV$", "rotary", "KV-cache append: copy new K/V into the cache, with rotary on K",
       "store k[b, hk, n_start:+BLOCK_N, :] = k_new_rot"),
    _r("fa2_combine_fn", {F}, r"^combine_attn_seqk_parallel$", "split_kv_combine",
       "Split-KV combine: LSE-weighted sum of partial outputs", COMBINE, {"split_kv": True}),
    _r("fa2_combine_logsum", {T}, r"ElementAccum lse_logsum =", "split_kv_combine",
       "Split-KV combine: global LSE = log(sum exp(lse_i - max)) + max, +inf if all splits empty",
       "log(lse_sum) + lse_max", {"split_kv": True}),
    # ---- FA2 flash_api.cpp
    _r("fa2_num_splits", {F}, r"^num_splits_heuristic$", "split_kv_heuristic",
       "num_splits: smallest split count reaching 85% of the best wave efficiency",
       "let num_splits = smallest s with eff(s) >= 0.85 * max eff, eff(s) = waves(s) / ceil(waves(s))",
       {"split_kv": True, "decode": True}),
    _r("fa2_ngroups_swap", {T}, r"seqlenq_ngroups_swapped = ", "gqa",
       "Decode with GQA: fold the query heads of a KV group into seqlen_q when seqlen_q == 1", GQA,
       {"decode": True}, once_per_scope=True),
    _r("fa2_paged_api", {T}, r"const bool paged_KV = ", "paged_kv", "Paged KV enabled when block_table is given", PAGED,
       {"paged_kv": True}, once_per_scope=True),
    # ---- FA2 kernel_traits.h
    _r("fa2_traits", {S}, r"^Flash_fwd_kernel_traits$", "schedule",
       "Forward kernel traits: tile (kBlockM, kBlockN, kHeadDim), warps, smem layouts, Q-in-regs/shared-QK options",
       "schedule block_m=kBlockM block_n=kBlockN num_warps=kNWarps"),
    # ---- CUTLASS FMHA (41 Ampere kernel_forward.h)
    _r("cutlass41_causal_offset", {I}, r"custom_mask_type == CausalFromBottomRight$", "mask_causal",
       "Causal from bottom-right: diagonal offset = num_keys - num_queries", CAUSAL_BR, {"causal": True}),
    _r("cutlass41_causal_bound", {I}, r"custom_mask_type == CausalFromTopLeft \|\|", "kv_loop_bounds",
       "Causal: trim num_keys to the last key the query block can see", NMAX_BR_CUTLASS, {"causal": True}),
    _r("cutlass41_causal_mask", {I}, r"^p\.custom_mask_type &&", "mask_causal",
       "Causal mask of the diagonal KV block (cols past row + offset -> -inf)", CAUSAL_BR, {"causal": True}),
    _r("cutlass41_varlen", {T, E, I}, r"seqstart_q_ptr != nullptr", "varlen", "Varlen: query/key ranges from seqstart pointers",
       "seqstart_q[b + 1] - seqstart_q[b]", {"varlen": True}, once_per_scope=True),
    _r("cutlass41_softmax", {F}, r"^iterative_softmax$", "online_softmax", "Iterative (online) softmax with out_rescale", ONLINE),
    _r("cutlass41_lse", {I}, r"^thread_id\(\) < p\.num_queries$", "epilogue", "Write logsumexp = mi / log2(e) + log(s_prime)",
       "store lse[b, h, m_start:+BLOCK_M] = lt", {"return_lse": True}),
    # ---- CUTLASS FMHA (88 Hopper / 77 Blackwell fmha_fusion.hpp)
    _r("cutlass_causal_struct_tl", {S}, r"^CausalFusion$", "mask_causal",
       "CausalFusion: top-left causal mask (Q at the beginning) with trip-count trimming", CAUSAL_TL, {"causal": True}),
    _r("cutlass_causal_struct", {S}, r"^CausalMask$", "mask_causal",
       "CausalMask<kIsQBegin>: top-left or bottom-right causal mask with trip-count trimming", CAUSAL_TL, {"causal": True}),
    _r("cutlass_residual", {S}, r"^Residual(Fusion|Mask)$", "mask_bounds",
       "Residual mask: mask key columns past seqlen_k in the last tile", BOUNDS),
    _r("cutlass_causal_trip_qbegin", {I}, r"^IsQBegin$", "kv_loop_bounds",
       "Causal trip count, Q at the beginning", NMAX_TL, {"causal": True}, scope=r"CausalMask::get_trip_count$"),
    _r("cutlass_causal_trip_qend", {E}, r"^!\(IsQBegin\)$", "kv_loop_bounds",
       "Causal trip count, Q at the end (offset_q = N - M)", NMAX_BR_CUTLASS, {"causal": True},
       scope=r"CausalMask::get_trip_count$"),
    _r("cutlass_causal_trip88", {F}, r"^get_trip_count$", "kv_loop_bounds", "Causal trip count (top-left)", NMAX_TL,
       {"causal": True}, scope=r"^CausalFusion$"),
    _r("cutlass_causal_apply_qbegin", {I}, r"^IsQBegin$", "mask_causal", "Causal mask, Q at the beginning", CAUSAL_TL,
       {"causal": True}, scope=r"CausalMask::apply_mask$"),
    _r("cutlass_causal_apply_qend", {E}, r"^!\(IsQBegin\)$", "mask_causal", "Causal mask, Q at the end (offset_q = N - M)",
       CAUSAL_BR, {"causal": True}, scope=r"CausalMask::apply_mask$"),
    _r("cutlass_causal_before_softmax", {F}, r"^before_softmax$", "mask_causal", "Causal mask applied before softmax",
       CAUSAL_TL, {"causal": True}, scope=r"^CausalFusion$"),
    _r("cutlass_collective_softmax", {S}, r"^CollectiveSoftmax$", "online_softmax",
       "CollectiveSoftmax: row max/sum across the warpgroup, exp2 with scale_log2, rescale of O", ONLINE),
    _r("cutlass_softmax_step", {F}, r"^softmax_step$", "online_softmax",
       "SM100 softmax warp step: row max, exp2, publish stats to the correction warpgroup", ONLINE),
    _r("cutlass_correction", {F}, r"^correction_(rescale|epilogue)$", "softmax_rescale",
       "SM100 correction warpgroup: rescale O in TMEM by exp2(m_old - m_new)", ONLINE),
)


def match_rule(region: Region, text: str) -> Rule | None:
    for rule in RULES:
        if rule.matches(region, text):
            return rule
    return None
