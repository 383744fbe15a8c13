"""``attention_cte``: flash-attention prefill (context encoding) forward, and its reference.

Layouts (heads folded into the batch dimension; ``B = batch * heads``)::

    q    (B, Sq, d)   if tp_q  else (B, d, Sq)
    k    (Bkv, Skv, d) if tp_k else (Bkv, d, Skv)
    v    (Bkv, Skv, d)
    out  (B, Sq, d)   or (B, d, Sq) if tp_out
    lse  (B, 128, ceil(Sq / 128)) float32 (only with cache_softmax=True):
         lse[b, p, t] = logsumexp_k(scale * q_i . k_k) over the unmasked keys of query
         i = t * 128 + p (the layout of ``attention_bwd``'s ``lse``; padding rows are garbage)

GQA: query batch ``b`` uses kv batch ``b // (B // Bkv)`` (B must be a multiple of Bkv).

Masks: ``causal_mask`` keeps key ``j`` for query ``i`` when ``j <= i`` (top-left aligned, as
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``); ``sliding_window=W``
additionally drops keys with ``i - j >= W`` (each query sees at most W keys, itself included).
Every query must keep at least one key (always true with the causal mask; not checked for
the prefix with a run-time ``prior_used_len``).

Options: ``sink`` (B,) -- attention sinks (GPT-OSS): one extra logit per query batch in the
softmax denominator, ``softmax([scale * q.k..., sink[b]])`` with the sink's column dropped (lse
includes it).

Prefix KV (``k_prior``, ``v_prior``, ``prior_used_len``; as AWS's prefix caching): k_prior has
the layout of k ((Bkv, d, Sp), or (Bkv, Sp, d) with tp_k), v_prior that of v (Bkv, Sp, d), same
dtypes; GQA as for k/v. The keys are ``concat(k_prior[:used], k)`` with positions
``-used .. -1`` for the prefix and ``0 .. Skv-1`` for the chunk (queries at ``cp_offset + i``):
the causal mask never drops a prefix key, the sliding window applies to these absolute
positions (query at position t keeps prefix key j iff ``t - (j - used) < W``; AWS's reference
does the same), prefix positions ``j >= used`` are dropped, and the lse includes the prefix.
``prior_used_len`` (``used``) is either a Python int in [0, Sp] (static: unused prefix tiles
are skipped) or, as in AWS's API, a 1-element int32/float tensor of shape (1,) -- one length for
all batches, read at run time (the prefix tiles then get a dynamic mask: all Sp keys are
computed; a value outside [0, Sp] is not checked by the kernel and gives undefined results;
``attention_ref`` raises). None means ``used = Sp``.

Context parallelism: the kernel holds a slice of the queries and the full k/v. Query row i
sits at global position ``cp_offset + i`` (contiguous slices: cp_offset = rank * local Sq), or
with ``cp_strided_q_slicing=True`` at ``cp_offset + i * global_cp_deg`` (row-strided slices:
cp_offset = rank in [0, global_cp_deg)), as in AWS's API; the causal / window masks compare
these positions with the key positions. ``global_cp_deg`` only matters when strided.

Limits: d <= 128 (one TensorE contraction); ``scale`` > 0; any Sq, Skv >= 1 (ragged tiles are
handled); B % Bkv == 0.

Algorithm (per query tile of 128 rows, keys in tiles of 512 grouped in sections of 4):
S = (scale * Q) K^T lands in PSUM (one matmul per 512 keys, K^T [d, 512] as the moving tile);
each tile's row max is taken on VectorE (or, for 6 tiles in 16 -- 4 on trn3 --, on ScalarE)
and folded into the running max on GpSimd as it lands; ScalarE computes P = exp(S - m)
straight from PSUM; TensorE transposes P in 128x128 blocks (keys must be on partitions to be
contracted) and accumulates [O | l] += P [V | 1] in PSUM -- the ones column appended to V
yields the row sums l of the *rounded* P in the same matmuls. O is rescaled by
exp(m_old - m_new) once per section (online softmax) and normalised at the end. The sections
are software-pipelined two deep (scores and maxima of step j+2 interleave with the transposes
and P V of step j), with 6 rotating PSUM score banks; a pipeline step holds up to 4 key
tiles: one section or, under a causal mask, the partial (< 4 tile) sections of two query
tiles (ordered so that a last section of r tiles is followed by a first section of 4 - r).
Fully masked key tiles are skipped; tiles crossing the causal diagonal or the window edge get
an additive 0/-3e38 mask (built once per offset on GpSimd, added by an identity matmul on
TensorE). K^T and V of a kv batch stay resident in SBUF while its query tiles run (when they
fit in 96 KiB/partition, else they are streamed per section), loaded in 2048-key blocks on
first use; under a causal mask a few query tiles that need only the first block run first,
while the DMA queues bring in the rest (the very first block's K^T goes first, partly in
128-key DMAs). Q tiles are loaded a few work items ahead and transposed on TensorE one step
before VectorE scales them. The final normalisation runs on GpSimd after one ScalarE copy out
of PSUM. LNC=2 splits the (batch, query tile) work items between the two programs,
interleaved so a causal mask keeps them balanced.

Prefix KV: the prefix occupies key indices 0..Sp-1 of the resident / streamed K^T and V, the
chunk starts at Sp rounded up to 128 (so each 128-key chunk has one source: the V DMAs stay
whole-chunk); a query tile's prefix tiles run first. Prefix tiles that need masking (a
run-time ``prior_used_len``, or a window edge) are masked by one VectorE ``range_select`` on
the scores in PSUM, in place, which also produces the row maximum (replacing the max
reduction, so the mask costs no extra instruction). A row whose keys in a section are all
masked gets a max of -3.4e38 and P = 1 there; the online-softmax rescale
exp(m_old - m_new) = 0 of a later section with a kept key removes it (there always is one:
the chunk's own keys come last). Strided CP only changes the mask geometry (channel
multiplier ``global_cp_deg`` in the affine masks, key ranges per query tile).

Numerics: matmuls run in bf16 (fp32 for fp32 inputs) with fp32 PSUM accumulation; max, exp,
sums and rescaling in fp32; P is rounded to the matmul dtype before P V (as on hardware).
Tolerances vs :func:`attention_ref` in fp32: ~1e-5 abs; bf16 inputs: ~2e-2 abs on outputs of
magnitude ~1.
"""

