"""rvq3: residual vector quantization, 3 stages x 256-entry codebooks of 8-dim vectors.

Parts of an [N, K] matrix (K padded with zero weights to a multiple of 8):
  ``codes``     uint8 [N, Kp/8, 3]    one code per stage for each 8-weight subvector
  ``codebooks`` f16 [3, 256, 8]       learned per matrix
  W[n, 8j:8j+8] = (C0[c0] + C1[c1]) + C2[c2]   (fp32, in that order)
3 bits per weight plus 12 KiB of codebooks per matrix.

Codebooks are learned at quantize time by k-means (k-means++ seeding, Lloyd iterations) on
the residual of the previous stages, fitted on a seeded sample of at most ``sample``
subvectors and then applied to all of them: deterministic for a seed. Centroids are
rounded to f16 before assignment, so stored codes are optimal for the stored codebooks.
The C quantizer (kernels/quantize.c ``sk_rvq3_quantize``: one thread per matrix, the same
bytes on every host and instruction set) is the one used; without the C kernels the torch
form below runs the same algorithm with torch's random streams, so its codebooks differ (same
format, same error within noise).

The fused kernel never dequantizes: per token it builds a table of codebook-entry .
activation-subvector products ([Kp/8, 3, 256] fp32), then each output row is 3 Kp/8
lookups and adds.
"""

from __future__ import annotations

import torch

from .formats import Format, PartSpec, register

DIM, STAGES, ENTRIES = 8, 3, 256