from __future__ import annotations

import math

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import NEG_BIG, P, arg_error, cdiv, matmul_dtype, shape_error

KT = 512  # key tile: one PSUM bank of fp32 scores per matmul
SEC = 4  # key tiles per online-softmax section
NSBUF = 6  # rotating PSUM score buffers (one bank each)
# Of every 16 score tiles these 6 take their row max on ScalarE, the rest on VectorE: VectorE
# also copies every P^T out of PSUM, ScalarE computes every exp (tuned with nki.benchmark).
SCALAR_MAX_SLOTS = (1, 4, 6, 9, 12, 14)
# NeuronCore-v4 (trn3): VectorE is 1.25x faster and takes more of the maxima (4 of 16 on ScalarE)
SCALAR_MAX_SLOTS_V4 = (1, 5, 9, 13)
LAG = 2  # pipeline iterations between a section's scores and its P V
RESIDENT_KV_BYTES = 96 * 1024  # per-partition SBUF budget for a resident K^T + V
KVBLK = SEC * KT  # keys per DMA of a resident K^T / V
# Causal: this many query tiles that only need the first K/V block run first, so TensorE has
# work while the DMA queues bring in the rest of K/V (tuned with nki.benchmark).
WARMUP_TILES = 4
# Causal: query tiles are ordered so that one whose last section has r < SEC key tiles is
# followed by one with SEC - r, and the two partial sections share one pipeline step.
PAIR = True
KPIECES = 8  # first block: K^T of its first KPIECES * 128 keys in 128-key DMAs
QPF = 2  # Q tiles are loaded this many work items ahead of the next one


def _mask_tile(rows, kw, q0, k0, causal, window, mask_sb, qstep=1):
    """Build an additive mask [rows, kw] (0 keep / NEG_BIG drop) on GpSimd for the score tile
    whose query rows sit at positions q0 + qstep * p and key columns at k0 + j."""
    zeros = nl.ndarray((rows, kw), mask_sb.dtype, buffer=nl.sbuf)
    nisa.memset(zeros, 0.0, engine=nisa.engine.gpsimd)
    src = zeros
    if causal:
        # keep where (q0 + qstep * p) - (k0 + j) >= 0
        nisa.affine_select(mask_sb, pattern=[[-1, kw]], channel_multiplier=qstep,
                           on_true_tile=src, on_false_value=NEG_BIG, cmp_op=nl.greater_equal,
                           offset=q0 - k0)
        src = mask_sb
    if window is not None:
        # keep where (q0 + qstep * p) - (k0 + j) < W  <=>  W - 1 - q0 + k0 - qstep * p + j >= 0
        nisa.affine_select(mask_sb, pattern=[[1, kw]], channel_multiplier=-qstep,
                           on_true_tile=src, on_false_value=NEG_BIG, cmp_op=nl.greater_equal,
                           offset=window - 1 - q0 + k0)


def _check(q, k, v, scale, tp_q, tp_k, sliding_window):
    name = "attention_cte"
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        shape_error(name, f"q, k, v must be 3-D (heads folded into batch), got {q.shape}, "
                    f"{k.shape}, {v.shape}", "reshape to (batch*heads, S, d) / (batch*heads, d, S)")
    B, Sq, d = q.shape if tp_q else (q.shape[0], q.shape[2], q.shape[1])
    Bkv, Skv, dk = k.shape if tp_k else (k.shape[0], k.shape[2], k.shape[1])
    if d > P:
        shape_error(name, f"head dim d={d} exceeds the limit d <= {P} (one TensorE contraction "
                    "over the partition dimension)", "split the head dimension or use d <= 128")
    if dk != d or tuple(v.shape) != (Bkv, Skv, d):
        shape_error(name, f"inconsistent shapes q {q.shape} (tp_q={tp_q}), k {k.shape} "
                    f"(tp_k={tp_k}), v {v.shape}: v must be (Bkv, Skv, d) = ({Bkv}, {Skv}, {d})",
                    "pass k and v with the same Bkv, Skv and the head dim of q")
    if B % Bkv:
        shape_error(name, f"query batch {B} is not a multiple of kv batch {Bkv} (GQA groups)",
                    "fold heads so that B = Bkv * (query heads per kv head)")
    if not scale > 0:
        arg_error(name, f"scale={scale} must be > 0", "pass the softmax scale, e.g. 1/sqrt(d)")
    if sliding_window is not None and sliding_window < 1:
        arg_error(name, f"sliding_window={sliding_window} must be >= 1", "pass None or W >= 1")
    return B, Sq, d, Bkv, Skv