def _nearest(v: torch.Tensor, c: torch.Tensor, chunk: int = 1 << 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the nearest centroid of each row of v, and the squared distance to it."""
    cn = (c * c).sum(1)[None, :]
    ct = c.T.contiguous()
    idx = torch.empty(v.shape[0], dtype=torch.long)
    dist = torch.empty(v.shape[0], dtype=torch.float32)
    d = torch.empty(min(chunk, v.shape[0]), c.shape[0])  # 4 MiB: stays in cache between the two passes
    for i in range(0, v.shape[0], chunk):
        vi = v[i : i + chunk]
        di = d[: vi.shape[0]]
        torch.addmm(cn, vi, ct, alpha=-2.0, out=di)  # |c|^2 - 2 v.c in one pass
        m, a = di.min(1)
        idx[i : i + chunk] = a
        dist[i : i + chunk] = (m + (vi * vi).sum(1)).clamp_min(0)
    return idx, dist


def kmeans(v: torch.Tensor, k: int, gen: torch.Generator, iters: int = 25, seed_batch: int = 1) -> torch.Tensor:
    """k centroids of the rows of v (k-means++ seeding, Lloyd iterations), deterministic for ``gen``."""
    n = v.shape[0]
    if n <= k:
        c = torch.zeros(k, v.shape[1])
        c[:n] = v
        return c
    c = torch.empty(k, v.shape[1])
    c[0] = v[torch.randint(n, (1,), generator=gen)]
    d2 = ((v - c[0]) ** 2).sum(1)
    i = 1
    while i < k:  # k-means++ seeding, ``seed_batch`` seeds drawn per round (k-means|| style)
        total = d2.sum()
        if total <= 0:
            c[i:] = c[0]
            break
        b = min(seed_batch, k - i)
        j = torch.multinomial(d2 / total, b, generator=gen)
        c[i : i + b] = v[j]
        d2 = torch.minimum(d2, torch.cdist(v, c[i : i + b]).square_().amin(1))
        i += b
    prev = None
    for _ in range(iters):
        a, dist = _nearest(v, c)
        if prev is not None and torch.equal(a, prev):
            break
        prev = a
        sums = torch.zeros_like(c).index_add_(0, a, v)
        counts = torch.bincount(a, minlength=k).float()
        empty = counts == 0
        c = torch.where(empty[:, None], c, sums / counts.clamp_min(1)[:, None])
        if empty.any():  # re-seed empty clusters at the worst-served points
            far = dist.topk(int(empty.sum())).indices
            c[empty] = v[far]
    return c


class RVQ3(Format):
    name = "rvq3"
    lossy = True
    bits_per_weight = 3.0
    block = DIM
    code = 6
    small_batch = (1, 1)  # table lookups win only for a single token; 2+ tokens: dequantize + sgemm

    threads_per_matrix = 1  # the C quantizer: convert runs an expert's matrices on several threads

    def __init__(self, sample: int = 1 << 15, iters: int = 8, seed_batch: int = 16):
        self.sample = sample
        self.iters = iters
        self.seed_batch = seed_batch

    def parts(self, n: int, k: int) -> PartSpec:
        return {"codes": (torch.uint8, (n, self.padded_k(k) // DIM, STAGES)),
                "codebooks": (torch.float16, (STAGES, ENTRIES, DIM))}

    def quantize(self, w: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
        from .cquant import rvq3_quantize

        n, k = w.shape
        kp = self.padded_k(k)
        wp = w.float() if kp == k else torch.nn.functional.pad(w.float(), (0, kp - k))
        out = rvq3_quantize(wp.reshape(-1, DIM), self.sample, self.iters, self.seed_batch, seed)
        if out is not None:
            return {"codes": out[0].reshape(n, kp // DIM, STAGES), "codebooks": out[1]}
        # the torch fallback: one torch thread: k-means is thousands of small ops, and on a busy machine each
        # multi-threaded op waits for descheduled OpenMP workers (3-4x slower on the demo model's
        # experts, see docs/quantization.md); one thread also makes the codes independent of
        # the thread setting
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._quantize(w, seed)
        finally:
            torch.set_num_threads(before)

    def _quantize(self, w: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        w = w.float()
        n, k = w.shape
        kp = self.padded_k(k)
        if kp != k:
            w = torch.nn.functional.pad(w, (0, kp - k))
        r = w.reshape(-1, DIM).clone()
        gen = torch.Generator().manual_seed(seed)
        codes = torch.empty(r.shape[0], STAGES, dtype=torch.uint8)
        books = torch.empty(STAGES, ENTRIES, DIM, dtype=torch.float16)
        for s in range(STAGES):
            pick = r if r.shape[0] <= self.sample else r[torch.randperm(r.shape[0], generator=gen)[: self.sample]]
            c = kmeans(pick, ENTRIES, gen, self.iters, self.seed_batch).half()
            books[s] = c
            a, _ = _nearest(r, c.float())
            codes[:, s] = a.to(torch.uint8)
            r -= c.float()[a]
        return {"codes": codes.reshape(n, kp // DIM, STAGES).contiguous(), "codebooks": books}

    def dequantize_rows(self, parts, n, k, r0, r1):
        c = parts["codes"][r0:r1].long()
        cb = parts["codebooks"].float()
        w = (cb[0][c[..., 0]] + cb[1][c[..., 1]]) + cb[2][c[..., 2]]  # [r, Kp/8, 8]
        return w.reshape(r1 - r0, -1)

    def _kernel_parts(self, parts):
        return parts["codes"], parts["codebooks"]

    def table_matmul(self, x: torch.Tensor, parts, n: int, k: int, rows: int = 4096) -> torch.Tensor:
        """Table-lookup product in plain torch (the fallback without C kernels): x [T, Kp] fp32."""
        t, kp = x.shape
        cb = parts["codebooks"].float()  # [3, 256, 8]
        tab = torch.einsum("tjd,sed->tjse", x.reshape(t, kp // DIM, DIM), cb).reshape(t, -1)  # [T, Kp/8*3*256]
        codes = parts["codes"].reshape(n, -1).long()  # [N, P]
        base = torch.arange(codes.shape[1]) * ENTRIES
        y = torch.empty(t, n, dtype=torch.float32)
        for r0 in range(0, n, rows):
            idx = codes[r0 : r0 + rows] + base
            y[:, r0 : r0 + rows] = tab[:, idx].sum(-1)
        return y

    def _fused_fallback(self, x, parts, n, k):
        return self.table_matmul(x, parts, n, k)


RVQ3_FORMAT = register(RVQ3())