def _check_options(k, v, k_prior, v_prior, prior_used_len, sink, B, Bkv, d, tp_k, cp_offset,
                   global_cp_deg, cp_strided_q_slicing):
    """Validate the optional arguments; returns (prefix length Sp (0 without a prefix),
    prior_used_len as an int when it is static, query position step)."""
    name = "attention_cte"
    if int(cp_offset) != cp_offset or cp_offset < 0:
        arg_error(name, f"cp_offset={cp_offset} must be an int >= 0 (the global position of "
                  "this rank's first query)", "pass rank * (global Sq / global_cp_deg), or the "
                  "rank with cp_strided_q_slicing=True")
    if int(global_cp_deg) != global_cp_deg or global_cp_deg < 1:
        arg_error(name, f"global_cp_deg={global_cp_deg} must be an int >= 1",
                  "pass the context-parallel degree")
    qstep = 1
    if cp_strided_q_slicing:
        if cp_offset >= global_cp_deg:
            arg_error(name, f"cp_offset={cp_offset} must be < global_cp_deg={global_cp_deg} with "
                      "cp_strided_q_slicing=True (query row i sits at global position "
                      "cp_offset + i * global_cp_deg)", "pass the rank id as cp_offset")
        qstep = int(global_cp_deg)
    if sink is not None and tuple(sink.shape) != (B,):
        shape_error(name, f"sink has shape {tuple(sink.shape)}, expected ({B},): one logit per "
                    "query batch (heads folded into the batch)", "pass sinks repeated per batch")
    if k_prior is None and v_prior is None:
        if prior_used_len is not None:
            arg_error(name, "prior_used_len is given without k_prior / v_prior",
                      "pass k_prior and v_prior (the prefix keys / values) too, or drop it")
        return 0, 0, qstep
    if k_prior is None or v_prior is None:
        arg_error(name, f"prefix KV needs both k_prior and v_prior, got only "
                  f"{'k_prior' if v_prior is None else 'v_prior'}",
                  "pass both (k_prior in the layout of k, v_prior in the layout of v)")
    if k_prior.ndim != 3 or v_prior.ndim != 3:
        shape_error(name, f"k_prior {tuple(k_prior.shape)} and v_prior {tuple(v_prior.shape)} "
                    "must be 3-D", "use the layouts of k and v")
    Sp = k_prior.shape[1] if tp_k else k_prior.shape[2]
    kp_want = (Bkv, Sp, d) if tp_k else (Bkv, d, Sp)
    if tuple(k_prior.shape) != kp_want or tuple(v_prior.shape) != (Bkv, Sp, d):
        shape_error(name, f"inconsistent prefix shapes k_prior {tuple(k_prior.shape)}, v_prior "
                    f"{tuple(v_prior.shape)} (tp_k={tp_k}): expected k_prior {kp_want} and "
                    f"v_prior {(Bkv, Sp, d)} (the layouts of k and v with the prefix length)",
                    "pass the prefix with the kv batch and head dim of k / v")
    if k_prior.dtype != k.dtype or v_prior.dtype != v.dtype:
        arg_error(name, f"k_prior / v_prior dtypes ({k_prior.dtype}, {v_prior.dtype}) must match "
                  f"k / v ({k.dtype}, {v.dtype})", "cast the prefix to the dtype of k / v")
    if prior_used_len is None:
        return Sp, Sp, qstep
    if isinstance(prior_used_len, (int, float)) and not isinstance(prior_used_len, bool):
        if int(prior_used_len) != prior_used_len or not 0 <= prior_used_len <= Sp:
            arg_error(name, f"prior_used_len={prior_used_len} is out of range: it must be an int "
                      f"in [0, {Sp}] (the prefix length of k_prior / v_prior)",
                      "pass the number of valid prefix positions")
        return Sp, int(prior_used_len), qstep
    if not hasattr(prior_used_len, "shape") or prior_used_len.size != 1:
        shape_error(name, f"prior_used_len must be an int or a 1-element tensor (shape (1,)), got "
                    f"{getattr(prior_used_len, 'shape', type(prior_used_len).__name__)}",
                    "pass one length shared by all batches")
    return Sp, None, qstep  # run-time value: masked dynamically


@nki.jit
def attention_cte(q, k, v, scale=1.0, causal_mask=True, k_prior=None, v_prior=None,
                  prior_used_len=None, sink=None, sliding_window=None, tp_q=True, tp_k=False,
                  tp_out=False, cache_softmax=False, cp_offset=0, global_cp_deg=1,
                  cp_strided_q_slicing=False):
    """Flash-attention forward (prefill). See the module docstring for layouts and limits.

    Returns ``out``, or ``(out, lse)`` with ``cache_softmax=True``.
    """
    B, Sq, d, Bkv, Skv = _check(q, k, v, scale, tp_q, tp_k, sliding_window)
    Sp, used, qstep = _check_options(k, v, k_prior, v_prior, prior_used_len, sink, B, Bkv, d,
                                     tp_k, cp_offset, global_cp_deg, cp_strided_q_slicing)
    # Key index space of K^T / V in SBUF: prefix keys 0..Sp-1, the chunk's keys from Spad
    # (Sp rounded up to 128, so every 128-key chunk holds keys of one source only).
    Spad = cdiv(Sp, P) * P
    Ktot = Spad + Skv
    mdt = matmul_dtype(q.dtype)
    group = B // Bkv
    nqt = cdiv(Sq, P)
    out = nl.ndarray((B, d, Sq) if tp_out else (B, Sq, d), q.dtype, buffer=nl.shared_hbm)
    lse = None
    if cache_softmax:
        lse = nl.ndarray((B, P, nqt), nl.float32, buffer=nl.shared_hbm)
    ident = nl.shared_identity_matrix(P, mdt)
    ident_o = ident if q.dtype == mdt else nl.shared_identity_matrix(P, q.dtype)

    # PSUM (8 banks): 6 rotating score banks, 1 bank of P^T (two halves, or one for fp32),
    # 1 bank holding both output accumulators [128, d+1] and a [128, 128] transpose scratch.
    s_ps = [nl.ndarray((P, KT), nl.float32, buffer=nl.psum) for _ in range(NSBUF)]
    pt_ps = nl.ndarray((P, 2 if mdt != nl.float32 else 1, 4, P), mdt, buffer=nl.psum)
    acc_ps = nl.ndarray((P, 4 * P), nl.float32, buffer=nl.psum)
    o_ps = [acc_ps[:, 0:P + 1], acc_ps[:, P + 1:2 * P + 2]]
    misc_ps = acc_ps[:, 3 * P:4 * P]
    misc_q = []  # work item whose transposed Q waits in misc_ps for q_prep

    def misc_free():
        """Finish a Q tile parked in misc_ps before another use of misc_ps overwrites it."""
        if misc_q:
            q_prep(misc_q[0])

    resident = Ktot * d * mdt.itemsize // P + cdiv(Ktot, P) * d * mdt.itemsize <= RESIDENT_KV_BYTES
    kv_cache = {}
    kv_started = []

    def load_seg(ks, vs, Ss, bkv, k0, r0, width, kt, vt, kbase, parts="kv"):
        """DMA rows r0..r0+width of (ks, vs) (sequence length Ss) to key index k0 (k0 - kbase a
        multiple of 128) of K^T [d, *] / V [128, *, d] (parts: "k", "v" or both)."""
        c_lo = k0 - kbase
        if "k" not in parts:
            pass
        elif tp_k:
            for c in range(cdiv(width, P)):
                kc = min(P, width - c * P)
                rc = r0 + c * P
                raw = nl.ndarray((kc, d), k.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=raw, src=ks[bkv, rc:rc + kc, :])
                misc_free()
                nisa.nc_matmul(misc_ps[:d, :kc], raw, ident_k[:kc, :kc], is_transpose=True)
                nisa.tensor_copy(kt[:, c_lo + c * P:c_lo + c * P + kc], misc_ps[:d, :kc])
        else:
            nisa.dma_copy(dst=kt[:, c_lo:c_lo + width], src=ks[bkv, :, r0:r0 + width])
        if "v" not in parts:
            return
        ch0 = c_lo // P
        full = width // P
        # V_aug = [V | 1]: the ones column makes the P V matmuls also produce the row sums
        nisa.memset(vt[:, ch0:ch0 + cdiv(width, P), d:d + 1], 1.0, engine=nisa.engine.gpsimd)
        if full:
            # one DMA: row r0 + c*128 + p of v goes to partition p, chunk ch0 + c
            nisa.dma_copy(dst=vt[:, ch0:ch0 + full, :d], src=vs.ap(
                [[d, P], [P * d, full], [1, d]], offset=(bkv * Ss + r0) * d))
        if width % P:
            tail = width % P
            nisa.dma_copy(dst=vt[:tail, ch0 + full, :d], src=vs[bkv, r0 + full * P:r0 + width, :])

    def load_kv(bkv, k0, width, kt, vt, kbase, parts="kv"):
        """Keys k0..k0+width of the SBUF key index space: prefix part, then the chunk's part."""
        if k0 < Sp:
            w = min(width, Sp - k0)
            load_seg(k_prior, v_prior, Sp, bkv, k0, k0, w, kt, vt, kbase, parts)
        if k0 + width > Spad:
            a = max(k0, Spad)
            load_seg(k, v, Skv, bkv, a, a - Spad, k0 + width - a, kt, vt, kbase, parts)

    def kv_get(bkv, sk0, swidth):
        """(K^T, V, first key held) covering keys sk0..sk0+swidth of kv batch bkv.

        Resident mode keeps the whole K^T [d, Skv] / V [128, Skv/128, d] of the kv batch in
        SBUF, loaded in blocks of 2048 keys so the first section only waits for its block."""
        if not resident:
            kt = nl.ndarray((d, swidth), mdt, buffer=nl.sbuf)
            vt = nl.ndarray((P, cdiv(swidth, P), d + 1), mdt, buffer=nl.sbuf)
            load_kv(bkv, sk0, swidth, kt, vt, sk0)
            return kt, vt, sk0
        if bkv not in kv_cache:
            kv_cache.clear()  # drop the previous kv batch (frees its SBUF)
            kt = nl.ndarray((d, Ktot), mdt, buffer=nl.sbuf)
            vt = nl.ndarray((P, cdiv(Ktot, P), d + 1), mdt, buffer=nl.sbuf)
            kv_cache[bkv] = (kt, vt, set())
        kt, vt, loaded = kv_cache[bkv]
        # Blocks are loaded on first use, so the DMA queues carry them in the order the
        # sections need them, interleaved with the Q loads (not all of K/V ahead of them).
        for b0 in range((sk0 // KVBLK) * KVBLK, sk0 + swidth, KVBLK):
            if b0 not in loaded:
                loaded.add(b0)
                bw = min(KVBLK, Ktot - b0)
                if not kv_started:
                    # the kernel's very first block: K^T first, in 128-key DMAs (small
                    # transfers side by side on the queues, ~2.7 us each instead of ~4.2 us
                    # per 64 KiB chunk), then V (needed only by the P V two steps later)
                    kv_started.append(True)
                    for lo in range(0, min(bw, KPIECES * P), P):
                        load_kv(bkv, b0 + lo, min(P, bw - lo), kt, vt, 0, "k")
                    if KPIECES * P < bw:
                        load_kv(bkv, b0 + KPIECES * P, bw - KPIECES * P, kt, vt, 0, "k")
                    load_kv(bkv, b0, bw, kt, vt, 0, "v")
                else:
                    load_kv(bkv, b0, bw, kt, vt, 0)
        return kt, vt, 0

    ident_k = ident if (not tp_k or k.dtype == mdt) else nl.shared_identity_matrix(P, k.dtype)
    used_sb = None
    if Sp and used is None:
        # run-time prior_used_len, broadcast to every partition (as fp32, for range_select)
        used_sb = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=used_sb, src=prior_used_len.ap([[0, P], [1, 1]]))

    items = []
    warm = set()  # (kv batch, query tile) of the causal warm-up tiles
    for bkv in range(Bkv):
        # longest query tiles (most keys under a causal mask) first: the pipeline fills with
        # long sections and the short tiles drain it -- except for a few tiles that need only
        # the first K/V block, which keep TensorE busy while the rest of K/V is loaded
        order = list(range(nqt - 1, -1, -1))
        if causal_mask and resident and not Sp and qstep == 1:
            first = [qi for qi in order if (qi + 1) * P <= KVBLK][:WARMUP_TILES]
            order = first + [qi for qi in order if qi not in first]
            warm.update((bkv, qi) for qi in first)
        for qi in order:
            for g in range(group):
                items.append((bkv * group + g, bkv, qi))
    pid = nl.program_id(0)
    nprog = nl.num_programs()
    mine = [items[n] for n in range(pid, len(items), nprog)]
    if PAIR and warm:
        # Causal: a query tile whose last section has r < SEC key tiles is followed (same kv
        # batch) by one with SEC - r (2 by 2), so the pipeline runs the two partial sections as
        # one SEC-tile step (see the section grouping below); warm-up tiles stay first.
        def rem(it):
            return cdiv(min(Skv, cp_offset + it[2] * P + P), KT) % SEC
        paired = []
        for bkv in dict.fromkeys(it[1] for it in mine):  # kv batches in order
            seg = [it for it in mine if it[1] == bkv]
            paired += [it for it in seg if (bkv, it[2]) in warm]
            pool = [it for it in seg if (bkv, it[2]) not in warm]
            while pool:
                it = pool.pop(0)
                paired.append(it)
                r = rem(it)
                if r and 2 * r != SEC:
                    mate = [x for x in pool if rem(x) == SEC - r]
                    if mate:
                        pool.remove(mate[0])
                        paired.append(mate[0])
        mine = paired

    W = sliding_window

    def qpos(q0, rows):
        """Global positions of the first and last query row of a tile (for the masks)."""
        return cp_offset + q0 * qstep, cp_offset + (q0 + rows - 1) * qstep

    # Flat list of sections: (item index, section index, tiles, last section of the item?)
    # Tiles are (first key index in SBUF, width); prefix tiles (index < Spad) come first.
    groups = []  # pipeline steps: lists of sections (of different items)
    for n in range(len(mine)):
        b, bkv, qi = mine[n]
        q0 = qi * P
        rows = min(P, Sq - q0)
        qp, ql = qpos(q0, rows)
        tiles = []
        # prefix key j sits at position j - prior_used_len: causal never drops it, the window
        # keeps j >= pos + used - W + 1 (only queries at positions <= W - 2 can see the prefix)
        if Sp and used != 0 and (W is None or qp <= W - 2):
            p_hi = Sp if used is None else used
            p_lo = 0 if W is None or used is None else max(0, qp + used - W + 1) // P * P
            tiles += [(k0, min(KT, p_hi - k0)) for k0 in range(p_lo, p_hi, KT)]
        hi = min(Skv, ql + 1) if causal_mask else Skv
        lo = max(0, qp - W + 1) if W is not None else 0
        lo = (lo // P) * P
        tiles += [(Spad + k0, min(KT, hi - k0)) for k0 in range(lo, hi, KT)]
        if not tiles:
            arg_error("attention_cte", f"query rows {q0}..{q0 + rows - 1} keep no key (Skv={Skv}, "
                      f"sliding_window={W}, prefix keys used={used})",
                      "every query needs at least one key")
        r = len(tiles) % SEC
        pl = groups[-1] if groups else None
        merge = (PAIR and r and pl is not None and len(pl) == 1 and pl[0][3]
                 and pl[0][0] == n - 1 and len(pl[0][2]) + r <= SEC)
        if merge:
            # this item's partial section goes first and shares a pipeline step with the
            # previous item's partial last section (two items, two PSUM accumulators)
            bounds = [0] + list(range(r, len(tiles) + 1, SEC))
        else:
            bounds = list(range(0, len(tiles), SEC)) + [len(tiles)]
        nsec = len(bounds) - 1
        for si in range(nsec):
            job = (n, si, tiles[bounds[si]:bounds[si + 1]], si == nsec - 1)
            if merge and si == 0:
                pl.append(job)
            else:
                groups.append([job])

    states = {}
    masks = {}
    max_slots = SCALAR_MAX_SLOTS_V4 if nisa.get_nc_version() == nisa.nc_version.gen4 \
        else SCALAR_MAX_SLOTS
    counter = [0, 0, 0]  # score tiles seen (max-engine balance), P^T half, score buffer

    def mask_for(rows, kw, q0, k0, causal, window):
        key = (rows, kw, q0 - k0 if causal else None, k0 - q0 if window is not None else None)
        if key not in masks:
            mask = nl.ndarray((rows, kw), mdt, buffer=nl.sbuf)
            _mask_tile(rows, kw, q0, k0, causal, window, mask, qstep)
            masks[key] = mask
        return masks[key]

    def prefix_mask(rows, kw, k0, qp, ub, st):
        """0 / NEG_BIG mask [rows, kw] of a prefix tile (see a_tile), built on GpSimd; without a
        window it does not depend on the query rows (cached per tile)."""
        key = ("prefix", rows, kw, k0, qp if W is not None else None)
        if key not in masks:
            idx = nl.ndarray((rows, kw), nl.float32, buffer=nl.sbuf)
            nisa.iota(idx, [[1, kw]], offset=k0, channel_multiplier=0)
            mask = nl.ndarray((rows, kw), mdt, buffer=nl.sbuf)
            # drop j >= used: (j >= used) * NEG_BIG
            nisa.tensor_scalar(mask, idx, nl.greater_equal, ub, op1=nl.multiply,
                               operand1=NEG_BIG, engine=nisa.engine.gpsimd)
            if W is not None:
                # drop j < pos_p + used - W + 1; min() of two 0 / NEG_BIG masks (no -inf)
                low = nl.ndarray((rows, kw), mdt, buffer=nl.sbuf)
                nisa.tensor_scalar(low, idx, nl.less, st["pb"], op1=nl.multiply,
                                   operand1=NEG_BIG, engine=nisa.engine.gpsimd)
                nisa.tensor_tensor(mask, mask, low, nl.minimum, engine=nisa.engine.gpsimd)
            masks[key] = mask
        return masks[key]

    def next_sbuf():
        counter[2] += 1
        return counter[2] % NSBUF

    qpend = {}  # work item -> Q tiles loaded (and maybe transposed) ahead of use

    def q_load(n):
        """Issue the DMA of work item n's Q tile (prefetched a few items ahead of its use)."""
        if n >= len(mine) or n in states or n in qpend:
            return
        b, bkv, qi = mine[n]
        q0 = qi * P
        rows = min(P, Sq - q0)
        if tp_q:
            qraw = nl.ndarray((rows, d), q.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=qraw, src=q[b, q0:q0 + rows, :])
        else:
            qraw = nl.ndarray((d, rows), q.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=qraw, src=q[b, :, q0:q0 + rows])
        qpend[n] = {"raw": qraw, "rows": rows, "tp": False}

    def q_transpose(n):
        """TensorE transpose of item n's Q tile into misc_ps (tp_q), parked there until
        q_prep(n) (other users of misc_ps call misc_free() first)."""
        if n >= len(mine) or n in states:
            return
        q_load(n)
        pq = qpend[n]
        if tp_q and not pq["tp"]:
            rows = pq["rows"]
            misc_free()
            nisa.nc_matmul(misc_ps[:d, :rows], pq["raw"], ident_o[:rows, :rows],
                           is_transpose=True)
            pq["tp"] = True
            misc_q.append(n)

    def q_prep(n):
        """Q^T [d, rows] of work item n, pre-multiplied by the softmax scale, and its state."""
        if n >= len(mine) or n in states:
            return
        q_transpose(n)
        pq = qpend.pop(n)
        rows = pq["rows"]
        qT = nl.ndarray((d, P), mdt, buffer=nl.sbuf)
        if tp_q:
            misc_q.remove(n)
            nisa.tensor_scalar(qT[:, :rows], misc_ps[:d, :rows], nl.multiply, float(scale))
        else:
            # GpSimd: idle, and this never touches PSUM
            nisa.tensor_scalar(qT[:, :rows], pq["raw"], nl.multiply, float(scale),
                               engine=nisa.engine.gpsimd)
        states[n] = {"qT": qT, "nm": None, "m": None, "o": o_ps[n % 2], "first": True}

    def a_init(job):
        """Section start: Q^T (first section of a query tile) and the K^T / V it needs."""
        n, si, sec, last = job
        b, bkv, qi = mine[n]
        q0 = qi * P
        rows = min(P, Sq - q0)
        q_prep(n)
        sk0 = sec[0][0]
        kt, vt, kbase = kv_get(bkv, sk0, sec[-1][0] + sec[-1][1] - sk0)
        return {"n": n, "b": b, "qi": qi, "q0": q0, "rows": rows, "sec": sec, "last": last,
                "st": states[n], "kt": kt, "vt": vt, "kbase": kbase, "alpha": None,
                "tmax": nl.ndarray((rows, len(sec)), nl.float32, buffer=nl.sbuf),
                "pts": [None] * len(sec), "sidx": [next_sbuf() for _ in sec]}

    def a_tile(js, t):
        """Scores of one key tile (+ mask) and their row maximum."""
        k0, kw = js["sec"][t]
        rows, kbase = js["rows"], js["kbase"]
        qp, ql = qpos(js["q0"], rows)  # mask positions of the first / last query row
        s = s_ps[js["sidx"][t]][:rows, :kw]
        nisa.nc_matmul(s, js["st"]["qT"][:, :rows], js["kt"][:, k0 - kbase:k0 - kbase + kw],
                       accumulate=False)
        tmax = js["tmax"]
        pmask = k0 < Spad and (used is None or (W is not None and ql + used - W + 1 > k0))
        if k0 >= Spad:
            kp = k0 - Spad  # position of the tile's first key
            need_causal = causal_mask and kp + kw - 1 > qp
            need_window = W is not None and kp <= ql - W
            if need_causal or need_window:
                # add the 0/-3e38 mask on TensorE (I @ mask accumulates into the scores): TensorE
                # is 2.5x faster than VectorE per element and GpSimd cannot read PSUM. Only the
                # columns some row drops need it: j > qp - kp (causal), j <= ql - W - kp (window).
                lo_c = max(0, qp - kp + 1) if need_causal else kw
                hi_c = min(kw, ql - W + 1 - kp) if need_window else 0
                c0 = min(lo_c, 0 if need_window else kw)
                c1 = max(kw if need_causal else 0, hi_c)
                mask = mask_for(rows, c1 - c0, qp, kp + c0, need_causal,
                                W if need_window else None)
                nisa.nc_matmul(s[:, c0:c1], ident[:rows, :rows], mask, accumulate=True)
        use_scalar = counter[0] % 16 in max_slots
        if pmask:
            # Prefix tile: keep prefix index j < prior_used_len (a run-time value when it is a
            # tensor) and, with a window, j >= pos + prior_used_len - W + 1.
            st = js["st"]
            ub = float(used) if used is not None else used_sb[:rows]
            if W is not None and "pb" not in st:
                # per-row lower bound pos_p + used - W + 1 (pos_p = qp + qstep * p)
                pb = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
                nisa.iota(pb, [[1, 1]], offset=qp - W + 1 + (used or 0), channel_multiplier=qstep)
                if used is None:
                    nisa.tensor_tensor(pb, pb, used_sb[:rows], nl.add, engine=nisa.engine.gpsimd)
                st["pb"] = pb
            if use_scalar:
                # ScalarE max slot: an additive mask built on GpSimd, added on TensorE
                nisa.nc_matmul(s, ident[:rows, :rows], prefix_mask(rows, kw, k0, qp, ub, st),
                               accumulate=True)
                pmask = False
            else:
                # one VectorE range_select on the scores in PSUM (in place) that also yields
                # the row maximum (replacing the max reduction)
                nisa.range_select(s, s, nl.less, nl.greater_equal, ub,
                                  st["pb"] if W is not None else 0.0,
                                  reduce_res=tmax[:, t:t + 1], reduce_op=nl.maximum,
                                  range_start=float(k0))
        # Row maxima on VectorE, or for SCALAR_MAX_SLOTS on ScalarE (a copy activation with a
        # max reduction) -- balances VectorE (max + P^T copies) against ScalarE (exp).
        if pmask:
            pass  # the range_select produced the row max
        elif use_scalar:
            junk = nl.ndarray((rows, kw), mdt, buffer=nl.sbuf)
            nisa.activation(junk, nl.copy, s, reduce_op=nl.maximum, reduce_res=tmax[:, t:t + 1])
        else:
            nisa.tensor_reduce(tmax[:, t:t + 1], nl.maximum, s, axis=1)
        counter[0] += 1
        # Running max folded on the otherwise idle GpSimd as each tile's max lands, so when the
        # section's last max is done only one [P, 1] op separates it from the exps (a tree
        # over the whole section put ~5 GpSimd ops on ScalarE's critical path).
        st, last = js["st"], t == len(js["sec"]) - 1
        prev = js["run"] if t else st["m"]
        col = tmax[:, t:t + 1]
        if last:
            nm_new = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            if prev is None:
                nisa.tensor_scalar(nm_new, col, nl.multiply, -1.0, engine=nisa.engine.gpsimd)
                js["m_new"] = col
            else:
                nisa.tensor_scalar(nm_new, col, nl.maximum, prev, op1=nl.multiply, operand1=-1.0,
                                   engine=nisa.engine.gpsimd)
                m_new = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(m_new, col, nl.maximum, prev, engine=nisa.engine.gpsimd)
                js["m_new"] = m_new
            js["nm_new"] = nm_new
            js["nm_old"] = st["nm"]
            st["nm"], st["m"] = nm_new, js["m_new"]
        elif prev is None:
            js["run"] = col
        else:
            run = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(run, col, nl.maximum, prev, engine=nisa.engine.gpsimd)
            js["run"] = run

    def a_exp(js, t):
        """P = exp(S - m) of one key tile, m the running max after the whole section."""
        k0, kw = js["sec"][t]
        rows = js["rows"]
        if t == 0:
            js["probs"] = [None] * len(js["sec"])
        p_sb = nl.ndarray((rows, kw), mdt, buffer=nl.sbuf)
        nisa.activation(p_sb, nl.exp, s_ps[js["sidx"][t]][:rows, :kw], bias=js["nm_new"])
        js["probs"][t] = p_sb

    def a_alpha(js):
        """Rescale factor exp(m_old - m_new) of the section (b_init needs it one step later)."""
        if js["nm_old"] is not None:
            alpha = nl.ndarray((js["rows"], 1), nl.float32, buffer=nl.sbuf)
            # exp(m_old - m_new) = exp(-nm_old + nm_new)
            nisa.activation(alpha, nl.exp, js["nm_old"], bias=js["nm_new"], scale=-1.0)
            js["alpha"] = alpha

    def b_init(js):
        """Rescale the PSUM accumulator by exp(m_old - m_new) before this section's P V."""
        if js["alpha"] is not None:
            o_acc, rows = js["st"]["o"], js["rows"]
            nisa.tensor_scalar(o_acc[:rows, :d + 1], o_acc[:rows, :d + 1], nl.multiply,
                               js["alpha"])

    def b_transpose(js, t):
        """P^T of one key tile: 128x128 TensorE transposes into PSUM, one copy to SBUF."""
        k0, kw = js["sec"][t]
        rows = js["rows"]
        nch = cdiv(kw, P)
        p_sb = js["probs"][t]
        half = pt_ps[:, counter[1] % pt_ps.shape[1]]
        counter[1] += 1
        for c in range(nch):
            kc = min(P, kw - c * P)
            nisa.nc_matmul(half[:kc, c, :rows], p_sb[:, c * P:c * P + kc],
                           ident[:rows, :rows], is_transpose=True)
        pT = nl.ndarray((P, 4, P), mdt, buffer=nl.sbuf)
        if kw == KT:
            nisa.tensor_copy(pT[:, :, :rows], half[:, :, :rows])
        else:
            for c in range(nch):
                kc = min(P, kw - c * P)
                nisa.tensor_copy(pT[:kc, c, :rows], half[:kc, c, :rows])
        js["probs"][t] = None
        js["pts"][t] = pT

    def b_pv(js, t):
        """O_aug += P V_aug for one key tile (the ones column accumulates the row sums)."""
        k0, kw = js["sec"][t]
        rows, st = js["rows"], js["st"]
        for c in range(cdiv(kw, P)):
            kc = min(P, kw - c * P)
            ch = (k0 - js["kbase"]) // P + c
            nisa.nc_matmul(st["o"][:rows, :d + 1], js["pts"][t][:kc, c, :rows],
                           js["vt"][:kc, ch, :], accumulate=not st["first"])
            st["first"] = False
        js["pts"][t] = None

    def b_final(js):
        """Normalise by the row sums and store (and the log-sum-exp with cache_softmax)."""
        rows, st, b, q0, qi = js["rows"], js["st"], js["b"], js["q0"], js["qi"]
        o_acc = st["o"]
        # One ScalarE copy frees the PSUM accumulator; the rest runs on the idle GpSimd
        # (VectorE, which also copies every P^T, is the busier of the PSUM readers).
        o_f = nl.ndarray((rows, d + 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(o_f, nl.copy, o_acc[:rows, :d + 1])
        lsum = o_f[:, d:d + 1]
        if sink is not None:
            # the sink is one more logit in the softmax denominator, exp(sink - m), with no value
            sk = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=sk, src=sink.ap([[0, rows], [1, 1]], offset=b))
            es = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation(es, nl.exp, sk, bias=st["nm"])
            nisa.tensor_tensor(lsum, lsum, es, nl.add, engine=nisa.engine.gpsimd)
        o_sb = nl.ndarray((rows, d), q.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(o_sb, o_f[:, :d], nl.divide, lsum, engine=nisa.engine.gpsimd)
        if tp_out:
            misc_free()
            nisa.nc_matmul(misc_ps[:d, :rows], o_sb, ident_o[:rows, :rows], is_transpose=True)
            o_t = nl.ndarray((d, rows), q.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(o_t, misc_ps[:d, :rows])
            nisa.dma_copy(dst=out[b, :, q0:q0 + rows], src=o_t)
        elif js["n"] >= len(mine) - 2:
            # the kernel's last stores end the run: 8 small DMAs side by side on the queues
            # finish sooner (the fixed cost is paid in parallel) than one 32 KiB transfer
            step = cdiv(rows, 8)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                nisa.dma_copy(dst=out[b, q0 + r0:q0 + r1, :], src=o_sb[r0:r1, :])
        else:
            nisa.dma_copy(dst=out[b, q0:q0 + rows, :], src=o_sb)
        if cache_softmax:
            lg = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation(lg, nl.log, lsum)
            nisa.tensor_tensor(lg, lg, st["nm"], nl.subtract)  # log(l) + m
            nisa.dma_copy(dst=lse[b, :rows, qi:qi + 1], src=lg)
        del states[js["n"]]

    # Software pipeline over sections: the scores and row maxima of section j+LAG are issued
    # interleaved, tile by tile, with the transposes and P V matmuls of section j, and the
    # exps of j+LAG after them -- so no engine's in-order queue waits behind another's chain.
    for m in range(QPF + 2):
        q_load(m)  # the first Q tiles ahead of the first K/V block in the DMA queues
    hist = []
    for i in range(len(groups) + LAG):
        curs = [a_init(job) for job in groups[i]] if i < len(groups) else []
        misc_free()  # scale the Q transposed last iteration (VectorE) well before its use
        prevs = hist[i - LAG] if 0 <= i - LAG < len(groups) else []
        if curs:
            # Q of the next items: DMAs QPF items ahead, the next item's transpose now (TensorE)
            # and its scaling after this iteration's tiles (VectorE), so neither engine waits
            nxt = curs[-1]["n"] + 1
            for m in range(nxt, nxt + 1 + QPF):
                q_load(m)
        for js in prevs:
            b_init(js)
        # Per key tile k: transposes (+ PSUM->SBUF copy) of section j, scores (+ row max) of
        # section j+LAG, then P V of section j's tile k-1 -- whose copy went ahead of the max
        # in VectorE's queue, so TensorE never waits for it.
        ops = []
        for x, (js, t) in enumerate([(js, t) for js in prevs for t in range(len(js["sec"]))]):
            ops.append((x, 0, b_transpose, js, t))
            ops.append((x + 1, 2, b_pv, js, t))
        for x, (js, t) in enumerate([(js, t) for js in curs for t in range(len(js["sec"]))]):
            ops.append((x, 1, a_tile, js, t))
        ops.sort(key=lambda o: (o[0], o[1]))
        for _, _, fn, js, t in ops:
            fn(js, t)
        for js in prevs:
            if js["last"]:
                b_final(js)
        if curs:
            # TensorE transposes the next item's Q now; VectorE scales it when the item
            # starts (a_init), by when TensorE is long done with it
            q_transpose(nxt)
        for js in curs:
            for t in range(len(js["sec"])):
                a_exp(js, t)
            a_alpha(js)
        hist.append(curs)
        if i >= LAG:
            hist[i - LAG] = None  # done: free its tiles (and its hold on an old kv batch's K/V)
    if cache_softmax:
        return out, lse
    return out


def attention_ref(q, k, v, scale=1.0, causal_mask=True, k_prior=None, v_prior=None,
                  prior_used_len=None, sink=None, sliding_window=None, tp_q=True, tp_k=False,
                  tp_out=False, cache_softmax=False, cp_offset=0, global_cp_deg=1,
                  cp_strided_q_slicing=False):
    """PyTorch reference of :func:`attention_cte` (same layouts; computed in float32).

    Keys are ``concat(k_prior[:prior_used_len], k)`` at positions ``-used .. -1, 0 .. Skv-1``;
    query row i sits at position ``cp_offset + i`` (``cp_offset + i * global_cp_deg`` with
    ``cp_strided_q_slicing``). Causal keeps key positions <= the query's, the window keeps
    query - key < W. Returns the output in the dtype of ``q`` (and the float32 lse, in the
    kernel's (B, 128, ceil(Sq/128)) layout with zero padding, when ``cache_softmax``).
    """
    import torch
    qf = (q if tp_q else q.transpose(1, 2)).float()
    kf = (k if tp_k else k.transpose(1, 2)).float()
    vf = v.float()
    B, Sq, d = qf.shape
    Bkv, Skv, _ = kf.shape
    used = 0
    if k_prior is not None:
        kp = (k_prior if tp_k else k_prior.transpose(1, 2)).float()
        Sp = kp.shape[1]
        used = Sp if prior_used_len is None else int(torch.as_tensor(prior_used_len).reshape(-1)[0])
        if not 0 <= used <= Sp:
            raise ValueError(f"attention_ref: prior_used_len={used} must be in [0, {Sp}]")
        kf = torch.cat([kp[:, :used], kf], dim=1)
        vf = torch.cat([v_prior.float()[:, :used], vf], dim=1)
    g = B // Bkv
    kf = kf.repeat_interleave(g, 0)
    vf = vf.repeat_interleave(g, 0)
    s = torch.einsum("bqd,bkd->bqk", qf, kf) * scale
    step = global_cp_deg if cp_strided_q_slicing else 1
    i = (torch.arange(Sq) * step + cp_offset)[:, None]  # query positions
    j = (torch.arange(used + Skv) - used)[None, :]  # key positions (prefix negative)
    keep = torch.ones(Sq, used + Skv, dtype=torch.bool)
    if causal_mask:
        keep &= j <= i
    if sliding_window is not None:
        keep &= (i - j) < sliding_window
    s = s.masked_fill(~keep, float("-inf"))
    if sink is not None:
        # softmax over [scores, sink]; the sink's column carries no value
        sk = sink.float().reshape(B, 1, 1).expand(B, Sq, 1)
        lse = torch.logsumexp(torch.cat([s, sk], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bqk,bkd->bqd", torch.exp(s - lse[..., None]), vf).to(q.dtype)
    if tp_out:
        o = o.transpose(1, 2).contiguous()
    if not cache_softmax:
        return o
    nqt = math.ceil(Sq / P)
    pad = torch.zeros(B, nqt * P)
    pad[:, :Sq] = lse
    return o, pad.reshape(B, nqt, P).transpose(1, 2).contiguous()
